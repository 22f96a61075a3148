"""`gpuforge bake` and `gpuforge rebuild --if-stale` end to end, with moto as AWS and a fake packer.

The fake packer (FAKE_PACKER below, a test double named as such) stands in for HashiCorp's binary,
which would need real EC2 and SSH: it reads the var file gpuforge wrote, does what the amazon-ebs
builder does against moto (launch the source AMI, report its id with the line Packer 1.6.6 prints,
create and tag the image, terminate the builder), prints -machine-readable lines and writes a
manifest in Packer's format. Like the template's first provisioner (check-imdsv2.sh) it refuses to
go on while the builder still allows IMDSv1, and like Packer it terminates the builder on SIGINT.
Modes make it fail before or after registering, forget the tags, or launch without saying so, so we
can check that a failed bake leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

from gpuforge import aws, cli, targets, versions
from gpuforge.ami import bake, images, inputs, publish
from gpuforge.errors import ExternalError, UserError
from gpuforge_lab import cli as lab_cli
from gpuforge_lab.moto import MotoServer

FAKE_PACKER = r'''#!{python}
"""Test double for the packer binary (see tests/test_ami_bake.py)."""
import json, os, signal, sys, time, uuid

args = sys.argv[1:]
with open(os.environ["FAKE_PACKER_CALLS"], "a") as calls:
    calls.write(json.dumps(args) + "\n")
if args[:1] == ["version"]:
    print("Packer v" + os.environ.get("FAKE_PACKER_VERSION", "1.6.6"))
    sys.exit(0)
if args[:1] == ["init"]:
    sys.exit(0)
assert args[0] == "build", args
mode = os.environ.get("FAKE_PACKER_MODE", "ok")
var_file = next(a.split("=", 1)[1] for a in args if a.startswith("-var-file="))
only = next(a.split("=", 1)[1] for a in args if a.startswith("-only="))
v = json.load(open(var_file))
now = int(time.time())

def say(text):
    print(f"{now},,ui,say,==> {only}: {text}".replace("\n", "\\n"), flush=True)

say("Prevalidating AMI Name: fake")
say("Launching a source AWS instance...")
if mode == "fail":
    print(f"{now},,ui,error,Build '{only}' errored after 1 second: ansible-playbook exited 2", flush=True)
    sys.exit(1)
import boto3  # only here: `packer version` must stay fast

ec2 = boto3.client("ec2", region_name=v["region"])
source = ec2.describe_images(ImageIds=[v["source_ami"]])["Images"][0]
instance = ec2.run_instances(ImageId=v["source_ami"], MinCount=1, MaxCount=1, InstanceType="g5.2xlarge")
instance_id = instance["Instances"][0]["InstanceId"]

def interrupted(signum, frame):
    # What Packer does on Ctrl-C: cancel the build and run the cleanup steps.
    say("Terminating the source AWS instance...")
    ec2.terminate_instances(InstanceIds=[instance_id])
    print(f"{now},,ui,error,Build '{only}' errored: build was cancelled", flush=True)
    sys.exit(1)

signal.signal(signal.SIGINT, interrupted)
if mode != "silent-launch":
    # Packer 1.6.6's StepRunSourceInstance, as -machine-readable prints it (ui.Message via TargetedUI).
    print(f"{now},,ui,message,    {only}: Instance ID: {instance_id}", flush=True)
    say(f"Waiting for instance ({instance_id}) to become ready...")
    # check-imdsv2.sh, the template's first provisioner: wait a little for IMDSv2, then give up.
    for _ in range(100):
        reservation = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]
        if reservation["Instances"][0].get("MetadataOptions", {}).get("HttpTokens") == "required":
            break
        time.sleep(0.1)
    else:
        ec2.terminate_instances(InstanceIds=[instance_id])
        print(f"{now},,ui,error,check-imdsv2: the builder allows IMDSv1", flush=True)
        sys.exit(1)
say("Running ansible playbook: playbooks/bake.yml")
name = f"gpuforge-{v['flavor']}-{now}-{v['git_revision']}"
ami = ec2.create_image(InstanceId=instance_id, Name=name)["ImageId"]
tags = dict(v["image_tags"]) if mode != "untagged" else {}
tags.update({
    "Name": name, "gpuforge:flavor": v["flavor"], "gpuforge:git-revision": v["git_revision"],
    "gpuforge:build-id": v["build_id"], "gpuforge:build-time": str(now),
    "gpuforge:source-ami-id": source["ImageId"], "gpuforge:source-ami-name": source["Name"],
})
ec2.create_tags(Resources=[ami], Tags=[{"Key": k, "Value": val} for k, val in tags.items()])
ec2.terminate_instances(InstanceIds=[instance_id])
# No region copies: the template gives Packer no ami_regions (gpuforge copies the finished image).
assert "ami_regions" not in v, "gpuforge passed ami_regions to Packer"
artifact_ids = [f"{v['region']}:{ami}"]
if mode == "fail-after-register":
    print(f"{now},,ui,error,Post-processor failed: manifest: permission denied", flush=True)
    sys.exit(1)
print(f"{now},{only},artifact,0,id,{'%!(PACKER_COMMA)'.join(artifact_ids)}", flush=True)
run = str(uuid.uuid4())
manifest = {"builds": [{
    "name": only.split(".")[1], "builder_type": only.split(".")[0], "build_time": now, "files": None,
    "artifact_id": ",".join(artifact_ids), "packer_run_uuid": run,
    "custom_data": {"flavor": v["flavor"], "build_id": v["build_id"]},
}], "last_run_uuid": run}
json.dump(manifest, open(v["manifest_path"], "w"))
# The file provisioner's download of the builder's /etc/gpuforge/manifest.json (docs/manifest.md).
json.dump({"schema": 2, "versions_hash": v["image_tags"].get("gpuforge:versions-hash", ""), "pins": {},
           "installed": {"nvidia_driver": {"version": "580.126.09", "source": "base_image"},
                         "dcgm": {"version": "4.5.3", "source": "gpuforge"}}},
          open(v["node_manifest_path"], "w"))
say("Builds finished.")
'''

BASE_PARAMETER = "/gpuforge-test/dlami-base"
REPO = Path(__file__).resolve().parents[1]


def _install_fake_packer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    exe = tmp_path / "bin" / "packer"
    exe.parent.mkdir()
    exe.write_text(FAKE_PACKER.replace("{python}", sys.executable))
    exe.chmod(0o755)
    calls = tmp_path / "packer-calls.jsonl"
    calls.touch()
    monkeypatch.setenv("GPUFORGE_PACKER", str(exe))
    monkeypatch.setenv("FAKE_PACKER_CALLS", str(calls))
    return calls


@pytest.fixture
def fake_packer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Install the fake packer as $GPUFORGE_PACKER; returns the file it logs its calls to."""
    return _install_fake_packer(tmp_path, monkeypatch)


def _builds(calls: Path) -> list[list[str]]:
    return [args for args in map(json.loads, calls.read_text().splitlines()) if args[0] == "build"]


def _register_base(name: str) -> str:
    """A base image in moto, standing in for the DLAMI or ParallelCluster AMI."""
    ec2 = boto3.client("ec2")
    instance = ec2.run_instances(ImageId="ami-785db401", MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    ami = str(ec2.create_image(InstanceId=instance, Name=name)["ImageId"])
    ec2.terminate_instances(InstanceIds=[instance])
    return ami


def _publish_dlami_base() -> str:
    ami = _register_base("Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20261120")
    boto3.client("ssm").put_parameter(Name=BASE_PARAMETER, Value=ami, Type="String")
    return ami


@pytest.fixture
def dlami_base(aws: MotoServer) -> str:
    return _publish_dlami_base()


def _record_imds_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Record ModifyImageAttribute requests (moto accepts ImdsSupport but does not store it)."""
    seen: list[dict[str, Any]] = []
    original = aws.client

    def recording_client(service: str, region_name: str | None = None) -> Any:
        client = original(service, region_name)
        client.meta.events.register(
            "provide-client-params.ec2.ModifyImageAttribute", lambda params, **_: seen.append(dict(params))
        )
        return client

    monkeypatch.setattr(aws, "client", recording_client)
    return seen


def _options(tmp_path: Path, **kw: Any) -> bake.BakeOptions:
    return bake.BakeOptions(base_parameter=BASE_PARAMETER, work_dir=tmp_path / "work", **kw)


def _gpuforge_images() -> list[dict[str, Any]]:
    ec2 = boto3.client("ec2")
    return list(
        ec2.describe_images(Owners=["self"], Filters=[{"Name": "tag-key", "Values": ["gpuforge:flavor"]}])[
            "Images"
        ]
    )


@dataclass(frozen=True)
class Baked:
    """One successful bake with the defaults (Packer 1.6.6, the flavor's default targets), an extra vars
    file given by a relative path, and what the tests below read from it."""

    base: str
    image: images.Image
    imds_calls: list[dict[str, Any]]
    builds: list[list[str]]
    variables: dict[str, Any]
    builder: dict[str, Any]
    packer_log: str
    progress: str
    newest: images.Image | None
    base_image: images.Image
    cwd: Path


@pytest.fixture(scope="module")
def baked(moto_server: MotoServer, tmp_path_factory: pytest.TempPathFactory) -> Baked:
    """The bake the tests below share: each reads a different part of it (one bake instead of four).

    moto is reset first (as the `aws` fixture does) and everything is read before the next test resets it.
    """
    tmp_path = tmp_path_factory.mktemp("baked")
    with pytest.MonkeyPatch.context() as monkeypatch:
        moto_server.reset()
        for key, value in moto_server.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        calls = _install_fake_packer(tmp_path, monkeypatch)
        base = _publish_dlami_base()
        seen = _record_imds_calls(monkeypatch)
        monkeypatch.chdir(tmp_path)
        Path("extra.yml").write_text("nvidia_driver_persistence: false\n")
        progress = io.StringIO()
        with contextlib.redirect_stderr(progress):
            image = bake.bake_aws(_options(tmp_path, extra_vars_file=Path("extra.yml")))
        builds = _builds(calls)
        var_file = Path(next(a.split("=", 1)[1] for a in builds[0] if a.startswith("-var-file=")))
        return Baked(
            base=base,
            image=image,
            imds_calls=seen,
            builds=builds,
            variables=json.loads(var_file.read_text()),
            builder=_builder(base),
            packer_log=_packer_log(tmp_path / "work"),
            progress=progress.getvalue(),
            newest=images.newest(images.gpuforge_images("dlami")),
            base_image=images.describe(base),
            cwd=tmp_path,
        )


def test_bake_registers_tagged_imdsv2_image(baked: Baked) -> None:
    image = baked.image
    manifest = versions.load()
    for key, value in manifest.image_tags().items():
        assert image.tags[key] == value
    for component in manifest.components:
        assert image.tags[f"gpuforge:{component}"] == manifest.version(component)
    assert image.tags["gpuforge:source-ami-id"] == baked.base
    assert image.tags["gpuforge:source-ami-name"].startswith("Deep Learning Base")
    assert image.tags["gpuforge:git-revision"] == bake.git_revision()
    # What the builder's node manifest says is really installed, with where it came from.
    assert image.tags["gpuforge:installed:nvidia_driver"] == "580.126.09/base_image"
    assert image.tags["gpuforge:installed:dcgm"] == "4.5.3/gpuforge"
    assert image.state == "available"
    assert baked.imds_calls == [{"ImageId": image.id, "ImdsSupport": {"Value": "v2.0"}}]
    # Packer was asked for the AWS source only, with the resolved base and our tags in its var file.
    (build,) = baked.builds
    assert "-only=amazon-ebs.gpu" in build and "-machine-readable" in build
    assert baked.variables["source_ami"] == baked.base
    assert baked.variables["image_tags"] == {
        **manifest.image_tags(),
        targets.TARGETS_TAG: ",".join(targets.DEFAULT_TARGETS["dlami"]),
        images.OS_TAG: "ubuntu2204",
        images.INPUTS_HASH_TAG: inputs.digest(),
    }
    # Progress is streamed while Packer runs.
    assert "Launching a source AWS instance" in baked.progress
    assert "artifact from amazon-ebs.gpu" in baked.progress


def test_bake_requires_imdsv2_on_the_builder_before_provisioning(baked: Baked) -> None:
    """The builder instance ends IMDSv2-only; the fake provisions only once it is (as check-imdsv2.sh)."""
    builder = baked.builder
    assert builder["MetadataOptions"]["HttpTokens"] == "required"
    assert builder["MetadataOptions"]["HttpEndpoint"] == "enabled"
    assert builder["State"]["Name"] == "terminated"
    log = baked.packer_log
    assert log.index(f"Instance ID: {builder['InstanceId']}") < log.index("Running ansible playbook")


def test_rebuild_if_stale_on_versions_change(baked: Baked) -> None:
    assert images.stale_reason(baked.newest, baked.base_image, versions.load().digest) is None
    bumped = versions.Manifest({**versions.load().components, "nccl": {"version": "2.23.4", "cuda": "12.2"}})
    reason = images.stale_reason(baked.newest, baked.base_image, bumped.digest)
    assert reason is not None and "versions manifest changed" in reason


def test_extra_vars_file_reaches_packer_as_absolute_path(baked: Baked) -> None:
    """The bake was given extra.yml relative to its working directory."""
    assert baked.variables["ansible_extra_vars_file"] == str(baked.cwd / "extra.yml")


def test_bake_pcluster_flavor_carries_parallelcluster_tags(
    aws: MotoServer, fake_packer: Path, tmp_path: Path
) -> None:
    base = _register_base(
        "aws-parallelcluster-3.16.1-ubuntu-2204-lts-hvm-x86_64-202611010000 2026-11-01T00-00-00.000Z"
    )
    _register_base(
        "aws-parallelcluster-3.15.0-ubuntu-2204-lts-hvm-x86_64-202609010000 2026-09-01T00-00-00.000Z"
    )
    image = bake.bake_aws(
        bake.BakeOptions(flavor="pcluster", base_owner="self", pcluster_version="3.16.1", work_dir=tmp_path)
    )
    assert image.tags["gpuforge:source-ami-id"] == base
    assert image.tags["parallelcluster:version"] == "3.16.1"
    assert image.tags["parallelcluster:build_status"] == "available"
    assert image.tags["parallelcluster:os"] == "ubuntu2204"


def _builder(source_ami: str) -> dict[str, Any]:
    """The one instance the fake packer launched from source_ami (moto keeps terminated instances)."""
    pages = boto3.client("ec2").describe_instances(Filters=[{"Name": "image-id", "Values": [source_ami]}])
    (instance,) = [i for r in pages["Reservations"] for i in r["Instances"]]
    return dict(instance)


def _packer_log(work: Path) -> str:
    (log,) = work.glob("*/packer.log")
    return log.read_text()


def test_bake_stops_when_the_builder_cannot_be_made_imdsv2_only(
    dlami_base: str,
    fake_packer: Path,
    tmp_path: Path,
    imdsv2_refused: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A refused ModifyInstanceMetadataOptions stops Packer before provisioning; nothing is registered."""
    work = tmp_path / "work"
    code = cli.main(["bake", "--base-parameter", BASE_PARAMETER, "--work-dir", str(work)])
    assert code == ExternalError.exit_code
    builder = _builder(dlami_base)
    err = capsys.readouterr().err
    assert f"cannot require IMDSv2 on builder instance {builder['InstanceId']}" in err
    assert "UnauthorizedOperation" in err
    assert builder["MetadataOptions"].get("HttpTokens") != "required"
    # Packer was interrupted and cleaned up (terminated the builder) before running any provisioner.
    assert builder["State"]["Name"] == "terminated"
    log = _packer_log(work)
    assert "Terminating the source AWS instance" in log
    assert "Running ansible playbook" not in log
    assert _gpuforge_images() == []


def test_bake_fails_when_packer_never_names_its_builder(
    dlami_base: str,
    fake_packer: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """If Packer's output changes so the builder goes unseen, the image is not trusted: it is discarded."""
    monkeypatch.setenv("FAKE_PACKER_MODE", "silent-launch")
    code = cli.main(["bake", "--base-parameter", BASE_PARAMETER, "--work-dir", str(tmp_path / "work")])
    assert code == ExternalError.exit_code
    assert "could not require IMDSv2" in capsys.readouterr().err
    assert _gpuforge_images() == []


@pytest.mark.parametrize("mode", ["fail", "fail-after-register", "untagged", "silent-launch"])
def test_failed_bake_registers_no_image_and_moves_no_parameter(
    dlami_base: str, fake_packer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    previous = _register_base("gpuforge-dlami-previous")
    publish.write_parameter(publish.default_parameter("dlami"), previous)
    monkeypatch.setenv("FAKE_PACKER_MODE", mode)
    code = cli.main(["bake", "--base-parameter", BASE_PARAMETER, "--work-dir", str(tmp_path / "work")])
    assert code == ExternalError.exit_code
    assert _gpuforge_images() == []
    assert publish.read_parameter(publish.default_parameter("dlami")) == previous
    assert len(_builds(fake_packer)) == 1


def test_bake_cli_publishes_parameter_and_cluster_config(
    aws: MotoServer, fake_packer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _register_base("aws-parallelcluster-3.16.1-ubuntu-2204-lts-hvm-x86_64-202611010000")
    config = tmp_path / "cluster.yaml"
    config.write_text(json.dumps(_cluster_config()))
    code = cli.main(
        [
            "bake",
            "--flavor",
            "pcluster",
            "--base-owner",
            "self",
            "--work-dir",
            str(tmp_path / "work"),
            "--parameter",
            "/gpuforge/test/ami",
            "--cluster-config",
            str(config),
            "--queue",
            "gpu",
        ]
    )
    assert code == 0
    ami = capsys.readouterr().out.strip().splitlines()[-1]
    assert [i["ImageId"] for i in _gpuforge_images()] == [ami]
    assert publish.read_parameter("/gpuforge/test/ami") == ami
    from gpuforge.pcluster.config import load_config

    patched = load_config(config)
    assert patched["Scheduling"]["SlurmQueues"][0]["Image"]["CustomAmi"] == ami
    assert patched["Image"].get("CustomAmi") is None


def _cluster_config() -> dict[str, Any]:
    subnet = "subnet-0123456789abcdef0"
    return {
        "Region": "us-east-1",
        "Image": {"Os": "ubuntu2204"},
        "HeadNode": {"InstanceType": "c5.2xlarge", "Networking": {"SubnetId": subnet}},
        "Scheduling": {
            "Scheduler": "slurm",
            "SlurmQueues": [
                {
                    "Name": "gpu",
                    "ComputeResources": [
                        {"Name": "p5", "InstanceType": "p5.48xlarge", "MinCount": 0, "MaxCount": 2}
                    ],
                    "Networking": {"SubnetIds": [subnet]},
                }
            ],
        },
    }


def test_rebuild_if_stale_skips_current_and_rebuilds_on_change(
    dlami_base: str, fake_packer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["rebuild", "--if-stale", "--base-parameter", BASE_PARAMETER, "--work-dir", str(tmp_path / "w")]
    assert cli.main(argv) == 0  # no image yet: stale
    first = capsys.readouterr().out.strip().splitlines()[-1]
    assert len(_builds(fake_packer)) == 1

    assert cli.main(argv) == 0  # same base, same manifest: nothing to do
    assert "is current" in capsys.readouterr().out
    assert len(_builds(fake_packer)) == 1
    # A bake makes a candidate; latest moves only through a passed canary and promote.
    assert publish.read_parameter(CANDIDATE) == first
    assert publish.read_parameter(publish.default_parameter("dlami")) is None

    # AWS moves the public parameter to a new DLAMI: the next run rebuilds on it.
    new_base = _register_base("Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20261201")
    boto3.client("ssm").put_parameter(Name=BASE_PARAMETER, Value=new_base, Type="String", Overwrite=True)
    assert cli.main(argv) == 0
    second = capsys.readouterr().out.strip().splitlines()[-1]
    assert len(_builds(fake_packer)) == 2
    assert second != first
    assert images.describe(second).tags["gpuforge:source-ami-id"] == new_base
    assert publish.read_parameter(CANDIDATE) == second


CANDIDATE = "/gpuforge/ami/dlami/ubuntu2204/candidate"


def _promote_with_a_pass(ami: str) -> None:
    """What a passed `gpuforge canary` records on the image (its verdict tag), then `gpuforge promote`."""
    boto3.client("ec2").create_tags(Resources=[ami], Tags=[{"Key": "gpuforge:canary", "Value": "passed"}])
    assert cli.main(["promote", "--flavor", "dlami", "--os", "ubuntu2204", "--ami", ami]) == 0


def test_a_bake_reaches_latest_only_through_a_passed_canary(
    dlami_base: str, fake_packer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    latest = publish.default_parameter("dlami")
    assert cli.main(["bake", "--base-parameter", BASE_PARAMETER, "--work-dir", str(tmp_path / "w")]) == 0
    ami = capsys.readouterr().out.strip().splitlines()[-1]
    assert publish.read_parameter(CANDIDATE) == ami and publish.read_parameter(latest) is None
    assert cli.main(["promote", "--flavor", "dlami", "--os", "ubuntu2204"]) == 2  # no canary ran
    assert publish.read_parameter(latest) is None
    argv = ["bake", "--base-parameter", BASE_PARAMETER, "--work-dir", str(tmp_path / "w")]
    assert cli.main([*argv, "--parameter", latest]) == 2  # not around the canary either
    assert "latest moves only through `gpuforge promote`" in capsys.readouterr().err
    _promote_with_a_pass(ami)
    assert publish.read_parameter(latest) == ami


def _rebuild_argv(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "rebuild",
        "--if-stale",
        "--base-parameter",
        BASE_PARAMETER,
        "--work-dir",
        str(tmp_path / "w"),
        *extra,
    ]


def test_rebuild_if_stale_judges_the_published_image_not_the_newest(
    dlami_base: str, fake_packer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a --no-publish bake (or a failed publish) left the newest image with today's base and pins,
    and the schedule said "current" forever although nothing was published."""
    assert (
        cli.main(
            ["bake", "--base-parameter", BASE_PARAMETER, "--work-dir", str(tmp_path / "w"), "--no-publish"]
        )
        == 0
    )
    unpublished = capsys.readouterr().out.strip().splitlines()[-1]
    assert cli.main(_rebuild_argv(tmp_path)) == 0
    assert len(_builds(fake_packer)) == 2, "the unpublished image did not count as current"
    candidate = publish.read_parameter(CANDIDATE)
    assert candidate not in (None, unpublished)
    assert candidate is not None
    _promote_with_a_pass(candidate)
    published = publish.read_parameter("/gpuforge/ami/dlami/ubuntu2204/latest")
    assert published == candidate
    assert cli.main(_rebuild_argv(tmp_path)) == 0
    assert (
        f"{published} (published at /gpuforge/ami/dlami/ubuntu2204/latest) is current"
        in capsys.readouterr().out
    )
    assert len(_builds(fake_packer)) == 2


def test_rebuild_if_stale_keeps_22_04_and_24_04_apart(
    dlami_base: str, fake_packer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A current 22.04 image says nothing about 24.04 (before, one flavor tag and parameter held both)."""
    assert cli.main(_rebuild_argv(tmp_path)) == 0
    boto3.client("ssm").put_parameter(Name="/gpuforge-test/noble", Value=dlami_base, Type="String")
    assert (
        cli.main(
            _rebuild_argv(tmp_path, "--base-os", "ubuntu24.04", "--base-parameter", "/gpuforge-test/noble")
        )
        == 0
    )
    assert len(_builds(fake_packer)) == 2
    noble = publish.read_parameter("/gpuforge/ami/dlami/ubuntu2404/candidate")
    assert noble is not None and images.describe(noble).os == "ubuntu2404"
    assert publish.read_parameter(CANDIDATE) not in (None, noble)


def test_rebuild_if_stale_on_a_change_to_what_the_bake_runs(
    dlami_base: str,
    fake_packer: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A role's task file changes, the pins do not: before, --if-stale said "current"."""
    root = tmp_path / "root"
    for name in inputs.files(REPO):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes((REPO / name).read_bytes())
    monkeypatch.setenv("GPUFORGE_ROOT", str(root))
    assert cli.main(_rebuild_argv(tmp_path)) == 0
    first = capsys.readouterr().out.strip().splitlines()[-1]
    assert images.describe(first).tags[images.INPUTS_HASH_TAG] == inputs.digest(root)
    assert cli.main(_rebuild_argv(tmp_path)) == 0
    assert "is current" in capsys.readouterr().out
    task = root / "roles" / "nccl" / "tasks" / "main.yml"
    task.write_text(task.read_text() + "# a change the bake runs\n")
    assert cli.main(_rebuild_argv(tmp_path)) == 0
    assert len(_builds(fake_packer)) == 2
    second = capsys.readouterr().out.strip().splitlines()[-1]
    assert second != first and publish.read_parameter(CANDIDATE) == second


def test_inputs_digest_covers_what_a_bake_runs_and_nothing_else(tmp_path: Path) -> None:
    """Deterministic over tracked files' paths and content; docs and untracked files do not count."""
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    files = {
        "versions.yml": "nccl: {version: '2.27.7'}\n",
        "roles/nccl/tasks/main.yml": "---\n",
        "roles/nccl/README.md": "# nccl\n",
        "packer/gpuforge.pkr.hcl": "source {}\n",
        "packer/iam/pipeline-policy.json": "{}\n",
        "data/instance_types.yml": "{}\n",
        "docs/index.md": "docs\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    git("init", "-q")
    git("add", ".")
    assert inputs.files(tmp_path) == [
        "data/instance_types.yml",
        "packer/gpuforge.pkr.hcl",
        "roles/nccl/tasks/main.yml",
        "versions.yml",
    ]
    first = inputs.digest(tmp_path)
    (tmp_path / "roles/nccl/README.md").write_text("# changed\n")
    (tmp_path / "roles/nccl/tasks/untracked.yml").write_text("---\n")
    (tmp_path / "packer/iam/pipeline-policy.json").write_text("{ }\n")
    assert inputs.digest(tmp_path) == first
    (tmp_path / "packer/gpuforge.pkr.hcl").write_text("source { }\n")
    assert inputs.digest(tmp_path) != first
    # Outside git (an installed wheel), the same files give the same hash.
    # Inside the checkout's tree but not its top, as a wheel in a virtualenv there: walked, not listed.
    wheel = tmp_path / ".venv" / "collection"
    for name in inputs.files(tmp_path):
        (wheel / name).parent.mkdir(parents=True, exist_ok=True)
        (wheel / name).write_bytes((tmp_path / name).read_bytes())
    assert inputs.digest(wheel) == inputs.digest(tmp_path)


def test_bake_without_packer_is_a_user_error(
    dlami_base: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUFORGE_PACKER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no packer here
    code = cli.main(["bake", "--base-parameter", BASE_PARAMETER, "--work-dir", str(tmp_path / "w")])
    assert code == 2
    assert _gpuforge_images() == []


def test_bake_local_requires_a_running_lab(
    fake_packer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPUFORGE_LAB_DIR", str(tmp_path / "labs"))
    assert lab_cli.main(["bake", "--lab", "nosuchlab", "--work-dir", str(tmp_path / "w")]) == 2
    assert "gpuforge-lab up --name nosuchlab" in capsys.readouterr().err
    assert _builds(fake_packer) == []


def test_bake_local_refuses_publish_options(fake_packer: Path, tmp_path: Path) -> None:
    # A lab bake registers no image: `gpuforge-lab bake` has no publish options at all.
    with pytest.raises(SystemExit) as exc:
        lab_cli.main(["bake", "--parameter", "/x/y", "--work-dir", str(tmp_path / "w")])
    assert exc.value.code == 2
    assert _builds(fake_packer) == []


def test_product_bake_sends_local_to_the_lab(
    fake_packer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpuforge bake` bakes on AWS only; --local names the lab's command and runs nothing."""
    assert cli.main(["bake", "--local", "--work-dir", str(tmp_path / "w")]) == 2
    assert "lab hosts are baked with `gpuforge-lab bake`" in capsys.readouterr().err
    assert _builds(fake_packer) == []


def test_bake_host_hands_packer_the_plain_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bake_host takes a host, port, user and key (no lab), and gives them to the null source."""
    seen: dict[str, Any] = {}

    def run_packer(run: bake.Run, variables: dict[str, Any], only: str, **_: Any) -> list[Any]:
        seen.update(variables, only=only)
        empty = {"schema": 2, "versions_hash": "", "pins": {}, "installed": {}}
        run.node_manifest.write_text(json.dumps(empty))
        return []

    monkeypatch.setattr(bake, "_run_packer", run_packer)
    key = tmp_path / "id_ed25519"
    key.write_text("not a real key\n")
    target = bake.HostTarget(host="10.9.8.7", user="admin", private_key_file=key, port=2222, name="node-1")
    run_dir = bake.bake_host(bake.BakeOptions(work_dir=tmp_path / "w"), target)
    assert run_dir.parent == tmp_path / "w"
    assert seen["only"] == bake.HOST_SOURCE == "null.lab"
    assert (seen["lab_host"], seen["lab_port"], seen["lab_username"], seen["lab_private_key_file"]) == (
        "10.9.8.7",
        2222,
        "admin",
        str(key),
    )
    agent = bake.HostTarget(host="10.9.8.7", user="admin")
    bake.bake_host(bake.BakeOptions(work_dir=tmp_path / "w"), agent)
    assert (seen["lab_port"], seen["lab_private_key_file"]) == (22, "")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"host": "", "user": "admin"}, "needs the host's address and SSH user"),
        ({"host": "10.0.0.1", "user": "admin", "port": 0}, "SSH port 0 is not a TCP port"),
        ({"host": "10.0.0.1", "user": "admin", "private_key_file": Path("/nonexistent/k")}, "does not exist"),
    ],
)
def test_host_target_refuses_what_ssh_cannot_use(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message):
        bake.HostTarget(**fields)


def test_modern_packer_gets_plugin_requirements_and_init(
    dlami_base: str, fake_packer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PACKER_VERSION", "1.11.2")
    bake.bake_aws(_options(tmp_path))
    calls = [json.loads(line) for line in fake_packer.read_text().splitlines()]
    kinds = [args[0] for args in calls]
    assert kinds.index("init") < kinds.index("build")
    staged = Path(calls[kinds.index("init")][1])
    assert (staged / "plugins.pkr.hcl").read_text() == (
        REPO / "packer" / "plugins.pkr.hcl.modern"
    ).read_text()
    assert Path(calls[kinds.index("build")][-1]) == staged


def test_bake_checks_cluster_configs_before_baking(
    dlami_base: str, fake_packer: Path, tmp_path: Path
) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(json.dumps(_cluster_config()))
    argv = ["bake", "--base-parameter", BASE_PARAMETER, "--work-dir", str(tmp_path / "w")]
    assert cli.main([*argv, "--cluster-config", str(config), "--queue", "nosuchqueue"]) == 2
    broken = _cluster_config()
    broken["Scheduling"]["Scheduler"] = "pbs"
    config.write_text(json.dumps(broken))
    assert cli.main([*argv, "--cluster-config", str(config)]) == 2
    assert _builds(fake_packer) == []
    assert _gpuforge_images() == []


def test_bake_refuses_a_cluster_config_for_a_dlami_image_before_baking(
    dlami_base: str, fake_packer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(json.dumps(_cluster_config()))
    argv = ["bake", "--base-parameter", BASE_PARAMETER, "--work-dir", str(tmp_path / "w")]
    assert cli.main([*argv, "--cluster-config", str(config)]) == 2
    assert "ParallelCluster configs take only pcluster-flavor images" in capsys.readouterr().err
    assert _builds(fake_packer) == []


def test_bake_carries_its_target_instance_types_to_ansible_and_tags(
    dlami_base: str, fake_packer: Path, tmp_path: Path
) -> None:
    """The builder stays a g5.2xlarge; the targets reach the playbook (Packer variable) and the image tag."""
    image = bake.bake_aws(_options(tmp_path, target_instance_types=("p4d.24xlarge", "g6e.48xlarge")))
    assert image.tags[targets.TARGETS_TAG] == "p4d.24xlarge,g6e.48xlarge"
    assert targets.from_tags(image.tags) == ("p4d.24xlarge", "g6e.48xlarge")
    (build,) = _builds(fake_packer)
    var_file = Path(next(a.split("=", 1)[1] for a in build if a.startswith("-var-file=")))
    variables = json.loads(var_file.read_text())
    assert variables["instance_type"] == "g5.2xlarge"
    assert variables["target_instance_types"] == ["p4d.24xlarge", "g6e.48xlarge"]


@pytest.mark.parametrize(
    ("target", "why"),
    [
        ("p9.fake", "unknown instance type 'p9.fake'"),
        ("p6e-gb200.36xlarge", "'p6e-gb200.36xlarge' is not supported: arm64"),
        # Some pin cannot serve B200 (driver, CUDA, aws-ofi-nccl or NCCL; skipped once all of them do).
        ("p6-b200.48xlarge", "p6-b200.48xlarge: the pinned "),
    ],
)
def test_bake_refuses_targets_it_cannot_serve_before_launching(
    dlami_base: str, fake_packer: Path, tmp_path: Path, target: str, why: str
) -> None:
    if target == "p6-b200.48xlarge" and not targets.problems(
        targets.instance_types.get(target), versions.load()
    ):
        pytest.skip("versions.yml now pins a driver, CUDA and plugin that serve B200")
    with pytest.raises(UserError, match=re.escape(why)):
        bake.bake_aws(_options(tmp_path, target_instance_types=(target,)))
    assert _builds(fake_packer) == []
    assert _gpuforge_images() == []


def test_bake_copies_to_other_regions_tagged_like_the_original(
    dlami_base: str, fake_packer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bake", "--base-parameter", BASE_PARAMETER, "--work-dir", str(tmp_path / "w"), "--no-publish"]
    assert cli.main([*argv, "--copy-region", "eu-west-1", "--copy-region", "us-west-2"]) == 0
    ami = capsys.readouterr().out.strip().splitlines()[-1]
    (variables,) = (tmp_path / "w").glob("*/variables.json")
    # Packer copies nothing (its copies' snapshots arrive untagged: issue 34); gpuforge copies the image.
    assert "ami_regions" not in json.loads(variables.read_text())
    original = images.describe(ami)
    assert original.tags[images.COPY_REGIONS_TAG] == "eu-west-1,us-west-2"
    for region in ("eu-west-1", "us-west-2"):
        (copy,) = images.gpuforge_images("dlami", region)
        assert copy.tags == original.tags
        # The copy's snapshots carry the build id from CopyImage on (TagSpecifications).
        snapshots = boto3.client("ec2", region_name=region).describe_snapshots(
            SnapshotIds=list(copy.snapshot_ids)
        )
        for snapshot in snapshots["Snapshots"]:
            tags = {t["Key"]: t["Value"] for t in snapshot.get("Tags", [])}
            assert tags[images.BUILD_ID_TAG] == original.tags[images.BUILD_ID_TAG]
    assert cli.main([*argv, "--copy-region", "us-east-1"]) == 2


def test_a_failed_copy_leaves_no_image_or_snapshot_in_any_region(
    dlami_base: str, fake_packer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy EC2 never makes available: the bake fails and _discard retires the original, the copy and
    every snapshot carrying the build id (one left without its image too), in both regions."""
    real_wait = images.wait_available

    def wait(ami_id: str, region: str | None = None, timeout_s: int = 3600) -> None:
        if region == "eu-west-1":
            copy = images.describe(ami_id, region)
            # What EC2 can leave of a failed copy: a snapshot of it whose image is gone.
            ec2 = boto3.client("ec2", region_name=region)
            volume = ec2.create_volume(AvailabilityZone="eu-west-1a", Size=1)["VolumeId"]
            orphan = ec2.create_snapshot(VolumeId=volume)["SnapshotId"]
            ec2.create_tags(
                Resources=[orphan],
                Tags=[{"Key": images.BUILD_ID_TAG, "Value": copy.tags[images.BUILD_ID_TAG]}],
            )
            raise ExternalError(f"image {ami_id} did not become available: failed")
        real_wait(ami_id, region, timeout_s)

    monkeypatch.setattr(images, "wait_available", wait)
    with pytest.raises(ExternalError, match="did not become available"):
        bake.bake_aws(_options(tmp_path, ami_regions=("eu-west-1",)))
    for region in ("us-east-1", "eu-west-1"):
        ec2 = boto3.client("ec2", region_name=region)
        assert (
            ec2.describe_images(
                Owners=["self"], Filters=[{"Name": "tag-key", "Values": [images.BUILD_ID_TAG]}]
            )["Images"]
            == []
        )
        left = ec2.describe_snapshots(
            OwnerIds=["self"], Filters=[{"Name": "tag-key", "Values": [images.BUILD_ID_TAG]}]
        )
        assert left["Snapshots"] == [], region


def test_rebuild_if_stale_retries_a_candidate_whose_canary_failed(
    dlami_base: str, fake_packer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(_rebuild_argv(tmp_path)) == 0
    first = capsys.readouterr().out.strip().splitlines()[-1]
    assert cli.main(_rebuild_argv(tmp_path)) == 0
    assert "waits for `gpuforge canary`" in capsys.readouterr().out
    boto3.client("ec2").create_tags(Resources=[first], Tags=[{"Key": "gpuforge:canary", "Value": "failed"}])
    assert cli.main(_rebuild_argv(tmp_path)) == 0
    assert len(_builds(fake_packer)) == 2
    assert publish.read_parameter(CANDIDATE) not in (None, first)


@pytest.mark.parametrize("verdict", [None, "passed"])
def test_rebuild_if_stale_hands_a_waiting_candidate_back_to_the_pipeline(
    dlami_base: str,
    fake_packer: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    verdict: str | None,
) -> None:
    """A candidate whose canary never ran (no capacity, a cancelled job) or whose promote failed: the next
    scheduled rebuild ends with its id, as after a bake, so the workflow's canary and promote steps run on
    it; a sentence there would skip them on every later schedule and leave latest frozen."""
    assert cli.main(_rebuild_argv(tmp_path, "--candidate")) == 0
    first = capsys.readouterr().out.strip().splitlines()[-1]
    if verdict is not None:
        boto3.client("ec2").create_tags(
            Resources=[first], Tags=[{"Key": "gpuforge:canary", "Value": verdict}]
        )
    assert cli.main(_rebuild_argv(tmp_path, "--candidate")) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(_builds(fake_packer)) == 1
    assert "is current" in out[-2] and "not rebuilding" in out[-2]
    # What the rebuild step of .github/workflows/ami-rebuild.yml takes for the image to canary and promote.
    assert re.fullmatch(r"ami-[0-9a-f]+", out[-1]) and out[-1] == first


# --- issue 28 follow-ups: Packer >= 1.10 on AWS, the bake volume, the builder profile, copy keys ----------


@pytest.mark.parametrize(
    "endpoints",
    [
        {},  # AWS itself
        # AWS_ENDPOINT_URL_EC2 (what boto3 uses for EC2) decides, not the global endpoint on moto.
        {"AWS_ENDPOINT_URL_EC2": "https://ec2.us-east-1.amazonaws.com"},
    ],
    ids=["aws", "ec2-endpoint-off-loopback"],
)
def test_bake_on_aws_refuses_packer_1_6_before_launching(
    dlami_base: str,
    fake_packer: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    endpoints: dict[str, str],
) -> None:
    """Packer 1.6.6 tags the image only at its last step, which the tag-scoped policy denies on real AWS.

    The base is resolved on moto first (a stand-in for resolve_base), so that nothing after it can reach
    AWS: the refusal comes before Packer runs or anything is launched.
    """
    base = images.describe(dlami_base)
    monkeypatch.setattr(bake, "resolve_base", lambda options: base)
    if not endpoints:
        for name in ("AWS_ENDPOINT_URL", "AWS_URL"):
            monkeypatch.delenv(name, raising=False)
    for name, value in endpoints.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        UserError, match=r"packer 1\.6\.6 .* cannot bake on AWS: .*gpuforge:build-id.*CreateImage"
    ):
        bake.bake_aws(_options(tmp_path))
    assert _builds(fake_packer) == []


def test_bake_defaults_the_builder_profile_and_the_base_volume_size(baked: Baked) -> None:
    """The template's Session Manager access needs the profile pipeline-role creates; 0 keeps the base's
    root snapshot size, so the image demands no bigger root volume than the base does."""
    assert baked.variables["iam_instance_profile"] == "gpuforge-builder-us-east-1"
    assert baked.variables["root_volume_size_gib"] == 0
    assert "region_kms_key_ids" not in baked.variables and "ami_regions" not in baked.variables


def test_bake_refuses_a_volume_smaller_than_the_base_snapshot_before_launching(
    dlami_base: str, fake_packer: Path, tmp_path: Path
) -> None:
    snapshot = images.describe(dlami_base).root_volume_gib
    assert snapshot is not None and snapshot > bake.ROOT_VOLUME_GIB[0]
    with pytest.raises(
        UserError, match=rf"smaller than the root snapshot of the base image .*\({snapshot} GiB\)"
    ):
        bake.bake_aws(_options(tmp_path, root_volume_size_gib=snapshot - 1))
    assert _builds(fake_packer) == []
    assert _gpuforge_images() == []
    assert bake.image_root_volume_gib(_options(tmp_path)) == snapshot
    assert bake.image_root_volume_gib(_options(tmp_path, root_volume_size_gib=snapshot + 5)) == snapshot + 5


def test_bake_cli_takes_a_key_per_copy_region_and_the_profile(
    dlami_base: str, fake_packer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PACKER_VERSION", "1.11.2")
    copied: list[tuple[str, str]] = []
    real_copy = images.copy_image

    def copy_image(image: images.Image, source: str, target: str, kms_key_id: str = "") -> str:
        copied.append((target, kms_key_id))
        return real_copy(image, source, target, kms_key_id)

    monkeypatch.setattr(images, "copy_image", copy_image)
    argv = ["bake", "--base-parameter", BASE_PARAMETER, "--work-dir", str(tmp_path / "w"), "--no-publish"]
    key = "arn:aws:kms:eu-west-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"
    copies = ["--kms-key-id", "alias/gpuforge", "--copy-region", "eu-west-1"]
    # A copy region without its key: refused before Packer runs (the copy would get eu-west-1's default key).
    assert cli.main([*argv, *copies]) == 2
    assert _builds(fake_packer) == []
    # A key for a region that is not copied to.
    assert cli.main([*argv, *copies, "--copy-region-kms-key", "us-west-2=" + key]) == 2
    assert _builds(fake_packer) == []
    assert (
        cli.main([*argv, *copies, "--copy-region-kms-key", f"eu-west-1={key}", "--iam-instance-profile", "p"])
        == 0
    )
    (build,) = _builds(fake_packer)
    var_file = Path(next(a.split("=", 1)[1] for a in build if a.startswith("-var-file=")))
    written = json.loads(var_file.read_text())
    assert "region_kms_key_ids" not in written
    assert written["iam_instance_profile"] == "p"
    assert copied == [("eu-west-1", key)]


def test_bake_checks_cluster_configs_against_the_base_snapshot_size_by_default(
    aws: MotoServer, fake_packer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the default size 0 the image keeps the base's root snapshot size: a queue's RootVolume.Size of
    that size is accepted (the old 100 GiB bake volume refused it), one below it is refused before baking
    (ParallelCluster would refuse it at create/update time)."""
    base = _register_base("aws-parallelcluster-3.16.1-ubuntu-2204-lts-hvm-x86_64-202611010000")
    snapshot = images.describe(base).root_volume_gib
    assert snapshot is not None and snapshot > 1
    small = _cluster_config()
    small["Scheduling"]["SlurmQueues"][0]["ComputeSettings"] = {
        "LocalStorage": {"RootVolume": {"Size": snapshot - 1}}
    }
    config = tmp_path / "cluster.yaml"
    config.write_text(json.dumps(small))
    argv = ["bake", "--flavor", "pcluster", "--base-owner", "self", "--work-dir", str(tmp_path / "w")]
    assert cli.main([*argv, "--parameter", "/gpuforge/test/ami", "--cluster-config", str(config)]) == 2
    assert f"Root volume size {snapshot - 1} GiB" in capsys.readouterr().err
    assert _builds(fake_packer) == []
    small["Scheduling"]["SlurmQueues"][0]["ComputeSettings"]["LocalStorage"]["RootVolume"]["Size"] = snapshot
    config.write_text(json.dumps(small))
    assert cli.main([*argv, "--parameter", "/gpuforge/test/ami", "--cluster-config", str(config)]) == 0
    assert len(_builds(fake_packer)) == 1


def test_bake_refuses_a_copy_region_ec2_does_not_offer_before_launching(
    dlami_base: str, fake_packer: Path, tmp_path: Path
) -> None:
    """packer-plugin-amazon v1.8.2 checked ami_regions against DescribeRegions before launching
    (builder/common/step_pre_validate.go:70-80, regions.go:29-50); gpuforge's own copies keep that check."""
    bad = r"--copy-region eu-nowhere-9, us-nowhere-1: not a region enabled"
    with pytest.raises(UserError, match=bad) as caught:
        bake.bake_aws(_options(tmp_path, ami_regions=("eu-nowhere-9", "eu-west-1", "us-nowhere-1")))
    assert "eu-west-1," in str(caught.value) and "us-west-2" in str(caught.value)
    assert _builds(fake_packer) == []
    assert _gpuforge_images() == []


def _record_copy_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Record the CopyImage requests as boto3 sends them (after validation, before any retry)."""
    seen: list[dict[str, Any]] = []
    original = aws.client

    def recording_client(service: str, region_name: str | None = None) -> Any:
        client = original(service, region_name)
        client.meta.events.register(
            "provide-client-params.ec2.CopyImage", lambda params, **_: seen.append(dict(params))
        )
        return client

    monkeypatch.setattr(aws, "client", recording_client)
    return seen


def _own_bake(build_id: str, description: str = "") -> images.Image:
    """An image standing in for one gpuforge baked (tagged with its build id)."""
    ec2 = boto3.client("ec2")
    instance = ec2.run_instances(ImageId="ami-785db401", MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    extra = {"Description": description} if description else {}
    ami = str(ec2.create_image(InstanceId=instance, Name="gpuforge-dlami-test", **extra)["ImageId"])
    ec2.terminate_instances(InstanceIds=[instance])
    ec2.create_tags(Resources=[ami], Tags=[{"Key": images.BUILD_ID_TAG, "Value": build_id}])
    return images.describe(ami)


def test_copy_image_sends_a_client_token_per_build_and_region(
    aws: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """boto3 retries a CopyImage whose reply was lost; without ClientToken EC2 would make a second copy
    (Amazon EC2 API Reference, CopyImage ClientToken; "Ensuring idempotency")."""
    seen = _record_copy_calls(monkeypatch)
    image = _own_bake("0123456789ab")
    images.copy_image(image, "us-east-1", "eu-west-1")
    long_id = "b" * 70
    images.copy_image(_own_bake(long_id), "us-east-1", "eu-west-1")
    first, second = seen
    assert first["ClientToken"] == "0123456789ab-eu-west-1"
    token = second["ClientToken"]
    assert len(token) <= 64 and token.isascii() and token != first["ClientToken"]
    # The same build and region always give the same token, so a retry is recognized as one.
    images.copy_image(image, "us-east-1", "eu-west-1")
    assert seen[2]["ClientToken"] == first["ClientToken"]


def test_copy_image_gives_the_copy_the_images_description(
    aws: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packer set ami_description on every image it made, copies too (packer-plugin-amazon v1.8.2
    builder/common/step_modify_ami_attributes.go:78-82 and 205-213); gpuforge's copies keep it."""
    seen = _record_copy_calls(monkeypatch)
    image = _own_bake("0123456789ab", description="gpuforge dlami GPU image built from abc123")
    assert image.description == "gpuforge dlami GPU image built from abc123"
    images.copy_image(image, "us-east-1", "eu-west-1")
    (request,) = seen
    assert request["Description"] == image.description
    images.copy_image(_own_bake("0123456789ac"), "us-east-1", "eu-west-1")
    assert "Description" not in seen[1]


def test_a_discard_that_cannot_reach_one_region_goes_on_with_the_others(
    dlami_base: str,
    fake_packer: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One region's clean-up failing (its endpoint unreachable) is logged with what to run by hand; the
    other regions are still cleaned and the bake fails with its own error."""
    from botocore.exceptions import EndpointConnectionError

    real_discard = images.discard_build
    discarded: list[str | None] = []

    def discard(build_id: str, region: str | None = None, **kw: Any) -> None:
        discarded.append(region)
        if region == "eu-west-1":
            raise EndpointConnectionError(endpoint_url="https://ec2.eu-west-1.amazonaws.com/")
        real_discard(build_id, region, **kw)

    def wait(ami_id: str, region: str | None = None, timeout_s: int = 3600) -> None:
        raise ExternalError(f"image {ami_id} did not become available: failed")

    monkeypatch.setattr(images, "discard_build", discard)
    monkeypatch.setattr(images, "wait_available", wait)
    with pytest.raises(ExternalError, match="did not become available"):
        bake.bake_aws(_options(tmp_path, ami_regions=("eu-west-1", "us-west-2")))
    assert discarded == ["us-east-1", "eu-west-1", "us-west-2"]
    assert _gpuforge_images() == []
    (logged,) = [r.getMessage() for r in caplog.records if "eu-west-1" in r.getMessage()]
    assert "Could not connect to the endpoint URL" in logged
    assert "aws ec2 describe-images --region eu-west-1 --owners self --filters" in logged
    assert "aws ec2 describe-snapshots --region eu-west-1 --owner-ids self --filters" in logged


def _snapshot_hooks(
    monkeypatch: pytest.MonkeyPatch, after_describe: Callable[[dict[str, Any]], None]
) -> None:
    """Run after_describe on every DescribeSnapshots reply the pipeline's EC2 clients receive."""
    original = aws.client

    def hooked_client(service: str, region_name: str | None = None) -> Any:
        client = original(service, region_name)
        client.meta.events.register(
            "after-call.ec2.DescribeSnapshots", lambda parsed, **_: after_describe(parsed)
        )
        return client

    monkeypatch.setattr(aws, "client", hooked_client)


def _tagged_snapshot(build_id: str, region: str = "us-east-1") -> str:
    ec2 = boto3.client("ec2", region_name=region)
    volume = ec2.create_volume(AvailabilityZone=f"{region}a", Size=1)["VolumeId"]
    snapshot = str(ec2.create_snapshot(VolumeId=volume)["SnapshotId"])
    ec2.create_tags(Resources=[snapshot], Tags=[{"Key": images.BUILD_ID_TAG, "Value": build_id}])
    return snapshot


def _pending_copy(build_id: str, monkeypatch: pytest.MonkeyPatch) -> images.Image:
    """A copy EC2 has not finished (state pending), as discard_build finds it after a timed-out wait."""
    import dataclasses

    copy = dataclasses.replace(_own_bake(build_id), state="pending")
    monkeypatch.setattr(images, "images_with_build_id", lambda b, r=None: [copy] if b == build_id else [])
    return copy


def test_discard_waits_for_the_snapshot_of_a_copy_still_pending(
    aws: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy deregistered while pending can get its snapshot after the first DescribeSnapshots: the
    discard keeps looking (bounded) and deletes it when it appears."""
    build_id = "0123456789ab"
    _pending_copy(build_id, monkeypatch)
    late: list[str] = []

    def after_describe(parsed: dict[str, Any]) -> None:
        if not late:
            late.append(_tagged_snapshot(build_id))

    _snapshot_hooks(monkeypatch, after_describe)
    images.discard_build(build_id, "us-east-1", settle_s=30, poll_s=0.05)
    ec2 = boto3.client("ec2")
    left = ec2.describe_snapshots(OwnerIds=["self"], SnapshotIds=[])["Snapshots"]
    assert late and late[0] not in {s["SnapshotId"] for s in left}


def test_discard_names_the_snapshots_still_pending_at_its_deadline(
    aws: MotoServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    build_id = "0123456789ab"
    _pending_copy(build_id, monkeypatch)
    stuck = _tagged_snapshot(build_id)

    def after_describe(parsed: dict[str, Any]) -> None:
        for snapshot in parsed.get("Snapshots", []):
            if snapshot["SnapshotId"] == stuck:
                snapshot["State"] = "pending"

    _snapshot_hooks(monkeypatch, after_describe)
    images.discard_build(build_id, "us-east-1", settle_s=0.3, poll_s=0.05)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"aws ec2 delete-snapshot --region us-east-1 --snapshot-id {stuck}" in logged
