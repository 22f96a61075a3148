"""`gpuforge publish` and base-image resolution against moto (the test double for EC2 and SSM).
Cluster configs are validated by aws-parallelcluster's own schema (gpuforge.pcluster.validate)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml

from clusterconfigs import COMMENTED_WITHOUT_AMI
from gpuforge import cli
from gpuforge.ami import images, publish
from gpuforge.errors import UserError
from gpuforge.pcluster.config import load_config
from gpuforge.pcluster.rollout import ConfigChange
from gpuforge.pcluster.validate import AmiFacts
from gpuforge_lab.moto import MotoServer
from imagetools import baked_image


def _image(name: str) -> str:
    ec2 = boto3.client("ec2")
    instance = ec2.run_instances(ImageId="ami-785db401", MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    return str(ec2.create_image(InstanceId=instance, Name=name)["ImageId"])


def _config(queue_ami: str | None = None) -> dict[str, Any]:
    subnet = "subnet-0123456789abcdef0"
    queue: dict[str, Any] = {
        "Name": "gpu",
        "ComputeResources": [{"Name": "p5", "InstanceType": "p5.48xlarge", "MinCount": 0, "MaxCount": 4}],
        "Networking": {"SubnetIds": [subnet]},
    }
    if queue_ami:
        queue["Image"] = {"CustomAmi": queue_ami}
    return {
        "Region": "us-east-1",
        "Image": {"Os": "ubuntu2204"},
        "HeadNode": {"InstanceType": "c5.2xlarge", "Networking": {"SubnetId": subnet}},
        "Scheduling": {"Scheduler": "slurm", "SlurmQueues": [queue]},
    }


PCLUSTER_2204 = "/gpuforge/ami/pcluster/ubuntu2204/latest"


def _queue_amis(path: Path) -> dict[str, Any]:
    return {
        q["Name"]: q.get("Image", {}).get("CustomAmi") for q in load_config(path)["Scheduling"]["SlurmQueues"]
    }


def test_publish_writes_parameter_and_patches_config(
    aws: MotoServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """publish writes the per-OS parameter and every queue's image with DRAIN (not the cluster-wide image,
    which pcluster update-cluster refuses), and prints ParallelCluster's verdict on the update."""
    ami = baked_image("pcluster", "gpuforge-pcluster-1")
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(_config()))
    assert cli.main(["publish", "--flavor", "pcluster", "--ami", ami, "--cluster-config", str(config)]) == 0
    assert publish.read_parameter(PCLUSTER_2204) == ami
    assert publish.read_parameter("/gpuforge/ami/pcluster/latest") is None, "no legacy parameter is created"
    parameter = boto3.client("ssm").get_parameter(Name=PCLUSTER_2204)["Parameter"]
    assert parameter["DataType"] == "aws:ec2:image"
    patched = load_config(config)
    assert _queue_amis(config) == {"gpu": ami}
    assert "CustomAmi" not in patched["Image"]
    assert patched["Scheduling"]["SlurmSettings"] == {"QueueUpdateStrategy": "DRAIN"}
    err = capsys.readouterr().err
    assert "pcluster update-cluster accepts this change" in err and "drained" in err

    newer = baked_image("pcluster", "gpuforge-pcluster-2")
    plans = publish.publish(newer, None, [config], flavor="pcluster")
    assert publish.read_parameter(PCLUSTER_2204) == newer
    assert _queue_amis(config) == {"gpu": newer}
    (change,) = plans[0].plan.changes
    assert (change.path, change.old, change.new) == (
        "Scheduling.SlurmQueues[gpu].Image.CustomAmi",
        ami,
        newer,
    )
    assert (change.policy, change.result) == ("QUEUE_UPDATE_STRATEGY", "SUCCEEDED")


def test_22_04_and_24_04_images_have_their_own_parameter(aws: MotoServer) -> None:
    """Before: both OSes went to /gpuforge/ami/FLAVOR/latest and the last one won."""
    jammy = baked_image("dlami", "gpuforge-dlami-2204")
    noble = baked_image("dlami", "gpuforge-dlami-2404", tags=_retagged(jammy, {"gpuforge:os": "ubuntu2404"}))
    publish.publish(jammy, None, flavor="dlami")
    publish.publish(noble, None, flavor="dlami")
    assert publish.read_parameter("/gpuforge/ami/dlami/ubuntu2204/latest") == jammy
    assert publish.read_parameter("/gpuforge/ami/dlami/ubuntu2404/latest") == noble
    assert publish.published_image("dlami", "ubuntu2404")[1] == images.describe(noble)
    assert publish.published_image("dlami", "ubuntu2204")[1] == images.describe(jammy)


def _retagged(ami: str, extra: dict[str, str]) -> dict[str, str]:
    return images.describe(ami).tags | extra


def test_legacy_parameter_keeps_22_04_images_with_a_deprecation(
    aws: MotoServer, caplog: pytest.LogCaptureFixture
) -> None:
    old = baked_image("dlami", "gpuforge-dlami-old")
    publish.write_parameter("/gpuforge/ami/dlami/latest", old)
    # Read for existing users, with the deprecation named.
    assert publish.published_image("dlami", "ubuntu2204") == (
        "/gpuforge/ami/dlami/latest",
        images.describe(old),
    )
    assert "/gpuforge/ami/dlami/latest is deprecated" in caplog.text
    # A 24.04 image never lands in it; a 22.04 image still does, beside its own parameter.
    noble = baked_image("dlami", "gpuforge-dlami-2404", tags=_retagged(old, {"gpuforge:os": "ubuntu2404"}))
    publish.publish(noble, None, flavor="dlami")
    assert publish.read_parameter("/gpuforge/ami/dlami/latest") == old
    assert publish.published_image("dlami", "ubuntu2404")[1] == images.describe(noble)
    jammy = baked_image("dlami", "gpuforge-dlami-2204")
    publish.publish(jammy, None, flavor="dlami")
    assert publish.read_parameter("/gpuforge/ami/dlami/latest") == jammy
    assert publish.read_parameter("/gpuforge/ami/dlami/ubuntu2204/latest") == jammy


def test_publish_refuses_an_image_of_another_os_than_the_cluster(aws: MotoServer, tmp_path: Path) -> None:
    """Image.Os cannot change on update and ParallelCluster refuses a queue image of another OS."""
    jammy = baked_image("pcluster")
    noble = baked_image("pcluster", tags=_retagged(jammy, {"parallelcluster:os": "ubuntu2404"}))
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(_config()))
    before = config.read_text()
    with pytest.raises(UserError, match=r"image .* is ubuntu2404 .* the cluster's Image.Os is ubuntu2204"):
        publish.publish(noble, None, [config], flavor="pcluster")
    assert config.read_text() == before
    assert publish.read_parameter("/gpuforge/ami/pcluster/ubuntu2404/latest") is None


def test_publish_refuses_a_root_volume_smaller_than_the_image(aws: MotoServer, tmp_path: Path) -> None:
    """Checked with ParallelCluster's RootVolumeSizeValidator before anything moves (was: at create time)."""
    ami = baked_image("pcluster")
    size = images.describe(ami).root_volume_gib
    assert size is not None and size > 1
    small = _config()
    small["Scheduling"]["SlurmQueues"][0]["ComputeSettings"] = {
        "LocalStorage": {"RootVolume": {"Size": size - 1}}
    }
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(small))
    with pytest.raises(UserError, match=rf"Root volume size {size - 1} GiB must be equal or greater"):
        publish.publish(ami, None, [config], flavor="pcluster")
    assert publish.read_parameter(PCLUSTER_2204) is None
    # The check before a bake uses the size the bake will give the image.
    facts = AmiFacts("ubuntu2204", 100)
    small["Scheduling"]["SlurmQueues"][0]["ComputeSettings"]["LocalStorage"]["RootVolume"]["Size"] = 35
    config.write_text(yaml.safe_dump(small))
    with pytest.raises(UserError, match="Root volume size 35 GiB"):
        publish.check_configs([config], facts=facts)


def test_publish_refuses_what_pcluster_update_refuses(aws: MotoServer, tmp_path: Path) -> None:
    """COMPUTE_FLEET_STOP with a running fleet: ParallelCluster's own check says ACTION NEEDED, so nothing
    moves; --fleet-stopped (the user stops the fleet first) is accepted."""
    ami = baked_image("pcluster")
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(_config()))
    change = ConfigChange(queue_update_strategy="COMPUTE_FLEET_STOP")
    with pytest.raises(
        UserError, match=r"(?s)pcluster update-cluster refuses.*All compute nodes must be stopped"
    ):
        publish.publish(ami, None, [config], flavor="pcluster", change=change)
    assert publish.read_parameter(PCLUSTER_2204) is None
    stopped = ConfigChange(queue_update_strategy="COMPUTE_FLEET_STOP", fleet_stopped=True)
    (patched,) = publish.publish(ami, None, [config], flavor="pcluster", change=stopped)
    assert patched.plan.accepted and _queue_amis(config) == {"gpu": ami}


def test_publish_per_queue(aws: MotoServer, tmp_path: Path) -> None:
    ami = baked_image("pcluster", "gpuforge-pcluster-1")
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(_config()))
    publish.publish(ami, "/gpuforge/ami/pcluster/latest", [config], queues=["gpu"], flavor="pcluster")
    patched = load_config(config)
    assert patched["Scheduling"]["SlurmQueues"][0]["Image"]["CustomAmi"] == ami
    assert "CustomAmi" not in patched["Image"]


def test_publish_invalid_config_moves_nothing(aws: MotoServer, tmp_path: Path) -> None:
    old = baked_image("pcluster", "gpuforge-pcluster-old")
    publish.write_parameter("/gpuforge/ami/dlami/latest", old)
    bad = _config()
    bad["HeadNode"]["InstanceType"] = 42  # the schema wants a string
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(bad))
    before = config.read_text()
    new = baked_image("pcluster", "gpuforge-pcluster-new")
    with pytest.raises(UserError, match="ParallelCluster"):
        publish.publish(new, "/gpuforge/ami/dlami/latest", [config])
    assert publish.read_parameter("/gpuforge/ami/dlami/latest") == old
    assert config.read_text() == before


def test_publish_refuses_missing_image_and_bad_ids(aws: MotoServer) -> None:
    assert cli.main(["publish", "--ami", "ami-0123456789abcdef0"]) == 2
    assert cli.main(["publish", "--ami", "not-an-ami"]) == 2
    assert publish.read_parameter("/gpuforge/ami/dlami/latest") is None


def test_resolve_dlami_base_from_ssm_parameter(aws: MotoServer) -> None:
    ami = _image("Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20261120")
    boto3.client("ssm").put_parameter(Name="/test/dlami", Value=ami, Type="String")
    base = images.resolve_base("dlami", pcluster_version="3.16.1", parameter="/test/dlami")
    assert base.id == ami and base.name.startswith("Deep Learning Base")
    with pytest.raises(UserError, match="does not exist"):
        images.resolve_base("dlami", pcluster_version="3.16.1", parameter="/test/missing")


def test_resolve_pcluster_base_picks_newest_of_release(aws: MotoServer) -> None:
    old = _image("aws-parallelcluster-3.16.1-ubuntu-2204-lts-hvm-x86_64-202610010000")
    _image("aws-parallelcluster-3.16.1-ubuntu-2004-lts-hvm-x86_64-202611010000")
    _image("aws-parallelcluster-3.15.0-ubuntu-2204-lts-hvm-x86_64-202611010000")
    # Registered a second later than the others by the lab's moto_server (gpuforge_lab.moto_clock).
    new = _image("aws-parallelcluster-3.16.1-ubuntu-2204-lts-hvm-x86_64-202611150000")
    base = images.resolve_base("pcluster", pcluster_version="3.16.1", owner="self")
    assert base.id == new and base.id != old
    with pytest.raises(UserError, match=r"aws-parallelcluster-9\.9\.9"):
        images.resolve_base("pcluster", pcluster_version="9.9.9", owner="self")
    # Owner "amazon" is what production asks for; these test images are not Amazon's.
    with pytest.raises(UserError, match="owned by amazon"):
        images.resolve_base("pcluster", pcluster_version="3.16.1")


# --- The image check before anything points at an image (issue 17) ---


@pytest.mark.parametrize(
    ("flavor", "tags", "argv", "message"),
    [
        ("dlami", None, ["--flavor", "pcluster"], "it is a dlami-flavor image, not pcluster"),
        ("dlami", None, ["--flavor", "dlami", "--cluster-config", "{config}"], "take only pcluster-flavor"),
        (
            "pcluster",
            {"Name": "hand-made"},
            ["--flavor", "pcluster"],
            "lacks the gpuforge tags gpuforge:flavor",
        ),
        (
            "pcluster",
            {
                "gpuforge:flavor": "pcluster",
                "gpuforge:build-id": "b",
                "gpuforge:source-ami-id": "ami-785db401",
                "gpuforge:versions-hash": "h",
            },
            ["--flavor", "pcluster", "--cluster-config", "{config}"],
            "no parallelcluster:version tag",
        ),
        (
            "pcluster",
            {
                "gpuforge:flavor": "pcluster",
                "gpuforge:build-id": "b",
                "gpuforge:source-ami-id": "ami-785db401",
                "gpuforge:versions-hash": "h",
                "parallelcluster:version": "3.9.0",
                "parallelcluster:build_status": "available",
            },
            ["--flavor", "pcluster", "--cluster-config", "{config}"],
            "made for ParallelCluster 3.9.0, this checkout uses 3.16.1",
        ),
    ],
    ids=["flavor-mismatch", "dlami-into-pcluster-config", "not-gpuforge", "no-pcluster-tags", "old-pcluster"],
)
def test_publish_refuses_an_unfit_image_unless_forced(
    aws: MotoServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flavor: str,
    tags: dict[str, str] | None,
    argv: list[str],
    message: str,
) -> None:
    ami = baked_image(flavor, tags=tags)
    config = tmp_path / "cluster.yaml"
    config.write_text(COMMENTED_WITHOUT_AMI)
    argv = [a.replace("{config}", str(config)) for a in argv]
    assert cli.main(["publish", "--ami", ami, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpuforge: error: image {ami} cannot be used"), err
    assert message in err and "--force" in err
    assert boto3.client("ssm").describe_parameters()["Parameters"] == []
    assert config.read_text() == COMMENTED_WITHOUT_AMI
    # --force publishes, and says what it overrode.
    assert cli.main(["publish", "--ami", ami, *argv, "--force"]) == 0
    assert publish.read_parameter(f"/gpuforge/ami/{argv[1]}/ubuntu2204/latest") == ami


def test_force_warns(aws: MotoServer, caplog: pytest.LogCaptureFixture) -> None:
    ami = baked_image("dlami")
    publish.publish(ami, "/gpuforge/ami/pcluster/latest", flavor="pcluster", force=True)
    assert f"--force: using {ami} for SSM parameter /gpuforge/ami/pcluster/latest although it is a dlami" in (
        caplog.text
    )


def test_unavailable_image_is_refused() -> None:
    from gpuforge import fitness

    pending = images.Image("ami-0123456789abcdef0", "x", "", "pending", {}, ())
    found = fitness.problems(pending, "dlami", for_pcluster=False)
    assert found[0] == "it is pending, not available"


def test_publish_keeps_comments_order_and_quoting(aws: MotoServer, tmp_path: Path) -> None:
    ami = baked_image("pcluster")
    config = tmp_path / "cluster.yaml"
    config.write_text(COMMENTED_WITHOUT_AMI)
    argv = [
        "publish",
        "--flavor",
        "pcluster",
        "--ami",
        ami,
        "--cluster-config",
        str(config),
        "--cluster-wide",
    ]
    assert cli.main(argv) == 0
    expected = COMMENTED_WITHOUT_AMI.replace(
        "  Os: 'ubuntu2204'   # quoted on purpose\n",
        f"  Os: 'ubuntu2204'   # quoted on purpose\n  CustomAmi: {ami}\n",
    )
    assert config.read_text() == expected
    # Per queue: the new Image goes into the queue, everything else stays as written.
    newer = baked_image("pcluster")
    publish.publish(newer, "/gpuforge/ami/pcluster/latest", [config], queues=["gpu"], flavor="pcluster")
    text = config.read_text()
    assert text.startswith("# Training cluster for team A: keep this comment.\n")
    assert "      # p5 capacity block, see the runbook.\n" in text
    assert 'SubnetId: "subnet-0123456789abcdef0"' in text and '["subnet-0123456789abcdef0"]' in text
    assert load_config(config)["Scheduling"]["SlurmQueues"][0]["Image"] == {"CustomAmi": newer}


def test_publish_refuses_a_config_of_another_region(aws: MotoServer, tmp_path: Path) -> None:
    ami = baked_image("pcluster")
    config = tmp_path / "cluster.yaml"
    config.write_text(COMMENTED_WITHOUT_AMI.replace("Region: us-east-1", "Region: eu-west-1"))
    with pytest.raises(UserError, match="is for eu-west-1, the image is in us-east-1"):
        publish.publish(ami, "/gpuforge/ami/pcluster/latest", [config], flavor="pcluster")
