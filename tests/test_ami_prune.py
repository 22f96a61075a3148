"""`gpuforge prune` and the image queries behind it, against moto (the test double for EC2 and SSM)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import boto3
import pytest
import yaml

from gpuforge import cli
from gpuforge.ami import images, prune, publish
from gpuforge.ami.references import Sources
from gpuforge.errors import ExternalError, UserError
from gpuforge_lab.moto import MotoServer
from imagetools import baked_image

SOURCE = "ami-785db401"  # one of moto's built-in public images


def _bake_like(flavor: str, name: str) -> str:
    """Register an image the way a bake leaves it: created from an instance, tagged, builder gone."""
    return baked_image(flavor, name, tags={images.FLAVOR_TAG: flavor})


@pytest.fixture
def five(aws: MotoServer) -> list[str]:
    """Five dlami images, oldest first: EC2 dates images to the second, and the lab's moto_server
    (gpuforge_lab.moto_clock) dates each new image a second after the one before."""
    return [_bake_like("dlami", f"gpuforge-dlami-{n}") for n in range(5)]


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
    publish.write_parameter(publish.default_parameter("dlami"), five[4])
    result = prune.plan("dlami", keep=2, sources=Sources(parameters=[publish.default_parameter("dlami")]))
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
    sources = Sources(parameters=[publish.default_parameter("dlami")], configs=[config])
    result = prune.plan("dlami", keep=1, sources=sources)
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
    publish.write_parameter(publish.default_parameter("dlami"), five[4])
    assert cli.main(["prune", "--keep", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("would delete") == 3 and out.count("keep") == 2
    assert set(five) <= _existing()
    assert cli.main(["prune", "--keep", "2"]) == 0
    assert _existing() & set(five) == {five[3], five[4]}


def test_prune_rejects_keep_zero(aws: MotoServer) -> None:
    with pytest.raises(UserError, match="at least 1"):
        prune.plan("dlami", keep=0, sources=Sources())
    with pytest.raises(SystemExit):
        cli.main(["prune", "--keep", "0"])


def test_prune_leaves_other_flavors_and_foreign_images(five: list[str]) -> None:
    other = _bake_like("pcluster", "gpuforge-pcluster-0")
    prune.execute(prune.plan("dlami", keep=1, sources=Sources()))
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


# --- Every protection source, each on its own (issue 17) ---


def _plan(**sources: object) -> prune.PrunePlan:
    return prune.plan("dlami", keep=1, sources=Sources(**sources))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("service", "operation", "what"),
    [
        ("ssm", "GetParametersByPath", "SSM GetParametersByPath /gpuforge/"),
        ("ec2", "DescribeLaunchTemplates", "EC2 DescribeLaunchTemplates"),
        ("cloudformation", "DescribeStacks", "CloudFormation DescribeStacks"),
    ],
)
def test_a_source_that_cannot_be_listed_stops_the_prune(
    five: list[str], refuse_aws: Callable[[str, str, str], None], service: str, operation: str, what: str
) -> None:
    """Pruning without a whole protection source could delete an image in use: it stops, naming the call."""
    refuse_aws(service, operation, "AccessDenied")
    with pytest.raises(ExternalError, match=rf"^{re.escape(what)} failed: .*AccessDenied"):
        _plan()
    assert set(five) <= _existing()


def test_every_parameter_under_the_prefix_protects_across_pages(five: list[str]) -> None:
    ssm = boto3.client("ssm")
    # More parameters than one GetParametersByPath page holds (10), most of them not AMIs.
    for n in range(12):
        ssm.put_parameter(Name=f"/gpuforge/settings/p{n:02d}", Value=f"value {n}", Type="String")
    publish.write_parameter("/gpuforge/ami/dlami/rollback", five[0])
    publish.write_parameter("/gpuforge/zz/deep/nested/ami", five[1])
    publish.write_parameter("/elsewhere/ami", five[2])
    result = _plan()
    assert result.protected == {
        five[0]: "SSM parameter /gpuforge/ami/dlami/rollback",
        five[1]: "SSM parameter /gpuforge/zz/deep/nested/ami",
    }
    assert {i.id for i in result.delete} == {five[2], five[3]}


def test_parameter_adds_to_the_default_instead_of_replacing_it(
    five: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    publish.write_parameter(publish.default_parameter("dlami"), five[0])
    publish.write_parameter("/team/ami", five[1])
    assert cli.main(["prune", "--keep", "1", "--parameter", "/team/ami", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"protect  {five[0]}  (used by SSM parameter /gpuforge/ami/dlami/ubuntu2204/latest)" in out
    assert f"protect  {five[1]}  (used by SSM parameter /team/ami)" in out


def test_a_missing_parameter_is_an_error_unless_allowed(
    five: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # The flavor's parameter was deleted by mistake: its image must not become deletable silently.
    assert cli.main(["prune", "--keep", "1"]) == 2
    err = capsys.readouterr().err
    assert "gpuforge: error: SSM parameter /gpuforge/ami/dlami/ubuntu2204/latest does not exist" in err
    assert "--allow-missing" in err
    assert set(five) <= _existing()
    with pytest.raises(UserError, match="/team/ami does not exist"):
        _plan(parameters=["/team/ami"])
    result = _plan(parameters=["/team/ami"], allow_missing=True)
    assert result.warnings == ["SSM parameter /team/ami does not exist"]
    assert len(result.delete) == 4


def _launch_template(name: str, amis: list[str], default_version: int = 1) -> str:
    """A launch template with one version per AMI (as ParallelCluster's per compute resource)."""
    ec2 = boto3.client("ec2")
    template = ec2.create_launch_template(
        LaunchTemplateName=name, LaunchTemplateData={"ImageId": amis[0], "InstanceType": "p5.48xlarge"}
    )["LaunchTemplate"]["LaunchTemplateId"]
    for ami in amis[1:]:
        ec2.create_launch_template_version(LaunchTemplateId=template, LaunchTemplateData={"ImageId": ami})
    if default_version != 1:
        ec2.modify_launch_template(LaunchTemplateId=template, DefaultVersion=str(default_version))
    return str(template)


def test_launch_templates_default_and_latest_versions_protect(five: list[str]) -> None:
    # Version 1 is the default, version 3 the latest; version 2 is neither and protects nothing.
    template = _launch_template("train-gpu-p5", [five[0], five[1], five[2]])
    result = _plan(allow_missing=True)
    assert set(result.protected) == {five[0], five[2]}
    assert result.protected[five[0]] == f"launch template train-gpu-p5 ({template}) version 1 (default)"
    assert result.protected[five[2]] == f"launch template train-gpu-p5 ({template}) version 3 (latest)"
    assert [i.id for i in result.delete] == [five[3], five[1]]


def test_launch_template_image_from_ssm_protects_what_the_parameter_holds(five: list[str]) -> None:
    publish.write_parameter("/team/train/ami", five[1])
    _launch_template("from-ssm", ["resolve:ssm:/team/train/ami"])
    assert _plan(allow_missing=True).protected == {
        five[1]: "launch template from-ssm ("
        + boto3.client("ec2").describe_launch_templates()["LaunchTemplates"][0]["LaunchTemplateId"]
        + ") version 1 (default)"
    }


def test_a_config_of_the_wrong_shape_is_an_error(five: list[str], tmp_path: Path) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(f"Region: us-east-1\nImage: {five[0]}\n")
    with pytest.raises(UserError, match=r"Image must be a mapping, not str 'ami-"):
        _plan(configs=[config], allow_missing=True)
    config.write_text(f"Scheduling:\n  SlurmQueues:\n    Name: q\n    Image: {{CustomAmi: {five[0]}}}\n")
    with pytest.raises(UserError, match=r"Scheduling.SlurmQueues must be a list"):
        _plan(configs=[config], allow_missing=True)


def test_an_ami_anywhere_in_a_config_protects(five: list[str], tmp_path: Path) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(f"Region: us-east-1\nDevSettings:\n  AmiSearchFilters: {{Note: {five[2]}}}\n")
    assert set(_plan(configs=[config], allow_missing=True).protected) == {five[2]}


def test_a_missing_config_file_is_an_error_unless_allowed(five: list[str], tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot read cluster config"):
        _plan(configs=[tmp_path / "gone.yaml"])
    result = _plan(configs=[tmp_path / "gone.yaml"], allow_missing=True)
    assert any("gone.yaml" in w for w in result.warnings)


# A minimal template: moto's CloudFormation needs one resource; ParallelCluster's real one has hundreds.
# It declares the parameters ParallelCluster's template has that gpuforge reads (moto drops undeclared ones).
_STACK_TEMPLATE = json.dumps(
    {
        "Parameters": {
            name: {"Type": "String", "Default": ""}
            for name in ("ResourcesS3Bucket", "ArtifactS3RootDirectory", "ConfigVersion")
        },
        "Resources": {"Handle": {"Type": "AWS::CloudFormation::WaitConditionHandle"}},
    }
)


def _pcluster_cluster(
    name: str, config: str, bucket: str = "parallelcluster-0123abcd-v1-do-not-delete"
) -> str:
    """A cluster as ParallelCluster leaves it: its stack (tags, parameters) and its config in S3."""
    s3 = boto3.client("s3")
    try:
        s3.create_bucket(Bucket=bucket)
        s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    root = f"parallelcluster/3.16.1/clusters/{name}-abcdefghijklmnop"
    version = s3.put_object(Bucket=bucket, Key=f"{root}/configs/cluster-config.yaml", Body=config.encode())[
        "VersionId"
    ]
    # A later, different upload: describe-cluster reads the version the stack names, not the newest.
    s3.put_object(Bucket=bucket, Key=f"{root}/configs/cluster-config.yaml", Body=b"Region: us-east-1\n")
    boto3.client("cloudformation").create_stack(
        StackName=name,
        TemplateBody=_STACK_TEMPLATE,
        Parameters=[
            {"ParameterKey": "ResourcesS3Bucket", "ParameterValue": bucket},
            {"ParameterKey": "ArtifactS3RootDirectory", "ParameterValue": root},
            {"ParameterKey": "ConfigVersion", "ParameterValue": version},
        ],
        Tags=[{"Key": "parallelcluster:version", "Value": "3.16.1"}],
    )
    return root


def test_parallelcluster_clusters_protect_their_config_images(five: list[str]) -> None:
    queue_config = yaml.safe_dump(
        {
            "Region": "us-east-1",
            "Image": {"Os": "ubuntu2204", "CustomAmi": five[0]},
            "Scheduling": {"SlurmQueues": [{"Name": "q", "Image": {"CustomAmi": five[1]}}]},
        }
    )
    _pcluster_cluster("train", queue_config)
    # Neither a `pcluster build-image` stack nor an unrelated stack counts as a cluster.
    cfn = boto3.client("cloudformation")
    cfn.create_stack(
        StackName="image-build",
        TemplateBody=_STACK_TEMPLATE,
        Tags=[
            {"Key": "parallelcluster:version", "Value": "3.16.1"},
            {"Key": "parallelcluster:image-id", "Value": "x"},
        ],
    )
    cfn.create_stack(StackName="unrelated", TemplateBody=_STACK_TEMPLATE)
    result = _plan(allow_missing=True)
    assert result.protected == {
        five[0]: "ParallelCluster cluster train",
        five[1]: "ParallelCluster cluster train",
    }


def test_an_unreadable_cluster_config_is_an_error_unless_allowed(five: list[str]) -> None:
    root = _pcluster_cluster("train", f"Image: {{CustomAmi: {five[0]}}}\n")
    s3 = boto3.client("s3")
    bucket = "parallelcluster-0123abcd-v1-do-not-delete"
    for version in s3.list_object_versions(Bucket=bucket, Prefix=root)["Versions"]:
        s3.delete_object(Bucket=bucket, Key=version["Key"], VersionId=version["VersionId"])
    publish.write_parameter(publish.default_parameter("dlami"), five[4])
    with pytest.raises(UserError, match="cannot read ParallelCluster cluster train's config"):
        _plan()
    result = _plan(allow_missing=True)
    assert five[0] in {i.id for i in result.delete}
    assert any("cluster train" in w for w in result.warnings)


def _step_command(text: str, marker: str) -> list[str]:
    """The `gpuforge prune ...` line of a scheduled job, with its variables filled in as the job would."""
    (line,) = [ln.strip().removeprefix("- ") for ln in text.splitlines() if marker in ln and "prune" in ln]
    line = line.removeprefix("run: ")
    for flavor in ('"${{ matrix.flavor }}"', '"$flavor"', '"$FLAVOR"'):
        line = line.replace(flavor, "dlami")
    line = line.replace('"$KEEP_IMAGES"', "1")
    argv = line.split()
    assert argv[:2] == ["gpuforge", "prune"], line
    assert not [a for a in argv if "$" in a], f"unfilled variable in {line}"
    return argv[1:]


@pytest.mark.parametrize(
    ("path", "marker"),
    [
        (".github/workflows/ami-rebuild.yml", "run: gpuforge prune"),
        ("packer/buildspec.yml", "gpuforge prune"),
    ],
)
def test_scheduled_prune_keeps_a_scaled_to_zero_queues_image(five: list[str], path: str, marker: str) -> None:
    """The scheduled jobs' own prune command, on moto: a queue at MinCount 0 has no instance, only
    ParallelCluster's launch template, and its image must stay."""
    publish.write_parameter(publish.default_parameter("dlami"), five[4])
    _launch_template("train-idle-p5", [five[1]])
    argv = _step_command((Path(__file__).resolve().parents[1] / path).read_text(), marker)
    assert cli.main(argv) == 0
    assert _existing() & set(five) == {five[1], five[4]}


def _copy(ami: str, region: str) -> str:
    """A copy as Packer's ami_regions leaves it: same tags as the original."""
    tags = boto3.client("ec2").describe_images(ImageIds=[ami])["Images"][0]["Tags"]
    there = boto3.client("ec2", region_name=region)
    copy = str(there.copy_image(SourceImageId=ami, SourceRegion="us-east-1", Name=f"copy-{ami}")["ImageId"])
    there.create_tags(Resources=[copy], Tags=tags)
    return copy


def test_copies_in_other_regions_are_pruned_with_the_original_unless_used_there(five: list[str]) -> None:
    ec2 = boto3.client("ec2")
    for n, ami in enumerate(five[:2]):
        ec2.create_tags(
            Resources=[ami],
            Tags=[
                {"Key": images.BUILD_ID_TAG, "Value": f"build{n}"},
                {"Key": images.COPY_REGIONS_TAG, "Value": "eu-west-1"},
            ],
        )
    gone, used = _copy(five[0], "eu-west-1"), _copy(five[1], "eu-west-1")
    # In eu-west-1 a launch template still launches the copy of five[1].
    boto3.client("ec2", region_name="eu-west-1").create_launch_template(
        LaunchTemplateName="eu-train", LaunchTemplateData={"ImageId": used}
    )
    result = _plan(allow_missing=True)
    assert [(r, c.id) for r, c in result.delete_copies] == [("eu-west-1", gone)]
    assert result.protected[used].endswith("in eu-west-1")
    prune.execute(result)
    left = {
        i["ImageId"]
        for i in boto3.client("ec2", region_name="eu-west-1").describe_images(Owners=["self"])["Images"]
    }
    assert used in left and gone not in left
