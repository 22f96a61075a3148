"""`gpuforge publish` and base-image resolution against moto (the test double for EC2 and SSM).
Cluster configs are validated by aws-parallelcluster's own schema (gpuforge.pcluster.validate)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml

from gpuforge import cli
from gpuforge.ami import images, publish
from gpuforge.errors import UserError
from gpuforge.lab.moto import MotoServer
from gpuforge.pcluster.config import load_config


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


def test_publish_writes_parameter_and_patches_config(aws: MotoServer, tmp_path: Path) -> None:
    ami = _image("gpuforge-dlami-1")
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(_config()))
    assert cli.main(["publish", "--ami", ami, "--cluster-config", str(config)]) == 0
    assert publish.read_parameter("/gpuforge/ami/dlami/latest") == ami
    parameter = boto3.client("ssm").get_parameter(Name="/gpuforge/ami/dlami/latest")["Parameter"]
    assert parameter["DataType"] == "aws:ec2:image"
    assert load_config(config)["Image"]["CustomAmi"] == ami

    newer = _image("gpuforge-dlami-2")
    publish.publish(newer, "/gpuforge/ami/dlami/latest", [config])
    assert publish.read_parameter("/gpuforge/ami/dlami/latest") == newer
    assert load_config(config)["Image"]["CustomAmi"] == newer


def test_publish_per_queue(aws: MotoServer, tmp_path: Path) -> None:
    ami = _image("gpuforge-pcluster-1")
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(_config()))
    publish.publish(ami, "/gpuforge/ami/pcluster/latest", [config], queues=["gpu"])
    patched = load_config(config)
    assert patched["Scheduling"]["SlurmQueues"][0]["Image"]["CustomAmi"] == ami
    assert "CustomAmi" not in patched["Image"]


def test_publish_invalid_config_moves_nothing(aws: MotoServer, tmp_path: Path) -> None:
    old = _image("gpuforge-dlami-old")
    publish.write_parameter("/gpuforge/ami/dlami/latest", old)
    bad = _config()
    bad["HeadNode"]["InstanceType"] = 42  # the schema wants a string
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(bad))
    before = config.read_text()
    new = _image("gpuforge-dlami-new")
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
    import time

    old = _image("aws-parallelcluster-3.16.1-ubuntu-2204-lts-hvm-x86_64-202610010000")
    _image("aws-parallelcluster-3.16.1-ubuntu-2004-lts-hvm-x86_64-202611010000")
    _image("aws-parallelcluster-3.15.0-ubuntu-2204-lts-hvm-x86_64-202611010000")
    time.sleep(1.05)
    new = _image("aws-parallelcluster-3.16.1-ubuntu-2204-lts-hvm-x86_64-202611150000")
    base = images.resolve_base("pcluster", pcluster_version="3.16.1", owner="self")
    assert base.id == new and base.id != old
    with pytest.raises(UserError, match=r"aws-parallelcluster-9\.9\.9"):
        images.resolve_base("pcluster", pcluster_version="9.9.9", owner="self")
    # Owner "amazon" is what production asks for; these test images are not Amazon's.
    with pytest.raises(UserError, match="owned by amazon"):
        images.resolve_base("pcluster", pcluster_version="3.16.1")
