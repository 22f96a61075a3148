"""`gpuforge prune` and the image queries behind it, against moto (the test double for EC2 and SSM)."""

from __future__ import annotations

import time
from pathlib import Path

import boto3
import pytest
import yaml

from gpuforge import cli
from gpuforge.ami import images, prune, publish
from gpuforge.errors import UserError
from gpuforge.lab.moto import MotoServer

SOURCE = "ami-785db401"  # one of moto's built-in public images


def _bake_like(flavor: str, name: str) -> str:
    """Register an image the way a bake leaves it: created from an instance, tagged, builder gone."""
    ec2 = boto3.client("ec2")
    instance = ec2.run_instances(ImageId=SOURCE, MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    ami = str(ec2.create_image(InstanceId=instance, Name=name)["ImageId"])
    ec2.create_tags(Resources=[ami], Tags=[{"Key": images.FLAVOR_TAG, "Value": flavor}])
    ec2.terminate_instances(InstanceIds=[instance])
    return ami


@pytest.fixture
def five(aws: MotoServer) -> list[str]:
    """Five dlami images, oldest first (EC2 creation dates have one-second resolution)."""
    amis = []
    for n in range(5):
        if n:
            time.sleep(1.05)
        amis.append(_bake_like("dlami", f"gpuforge-dlami-{n}"))
    return amis


def _existing() -> set[str]:
    ec2 = boto3.client("ec2")
    return {i["ImageId"] for i in ec2.describe_images(Owners=["self"])["Images"]}


def _snapshots() -> set[str]:
    ec2 = boto3.client("ec2")
    return {s["SnapshotId"] for s in ec2.describe_snapshots(OwnerIds=["self"])["Snapshots"]}


def test_gpuforge_images_filters_by_flavor_and_sorts_oldest_first(five: list[str]) -> None:
    other = _bake_like("pcluster", "gpuforge-pcluster-0")
    untagged = str(
        boto3.client("ec2").copy_image(SourceImageId=five[0], SourceRegion="us-east-1", Name="x-copy")[
            "ImageId"
        ]
    )
    assert [i.id for i in images.gpuforge_images("dlami")] == five
    assert [i.id for i in images.gpuforge_images("pcluster")] == [other]
    assert untagged not in {i.id for i in images.gpuforge_images()}
    newest = images.newest(images.gpuforge_images("dlami"))
    assert newest is not None and newest.id == five[-1]


def test_prune_keeps_newest_and_deletes_older_with_snapshots(five: list[str]) -> None:
    before = {ami: images.describe(ami).snapshot_ids for ami in five}
    assert all(before.values()), "moto images should carry snapshots"
    result = prune.plan("dlami", keep=2, parameters=[publish.default_parameter("dlami")])
    assert [i.id for i in result.keep] == [five[4], five[3]]
    assert [i.id for i in result.delete] == [five[2], five[1], five[0]]
    prune.execute(result)
    assert _existing() & set(five) == {five[3], five[4]}
    snapshots = _snapshots()
    for ami in five[:3]:
        assert not set(before[ami]) & snapshots
    for ami in five[3:]:
        assert set(before[ami]) <= snapshots


def test_prune_never_removes_referenced_images(five: list[str], tmp_path: Path) -> None:
    # The SSM parameter still points at an old image (e.g. a rollback), a config uses another,
    # a running instance was launched from a third.
    publish.write_parameter(publish.default_parameter("dlami"), five[0])
    config = tmp_path / "cluster.yaml"
    config.write_text(
        yaml.safe_dump({"Scheduling": {"SlurmQueues": [{"Name": "q", "Image": {"CustomAmi": five[1]}}]}})
    )
    boto3.client("ec2").run_instances(ImageId=five[2], MinCount=1, MaxCount=1)
    result = prune.plan("dlami", keep=1, parameters=[publish.default_parameter("dlami")], configs=[config])
    assert result.delete[0].id == five[3] and len(result.delete) == 1
    assert set(result.protected) == {five[0], five[1], five[2]}
    assert "SSM parameter" in result.protected[five[0]]
    assert str(config) in result.protected[five[1]]
    assert "instance" in result.protected[five[2]]
    prune.execute(result)
    assert _existing() & set(five) == {five[0], five[1], five[2], five[4]}


def test_stopped_instance_still_protects_its_image(five: list[str]) -> None:
    ec2 = boto3.client("ec2")
    instance = ec2.run_instances(ImageId=five[0], MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    ec2.stop_instances(InstanceIds=[instance])
    assert five[0] in images.amis_of_live_instances()
    ec2.terminate_instances(InstanceIds=[instance])
    assert five[0] not in images.amis_of_live_instances()


def test_prune_cli_dry_run_removes_nothing(five: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["prune", "--keep", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("would delete") == 3 and out.count("keep") == 2
    assert set(five) <= _existing()
    assert cli.main(["prune", "--keep", "2"]) == 0
    assert _existing() & set(five) == {five[3], five[4]}


def test_prune_rejects_keep_zero(aws: MotoServer) -> None:
    with pytest.raises(UserError, match="at least 1"):
        prune.plan("dlami", keep=0, parameters=[])
    with pytest.raises(SystemExit):
        cli.main(["prune", "--keep", "0"])


def test_prune_leaves_other_flavors_and_foreign_images(five: list[str]) -> None:
    other = _bake_like("pcluster", "gpuforge-pcluster-0")
    prune.execute(prune.plan("dlami", keep=1, parameters=[]))
    assert other in _existing()
    assert SOURCE in {i["ImageId"] for i in boto3.client("ec2").describe_images(ImageIds=[SOURCE])["Images"]}


def test_stale_reason(aws: MotoServer) -> None:
    base = images.Image("ami-0123456789abcdef0", "base", "2026-12-01T00:00:00.000Z", "available", {}, ())
    current = images.Image(
        "ami-0fedcba9876543210",
        "gpuforge",
        "2026-12-02T00:00:00.000Z",
        "available",
        {images.SOURCE_AMI_TAG: base.id, "gpuforge:versions-hash": "abc"},
        (),
    )
    assert images.stale_reason(None, base, "abc") == "no gpuforge image of this flavor exists yet"
    assert images.stale_reason(current, base, "abc") is None
    assert "versions manifest changed" in str(images.stale_reason(current, base, "def"))
    moved = images.Image("ami-01111111111111111", "base2", "", "available", {}, ())
    assert "base image changed" in str(images.stale_reason(current, moved, "abc"))
