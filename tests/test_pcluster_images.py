"""A config's images against ParallelCluster's own rules: the update verdict (pcluster's ConfigPatch,
offline), Image.Os from the image, root volumes at least the image's snapshot. moto (the EC2 test double)
holds the images."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuforge import cli
from gpuforge.ami import images
from gpuforge.errors import UserError
from gpuforge.pcluster import update
from gpuforge.pcluster.generate import generate
from gpuforge.pcluster.validate import AmiFacts
from gpuforge_lab.moto import MotoServer
from imagetools import baked_image

SUBNET = "subnet-0123456789abcdef0"
OLD, NEW = "ami-0123456789abcdef0", "ami-0fedcba9876543210"


def _config() -> dict[str, Any]:
    return {
        "Region": "us-east-1",
        "Image": {"Os": "ubuntu2204", "CustomAmi": OLD},
        "HeadNode": {"InstanceType": "c5.2xlarge", "Networking": {"SubnetId": SUBNET}},
        "Scheduling": {
            "Scheduler": "slurm",
            "SlurmQueues": [
                {
                    "Name": "gpu",
                    "ComputeResources": [{"Name": "p5", "InstanceType": "p5.48xlarge", "MaxCount": 2}],
                    "Networking": {"SubnetIds": [SUBNET]},
                }
            ],
        },
    }


def _spec() -> dict[str, Any]:
    return {
        "region": "us-east-1",
        "ami": OLD,
        "head_node": {"instance_type": "c5.2xlarge", "subnet_id": SUBNET, "ssh_key": "k"},
        "queues": [
            {
                "name": "gpu",
                "subnet_ids": [SUBNET],
                "root_volume_size": 80,
                "compute_resources": [{"instance_type": "p5.48xlarge", "max_count": 2}],
            }
        ],
    }


@pytest.mark.parametrize(
    ("edit", "path", "policy", "accepted"),
    [
        (lambda c: c["Image"].update(CustomAmi=NEW), "Image.CustomAmi", "UNSUPPORTED", False),
        (lambda c: c["Image"].update(Os="ubuntu2404"), "Image.Os", "UNSUPPORTED", False),
        (
            lambda c: c["Scheduling"]["SlurmQueues"][0].update(Image={"CustomAmi": NEW}),
            "Scheduling.SlurmQueues[gpu].Image",
            "QUEUE_UPDATE_STRATEGY",
            False,  # ParallelCluster's default strategy with a running fleet: stop it first
        ),
        (
            lambda c: (
                c["Scheduling"]["SlurmQueues"][0].update(Image={"CustomAmi": NEW}),
                c["Scheduling"].update(SlurmSettings={"QueueUpdateStrategy": "DRAIN"}),
            ),
            "Scheduling.SlurmQueues[gpu].Image",
            "QUEUE_UPDATE_STRATEGY",
            True,
        ),
    ],
    ids=["cluster-wide-ami", "os", "queue-ami-no-strategy", "queue-ami-drain"],
)
def test_plan_is_parallelclusters_own_verdict(edit: Any, path: str, policy: str, accepted: bool) -> None:
    old = _config()
    new = copy.deepcopy(old)
    edit(new)
    plan = update.plan(old, new)
    (change,) = [c for c in plan.changes if c.path == path]
    assert change.policy == policy
    assert plan.accepted is accepted and change.accepted is accepted
    text = "\n".join(plan.lines())
    assert ("accepts" if accepted else "refuses") in text
    if not accepted:
        assert "to do:" in text


def test_plan_with_a_stopped_fleet_accepts_a_queue_image_without_strategy() -> None:
    old = _config()
    new = copy.deepcopy(old)
    new["Scheduling"]["SlurmQueues"][0]["Image"] = {"CustomAmi": NEW}
    assert update.plan(old, new, fleet_running=False).accepted
    assert not update.plan(old, new).accepted


def test_generate_takes_os_from_the_spec_or_the_image() -> None:
    """Before: Image.Os was the constant ubuntu2204, whatever the image was."""
    with pytest.raises(UserError, match="os: missing"):
        generate(_spec())
    assert generate(_spec(), AmiFacts("ubuntu2404", 60))["Image"]["Os"] == "ubuntu2404"
    assert generate(_spec() | {"os": "ubuntu2404"})["Image"]["Os"] == "ubuntu2404"
    with pytest.raises(UserError, match="its parallelcluster:os tag says ubuntu2404"):
        generate(_spec() | {"os": "ubuntu2204"}, AmiFacts("ubuntu2404", 60))
    with pytest.raises(UserError, match=r"os: 'ubuntu2004' is not one of"):
        generate(_spec() | {"os": "ubuntu2004"})


def test_generate_refuses_a_root_volume_smaller_than_the_image() -> None:
    """Before: a 35 GiB spec passed and only create-cluster failed on the 100 GiB bake volume."""
    with pytest.raises(
        UserError, match=r"SlurmQueues\[gpu\]: Root volume size 80 GiB must be equal or greater"
    ):
        generate(_spec() | {"os": "ubuntu2204"}, AmiFacts("ubuntu2204", 100))
    assert generate(_spec() | {"os": "ubuntu2204"}, AmiFacts("ubuntu2204", 80))


def test_generate_check_image_and_validate_check_images_read_the_image(
    aws: MotoServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ami = baked_image("pcluster")
    noble = baked_image("pcluster", tags=images.describe(ami).tags | {"parallelcluster:os": "ubuntu2404"})
    size = images.describe(noble).root_volume_gib
    assert size is not None
    spec = tmp_path / "spec.yml"
    spec.write_text(
        yaml.safe_dump(
            _spec()
            | {"ami": noble}
            | {"queues": [_spec()["queues"][0] | {"root_volume_size": max(size, 35)}]}
        )
    )
    out = tmp_path / "cluster.yml"
    assert cli.main(["cluster-config", "generate", str(spec), "--check-image", "-o", str(out)]) == 0, (
        capsys.readouterr().err
    )
    assert yaml.safe_load(out.read_text())["Image"]["Os"] == "ubuntu2404"
    assert cli.main(["cluster-config", "validate", str(out), "--check-images"]) == 0
    config = yaml.safe_load(out.read_text())
    config["Image"]["Os"] = "ubuntu2204"
    out.write_text(yaml.safe_dump(config))
    assert cli.main(["cluster-config", "validate", str(out)]) == 0, "offline: the schema alone passes"
    assert cli.main(["cluster-config", "validate", str(out), "--check-images"]) == 2
    assert (
        "is ubuntu2404 (its parallelcluster:os tag), the cluster's Image.Os is ubuntu2204"
        in capsys.readouterr().err
    )
