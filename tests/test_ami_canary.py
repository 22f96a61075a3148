"""`gpuforge canary`, `promote` and `rollback` against moto (the test double for EC2, SSM and S3).

moto neither boots instances nor runs SSM commands, so two test doubles stand in for the nodes:
- SsmAgentOnline answers DescribeInstanceInformation (which moto does not implement) with the
  canary's instances Online, as the SSM agent of a booted image would make them;
- FakeNodes puts, for every SendCommand, what gpuforge-canary.sh would have printed on each node
  where the SSM agent would have written it (the S3 output key of AWS-RunShellScript). It also
  unpacks the bundle the command carries, so a test sees exactly what the node would run.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shlex
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError

from gpuforge import aws as gpuforge_aws
from gpuforge import cli, targets
from gpuforge.ami import canary, images, promote, publish
from gpuforge_lab.moto import MotoServer
from imagetools import baked_image

REPO = Path(__file__).resolve().parents[1]
BUCKET = "gpuforge-canary-results"
PROFILE = "gpuforge-canary"
TYPE = "p5.48xlarge"
# A real 2 x p5.48xlarge all_reduce table (tests/fixtures/nccl/README.md: its source), completed into the
# log a finished EFA run prints: NCCL's network lines before it and the summary line after it.
P5_TABLE = (REPO / "tests/fixtures/nccl/adt-p5-2node-srun-label.excerpt.log").read_text()
P5_RUN = (
    "0: host-a:1:1 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct (found 32 nics)\n"
    "0: host-a:1:1 [0] NCCL INFO Using network Libfabric\n" + P5_TABLE + "0: # Avg bus bandwidth    : 150.2\n"
)


def _healthy_check(run_id: str) -> dict[str, Any]:
    return {
        "format": 1,
        "run_id": run_id,
        "step": "check",
        "health": {
            "rc": 0,
            "report": {"healthy": True, "results": [{"check": "gpu_count", "status": "pass"}]},
        },
        "smoke": {"rc": 0, "report": {"status": "ran", "gpu_count": 8}},
    }


class FakeNodes:
    """Test double for the canary's nodes: what gpuforge-canary.sh prints, put where SSM would put it."""

    def __init__(self) -> None:
        self.commands: list[dict[str, Any]] = []
        self.check: Callable[[str, str], dict[str, Any]] = lambda run_id, _instance: _healthy_check(run_id)
        self.allreduce_log = P5_RUN
        self.fail_send = False
        self.asked: list[str] = []

    def argv(self, command: dict[str, Any]) -> list[str]:
        return shlex.split(command["Parameters"]["commands"][-1])[2:]

    def bundle(self, command: dict[str, Any]) -> dict[str, bytes]:
        line = next(c for c in command["Parameters"]["commands"] if "base64 -d" in c)
        data = base64.b64decode(line.split()[1])
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]

    def output(self, argv: list[str], instance: str) -> dict[str, Any]:
        step, run_id = argv[0], argv[1]
        if step == "check":
            return self.check(run_id, instance)
        if step == "keygen":
            return {"run_id": run_id, "step": step, "public_key": "ssh-ed25519 AAAAtest " + run_id}
        if step == "authorize":
            return {"run_id": run_id, "step": step}
        return {"run_id": run_id, "step": step, "nccl": {"rc": 0, "stderr": "", "log": self.allreduce_log}}

    def before_send(self, params: dict[str, Any], **_: Any) -> None:
        # moto's reply lists every instance it knows when a command has no Targets: keep what was asked.
        self.asked = json.loads(params["body"])["InstanceIds"]
        if self.fail_send:
            raise ClientError(
                {"Error": {"Code": "AccessDeniedException", "Message": "denied"}}, "SendCommand"
            )

    def after_send(self, parsed: dict[str, Any], **_: Any) -> None:
        command = {**parsed["Command"], "InstanceIds": self.asked}
        self.commands.append(command)
        s3 = boto3.client("s3")
        for instance in command["InstanceIds"]:
            key = (
                f"{command['OutputS3KeyPrefix']}/{command['CommandId']}/{instance}"
                "/awsrunShellScript/0.awsrunShellScript/stdout"
            )
            body = json.dumps(self.output(self.argv(command), instance)) + "\n"
            s3.put_object(Bucket=command["OutputS3BucketName"], Key=key, Body=body.encode())


def _online(params: dict[str, Any], **_: Any) -> tuple[AWSResponse, dict[str, Any]]:
    """Test double for the SSM agents of the booted instances: every asked-for instance is Online."""
    # before-call sees the serialized request: SSM's JSON body.
    ids = json.loads(params["body"])["Filters"][0]["Values"]
    listed = [{"InstanceId": i, "PingStatus": "Online"} for i in ids]
    return AWSResponse("https://ssm.test", 200, {}, None), {"InstanceInformationList": listed}


@pytest.fixture
def nodes(aws: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNodes]:
    fake = FakeNodes()
    original = gpuforge_aws.client

    def client(name: str, region_name: str | None = None) -> Any:
        made = original(name, region_name)
        if name == "ssm":
            made.meta.events.register("before-call.ssm.DescribeInstanceInformation", _online)
            made.meta.events.register("before-call.ssm.SendCommand", fake.before_send)
            made.meta.events.register("after-call.ssm.SendCommand", fake.after_send)
        return made

    monkeypatch.setattr(gpuforge_aws, "client", client)
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    boto3.client("iam").create_instance_profile(InstanceProfileName=PROFILE)
    yield fake


def _subnet() -> str:
    return str(boto3.client("ec2").describe_subnets()["Subnets"][0]["SubnetId"])


def _candidate() -> str:
    ami = baked_image("dlami", "gpuforge-dlami-candidate")
    # As a bake tags it for its targets (gpuforge.targets.Targets.tags).
    images.add_tags(ami, {targets.TARGETS_TAG: f"{TYPE},p4d.24xlarge"})
    promote.publish_candidate(ami, "dlami")
    return ami


def _instances(run_id: str | None = None) -> list[dict[str, Any]]:
    filters = [{"Name": "tag-key", "Values": [canary.CANARY_TAG]}]
    pages = boto3.client("ec2").describe_instances(Filters=filters)["Reservations"]
    found = [i for r in pages for i in r["Instances"]]
    return [i for i in found if run_id is None or {"Key": canary.CANARY_TAG, "Value": run_id} in i["Tags"]]


def _canary_argv(*extra: str) -> list[str]:
    return [
        "canary",
        "--instance-type",
        TYPE,
        "--subnet-id",
        _subnet(),
        "--instance-profile",
        PROFILE,
        "--results-bucket",
        BUCKET,
        *extra,
    ]


def test_two_node_canary_launches_what_was_asked_passes_records_and_terminates(
    nodes: FakeNodes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ami = _candidate()
    assert cli.main(_canary_argv("--count", "2", "--out", str(tmp_path))) == 0
    out = capsys.readouterr().out
    assert f"{ami}: canary passed on 2 x {TYPE}" in out

    launched = _instances()
    assert len(launched) == 2
    run_id = next(t["Value"] for t in launched[0]["Tags"] if t["Key"] == canary.CANARY_TAG)
    assert all(i["InstanceType"] == TYPE and i["ImageId"] == ami for i in launched)
    assert {i["State"]["Name"] for i in launched} == {"terminated"}
    # p5.48xlarge promises 32 EFA interfaces (data/instance_types.yml): one per network card.
    efa = [n for n in launched[0]["NetworkInterfaces"] if n.get("InterfaceType") == "efa"]
    assert len(efa) == 32

    # check on both nodes, then the key exchange, then all_reduce on the leader only.
    steps = [(nodes.argv(c)[0], len(c["InstanceIds"])) for c in nodes.commands]
    assert steps == [("check", 2), ("keygen", 1), ("authorize", 1), ("allreduce", 1)]
    leader = nodes.commands[1]["InstanceIds"]
    assert nodes.commands[3]["InstanceIds"] == leader != nodes.commands[2]["InstanceIds"]
    assert nodes.argv(nodes.commands[2])[2].startswith("ssh-ed25519 ")
    # What the node runs is the repository's node side, byte for byte.
    bundle = nodes.bundle(nodes.commands[0])
    assert {name: (REPO / name).read_bytes() for name in canary.NODE_FILES} == bundle

    tags = images.describe(ami).tags
    assert tags[canary.CANARY_TAG] == canary.PASSED
    assert tags[canary.CANARY_TYPE_TAG] == TYPE
    assert tags[canary.CANARY_RUN_TAG] == run_id
    report = json.loads((tmp_path / "report.json").read_text())
    assert [run["verdict"] for run in report["runs"]] == ["PASS"]
    assert json.loads((tmp_path / "canary.json").read_text())["passed"] is True


def test_failed_health_check_fails_records_and_terminates(nodes: FakeNodes) -> None:
    ami = _candidate()

    def one_bad_node(run_id: str, instance: str) -> dict[str, Any]:
        result = _healthy_check(run_id)
        result["health"]["report"] = {
            "healthy": False,
            "results": [{"check": "efa_devices", "status": "fail", "detail": "0 of 32"}],
        }
        return result

    nodes.check = one_bad_node
    assert cli.main(_canary_argv()) == 1
    assert [i["State"]["Name"] for i in _instances()] == ["terminated"]
    assert images.describe(ami).tags[canary.CANARY_TAG] == canary.FAILED
    # A failed check stops there: no key exchange, no all_reduce.
    assert [nodes.argv(c)[0] for c in nodes.commands] == ["check"]


def test_slow_all_reduce_fails_the_canary(nodes: FakeNodes) -> None:
    ami = _candidate()
    # The same table at half the bandwidth: below 90% of the 2-node p5 baseline.
    nodes.allreduce_log = (
        P5_RUN.replace("479.28", "239.64")
        .replace("487.09", "243.54")
        .replace("478.95", "239.47")
        .replace("487.26", "243.63")
    )
    assert cli.main(_canary_argv("--count", "2")) == 1
    assert images.describe(ami).tags[canary.CANARY_TAG] == canary.FAILED
    assert {i["State"]["Name"] for i in _instances()} == {"terminated"}


def test_ssm_step_raising_still_terminates(nodes: FakeNodes, capsys: pytest.CaptureFixture[str]) -> None:
    ami = _candidate()
    nodes.fail_send = True
    assert cli.main(_canary_argv("--count", "2")) == 1
    assert "SendCommand" in capsys.readouterr().err
    assert {i["State"]["Name"] for i in _instances()} == {"terminated"}
    assert images.describe(ami).tags[canary.CANARY_TAG] == canary.FAILED


def test_interrupt_still_terminates(nodes: FakeNodes, monkeypatch: pytest.MonkeyPatch) -> None:
    _candidate()

    def interrupted(*_: Any, **__: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(canary, "wait_managed", interrupted)
    assert cli.main(_canary_argv()) == 130
    assert [i["State"]["Name"] for i in _instances()] == ["terminated"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--count", "3"], "--count must be 1 or 2"),
        (["--instance-type", "p9.hugexlarge"], "unknown instance type 'p9.hugexlarge'"),
        (["--instance-type", "c5n.18xlarge"], "c5n.18xlarge has no GPUs"),
        (["--instance-type", "g6e.8xlarge"], "was not baked for g6e.8xlarge"),
        (["--capacity-block"], "--capacity-block needs --capacity-reservation-id"),
    ],
)
def test_bad_input_launches_nothing(
    nodes: FakeNodes, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    _candidate()
    assert cli.main(_canary_argv(*extra)) == 2
    assert message in capsys.readouterr().err
    assert _instances() == []


def test_launch_parameters_for_a_capacity_block() -> None:
    request = canary.Request(
        ami="ami-0123456789abcdef0",
        instance_type=TYPE,
        count=2,
        results_bucket=BUCKET,
        instance_profile=PROFILE,
        placement_group="pg",
        capacity_reservation_id="cr-0123456789abcdef0",
        capacity_block=True,
    )
    from gpuforge import instance_types

    params = canary.launch_parameters(request, instance_types.get(TYPE), "canary-x")
    assert (params["MinCount"], params["MaxCount"], params["InstanceType"]) == (2, 2, TYPE)
    assert params["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
    assert params["CapacityReservationSpecification"]["CapacityReservationTarget"] == {
        "CapacityReservationId": "cr-0123456789abcdef0"
    }
    assert params["Placement"] == {"GroupName": "pg"}
    assert {"Key": canary.CANARY_TAG, "Value": "canary-x"} in params["TagSpecifications"][0]["Tags"]
    cards = [(n["NetworkCardIndex"], n["DeviceIndex"]) for n in params["NetworkInterfaces"]]
    assert cards[:2] == [(0, 0), (1, 1)] and len(cards) == 32


def _tag(ami: str, verdict: str) -> None:
    images.add_tags(ami, {canary.CANARY_TAG: verdict})


def test_promote_refuses_without_a_pass(aws: MotoServer, capsys: pytest.CaptureFixture[str]) -> None:
    ami = _candidate()
    assert cli.main(["promote"]) == 2
    assert "never ran" in capsys.readouterr().err
    _tag(ami, canary.FAILED)
    assert cli.main(["promote"]) == 2
    assert "recorded failed" in capsys.readouterr().err
    assert publish.read_parameter(publish.default_parameter("dlami", "ubuntu2204")) is None


def test_promote_moves_latest_keeps_previous_and_rollback_restores(
    aws: MotoServer, caplog: pytest.LogCaptureFixture
) -> None:
    latest = publish.default_parameter("dlami", "ubuntu2204")
    old = baked_image("dlami", "gpuforge-dlami-old")
    _tag(old, canary.PASSED)
    assert cli.main(["promote", "--ami", old]) == 0
    assert publish.read_parameter(latest) == old
    assert publish.read_parameter(promote.previous_parameter("dlami", "ubuntu2204")) is None

    new = _candidate()
    _tag(new, canary.PASSED)
    assert cli.main(["promote"]) == 0
    assert publish.read_parameter(latest) == new
    assert publish.read_parameter(promote.previous_parameter("dlami", "ubuntu2204")) == old

    assert cli.main(["rollback"]) == 0
    assert publish.read_parameter(latest) == old
    assert cli.main(["rollback"]) == 0  # a second rollback changes nothing
    assert publish.read_parameter(latest) == old


def test_promote_force_warns(aws: MotoServer, caplog: pytest.LogCaptureFixture) -> None:
    ami = _candidate()
    assert cli.main(["promote", "--force"]) == 0
    assert publish.read_parameter(publish.default_parameter("dlami", "ubuntu2204")) == ami
    assert "--force" in caplog.text and "nobody checked" in caplog.text


def test_promote_refuses_an_image_of_another_os(aws: MotoServer, capsys: pytest.CaptureFixture[str]) -> None:
    ami = baked_image("dlami", "gpuforge-dlami-2204")
    _tag(ami, canary.PASSED)
    assert cli.main(["promote", "--os", "ubuntu2404", "--ami", ami]) == 2
    assert "not dlami/ubuntu2404" in capsys.readouterr().err


def test_rollback_without_previous_is_a_user_error(
    aws: MotoServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["rollback"]) == 2
    assert "nothing to roll back to" in capsys.readouterr().err


def test_canary_policy_fits_a_managed_policy_and_scopes_what_it_destroys() -> None:
    """IAM's managed-policy limit (6,144 characters without whitespace), and the canary terminates and
    commands only instances tagged by a canary run."""
    text = (REPO / "packer/iam/canary-policy.json").read_text()
    assert len("".join(text.split())) <= 6144
    statements = {s["Sid"]: s for s in json.loads(text)["Statement"]}
    for sid in ("GpuforgeCanaryTerminate", "GpuforgeCanaryCommandInstances"):
        condition = statements[sid]["Condition"]["StringLike"]
        assert [(key.rsplit("/", 1)[1], value) for key, value in condition.items()] == [
            (canary.CANARY_TAG, "canary-*")
        ]


def _workflow_steps() -> list[dict[str, Any]]:
    import yaml

    workflow = yaml.safe_load((REPO / ".github/workflows/ami-rebuild.yml").read_text())
    return list(workflow["jobs"]["rebuild"]["steps"])


def test_scheduled_workflow_runs_rebuild_canary_promote_in_that_order() -> None:
    steps = _workflow_steps()
    names = [str(s.get("name", "")).split(" $")[0] for s in steps]
    assert names.index("Rebuild") < names.index("Canary") < names.index("Promote") < names.index("Prune")
    rebuild, canary_step, promote_step = (steps[names.index(n)] for n in ("Rebuild", "Canary", "Promote"))
    assert "args+=(--candidate)" in rebuild["run"] and "set -o pipefail" in rebuild["run"]
    # Canary runs only when rebuild made an image, promote only when its canary passed; both on that image.
    assert canary_step["if"] == "steps.rebuild.outputs.ami != ''"
    assert promote_step["if"] == "steps.canary.outputs.passed == 'true'"
    for step in (canary_step, promote_step):
        assert step["env"]["AMI"] == "${{ steps.rebuild.outputs.ami }}"
    assert "gpuforge canary " in canary_step["run"] and "gpuforge promote " in promote_step["run"]
    # The commands parse: every option they pass exists.
    parser = cli.build_parser()
    parser.parse_args(["promote", "--flavor", "dlami", "--ami", "ami-0123456789abcdef0"])
    parser.parse_args(["rebuild", "--flavor", "dlami", "--if-stale", "--candidate"])
    argv = ["canary", "--flavor", "dlami", "--ami", "ami-0123456789abcdef0", "--instance-type", TYPE]
    argv += ["--count", "2", "--instance-profile", PROFILE, "--results-bucket", BUCKET, "--out", "d"]
    argv += ["--boot-timeout", "1200", "--command-timeout", "2400"]
    argv += [
        "--subnet-id",
        "s",
        "--placement-group",
        "g",
        "--capacity-reservation-id",
        "cr",
        "--capacity-block",
    ]
    parser.parse_args(argv)
    for option in {w for w in canary_step["run"].split() if w.startswith("--")}:
        assert option in argv, option


def test_rebuild_candidate_refuses_cluster_configs(
    aws: MotoServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A config that exists: a missing one is refused earlier, when the arguments are parsed.
    config = tmp_path / "c.yaml"
    config.write_text("Region: us-east-1\n")
    assert cli.main(["rebuild", "--candidate", "--cluster-config", str(config)]) == 2
    assert "give configs to `gpuforge promote`" in capsys.readouterr().err


def test_node_check_step_output_is_what_the_judge_reads(tmp_path: Path) -> None:
    """The real node script, unpacked as the command unpacks it, on this GPU-less machine with a stand-in
    for the image's health script (a test double): its JSON is judged, and fails on the smoke test."""
    bundle = base64.b64decode(canary.node_bundle())
    with tarfile.open(fileobj=io.BytesIO(bundle), mode="r:gz") as tar:
        tar.extractall(tmp_path / "node", filter="data")
    health = tmp_path / "gpuforge-health"
    health.write_text(
        '#!/bin/sh\necho \'{"healthy": true, "results": [{"check": "x", "status": "pass"}]}\'\n'
    )
    health.chmod(0o755)
    run_id = "canary-20261206t000000z-0123abcd"
    result = subprocess.run(
        ["bash", str(tmp_path / "node/scripts/canary/gpuforge-canary.sh"), "check", run_id, TYPE],
        env={
            **os.environ,
            "GPUFORGE_HEALTH": str(health),
            "GPUFORGE_CANARY_TIMEOUT": "60",
            "TMPDIR": str(tmp_path),
        },
        capture_output=True,
        text=True,
        check=True,
    )
    document = json.loads(result.stdout)
    assert document["run_id"] == run_id and document["health"]["report"]["healthy"] is True
    assert document["smoke"]["report"]["status"] == "no_gpu"
    assert canary.judge_check("i-node", document) == ["i-node: GPU smoke test failed (exit 1)"]


@pytest.mark.parametrize("count", [1, 2])
def test_canary_nodes_end_themselves_when_gpuforge_cannot_terminate_them(
    nodes: FakeNodes, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    """A cancelled job or an expired AWS session skips gpuforge's own TerminateInstances: each node then
    halts itself after the run's longest possible duration, and a halt terminates it (issue 28 review)."""
    _candidate()
    monkeypatch.setattr(canary, "terminate", lambda *_: None)  # gpuforge never gets to terminate
    timeouts = ("--boot-timeout", "600", "--command-timeout", "900")
    assert cli.main(_canary_argv("--count", str(count), *timeouts)) == 0
    ec2 = boto3.client("ec2")
    for instance in _instances():
        assert instance["State"]["Name"] == "running"
        behavior = ec2.describe_instance_attribute(
            InstanceId=instance["InstanceId"], Attribute="instanceInitiatedShutdownBehavior"
        )
        assert behavior["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
        data = ec2.describe_instance_attribute(InstanceId=instance["InstanceId"], Attribute="userData")
        script = base64.b64decode(data["UserData"]["Value"]).decode()
        assert script.startswith("#!/bin/sh\n")
        (minutes,) = [int(w[1:]) for w in shlex.split(script.splitlines()[1]) if w.startswith("+")]
        # Never before the run's own waits: boot twice (running, SSM), each command round, termination.
        rounds = 1 if count == 1 else 4
        assert minutes * 60 >= 2 * 600 + rounds * (900 + 600) + 1800
        assert minutes * 60 <= 2 * 600 + rounds * (900 + 600) + 1800 + 60
