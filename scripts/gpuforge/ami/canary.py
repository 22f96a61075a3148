"""`gpuforge canary`: boot a candidate image on its target hardware, check it there, record the verdict.

One run: launch 1 or 2 instances of one target type from the image (tagged gpuforge:canary=<run id>),
wait until they run and SSM manages them, send the node-side script (scripts/canary/gpuforge-canary.sh)
with AWS-RunShellScript, read what each node printed from the S3 output SSM writes, judge it (the
image's health checks, the GPU smoke test, and on 2 nodes an nccl-tests all_reduce judged as
`gpuforge nccl-report` judges it), tag the image with the verdict, and always terminate what was
launched. `gpuforge promote` (gpuforge.ami.promote) moves `latest` only to an image tagged passed.
"""

from __future__ import annotations

import base64
import datetime
import io
import json
import logging
import secrets
import shlex
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError, WaiterError

from gpuforge import aws, instance_types, paths, targets
from gpuforge.ami import images
from gpuforge.errors import ExternalError, UserError
from gpuforge.instance_types import InstanceType
from gpuforge.nccl import report as nccl_report
from gpuforge.nccl.evaluate import THRESHOLD, Verdict, settings
from gpuforge.nccl.judge import judge_log

LOG = logging.getLogger(__name__)

# On the canary's instances: the run id. On an image: the verdict of its latest canary run.
CANARY_TAG = "gpuforge:canary"
CANARY_AT_TAG = "gpuforge:canary-at"
CANARY_TYPE_TAG = "gpuforge:canary-type"
CANARY_RUN_TAG = "gpuforge:canary-run"
PASSED = "passed"
FAILED = "failed"
# One node checks the image; two also check NCCL over the network between them.
NODE_COUNTS = (1, 2)
# AWS's own Run Command document for shell commands (runs them as root with /bin/sh); nothing to
# create or keep in sync in the account.
DOCUMENT = "AWS-RunShellScript"
# Where the SSM agent writes a command's stdout when SendCommand names an output bucket:
# <OutputS3KeyPrefix>/<CommandId>/<InstanceId>/awsrunShellScript/0.awsrunShellScript/stdout. Not in
# AWS's API reference; the layout every public reader of AWS-RunShellScript output uses (for example
# the S3 keys in the Splunk SOAR AWS SSM app's documented action results).
_STDOUT_KEY = "{prefix}/{command}/{instance}/awsrunShellScript/0.awsrunShellScript/stdout"
# The node side travels inside the command (gzip + base64): the canary script, and gpu-smoke.sh with
# the instance types it reads, laid out as in a checkout.
NODE_FILES = ("scripts/canary/gpuforge-canary.sh", "scripts/gpu-smoke.sh", "data/instance_types.yml")
# SendCommand's limit on the size of its Parameters is not in AWS's API reference or quotas pages we
# could find; the one figure seen (16 KiB, third-party) is used as a ceiling we refuse to go past.
MAX_COMMAND_BYTES = 16 * 1024
# On the node (root, fresh instance), not here.
_NODE_DIR = "/var/tmp/gpuforge-canary"  # noqa: S108 (a path on the canary node, made 0700 by root)
_TERMINAL = {"Success", "Failed", "Cancelled", "TimedOut", "Cancelling"}


@dataclass(frozen=True)
class Request:
    ami: str
    instance_type: str
    count: int
    results_bucket: str
    instance_profile: str
    subnet_id: str | None = None
    security_group_ids: tuple[str, ...] = ()
    placement_group: str | None = None
    capacity_reservation_id: str | None = None
    capacity_block: bool = False
    results_prefix: str = "gpuforge-canary"
    region: str | None = None
    boot_timeout_s: int = 1800
    command_timeout_s: int = 7200
    baseline_file: Path | None = None
    threshold: float = THRESHOLD
    out_dir: Path | None = None


@dataclass
class Outcome:
    run_id: str
    instance_ids: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.reasons and bool(self.results)


def new_run_id(now: datetime.datetime | None = None) -> str:
    stamp = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y%m%dt%H%M%Sz")
    return f"canary-{stamp}-{secrets.token_hex(4)}"


def target_type(request: Request, image: images.Image) -> InstanceType:
    """The instance type's facts, after checking the request against the image (UserError if it fails)."""
    if request.count not in NODE_COUNTS:
        raise UserError(f"--count must be 1 or 2 (2 adds an nccl-tests all_reduce), got {request.count}")
    known = instance_types.all_types()
    facts = known.get(request.instance_type)
    if facts is None:
        raise UserError(
            f"unknown instance type {request.instance_type!r}: the canary runs on a type of "
            f"data/instance_types.yml ({', '.join(sorted(t for t, f in known.items() if f.gpus))})"
        )
    if not facts.gpus:
        raise UserError(f"{request.instance_type} has no GPUs; the canary checks GPU images on GPU types")
    promised = targets.from_tags(image.tags)
    if request.instance_type not in promised:
        raise UserError(
            f"image {image.id} was not baked for {request.instance_type} (its {targets.TARGETS_TAG}: "
            f"{', '.join(promised) or 'none'}); run the canary on one of its target types"
        )
    if request.capacity_block and not request.capacity_reservation_id:
        raise UserError(
            "--capacity-block needs --capacity-reservation-id (the Capacity Block's reservation id)"
        )
    if not request.results_bucket:
        raise UserError("--results-bucket is required: SSM writes what the nodes print there")
    return facts


def _network_interfaces(request: Request, facts: InstanceType) -> list[dict[str, Any]]:
    """One EFA interface per network card: card 0 at device index 0, the others at device index 1
    (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html, "Maximize network
    bandwidth ... with multiple network cards"). The health checks fail a node missing promised EFA."""
    interfaces = []
    for card in range(facts.efa_interfaces):
        nic: dict[str, Any] = {"NetworkCardIndex": card, "DeviceIndex": 0 if card == 0 else 1}
        nic["InterfaceType"] = "efa"
        if request.subnet_id:
            nic["SubnetId"] = request.subnet_id
        if request.security_group_ids:
            nic["Groups"] = list(request.security_group_ids)
        interfaces.append(nic)
    return interfaces


def node_commands_count(request: Request) -> int:
    """SendCommand rounds of one run: check, and with 2 nodes keygen, authorize and allreduce."""
    return 1 if request.count == 1 else 4


def lifetime_minutes(request: Request) -> int:
    """How long a canary node may live: every wait of the run at its limit, plus the time to terminate.

    gpuforge terminates its nodes itself; this bound is the node's own dead-man switch for when it cannot
    (the job cancelled or killed, its AWS session expired): the node halts itself then, and a halt
    terminates it (launch_parameters). It never fires before the run's own timeouts would have.
    """
    rounds = node_commands_count(request)
    # wait_running and wait_managed each allow boot_timeout_s; wait_command allows command_timeout_s + 600
    # per round; terminate waits up to 1800 s.
    seconds = 2 * request.boot_timeout_s + rounds * (request.command_timeout_s + 600) + 1800
    return -(-seconds // 60)


def _dead_man_switch(request: Request) -> str:
    """User data that halts the node after lifetime_minutes: a shell script, which cloud-init runs once
    as root on the instance's first boot (cloud-init docs, "User data formats": user data script). The
    gpuforge images keep cloud-init and clear its state at the end of a bake (packer/scripts/sanitize.sh),
    so every canary node boots as a first boot. `shutdown -h +M` schedules the halt and returns."""
    return f"#!/bin/sh\nshutdown -h +{lifetime_minutes(request)} 'gpuforge canary: dead-man switch'\n"


def launch_parameters(request: Request, facts: InstanceType, run_id: str) -> dict[str, Any]:
    """RunInstances' parameters: exactly the type and count asked for, tagged with the run id."""
    tags = [{"Key": CANARY_TAG, "Value": run_id}, {"Key": "Name", "Value": f"gpuforge {run_id}"}]
    params: dict[str, Any] = {
        "ImageId": request.ami,
        "InstanceType": request.instance_type,
        "MinCount": request.count,
        "MaxCount": request.count,
        "IamInstanceProfile": {"Name": request.instance_profile},
        # IMDSv2 only, as every gpuforge image is (images.require_imdsv2).
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"},
        # A halt from inside terminates the node (RunInstances InstanceInitiatedShutdownBehavior,
        # https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_RunInstances.html): with the user data
        # below, a node gpuforge could not terminate (cancelled job, expired credentials) ends itself
        # instead of running a GPU type for days. boto3 base64-encodes UserData for RunInstances.
        "InstanceInitiatedShutdownBehavior": "terminate",
        "UserData": _dead_man_switch(request),
        "TagSpecifications": [
            {"ResourceType": kind, "Tags": tags} for kind in ("instance", "volume", "network-interface")
        ],
    }
    interfaces = _network_interfaces(request, facts)
    if interfaces:
        params["NetworkInterfaces"] = interfaces
    else:
        if request.subnet_id:
            params["SubnetId"] = request.subnet_id
        if request.security_group_ids:
            params["SecurityGroupIds"] = list(request.security_group_ids)
    if request.placement_group:
        params["Placement"] = {"GroupName": request.placement_group}
    if request.capacity_reservation_id:
        params["CapacityReservationSpecification"] = {
            "CapacityReservationTarget": {"CapacityReservationId": request.capacity_reservation_id}
        }
    if request.capacity_block:
        # A Capacity Block is launched into with its reservation id and this market type
        # (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/capacity-blocks-launch.html, AWS CLI).
        params["InstanceMarketOptions"] = {"MarketType": "capacity-block"}
    return params


def _aws_error(what: str, exc: Exception) -> ExternalError:
    return ExternalError(f"{what} failed: {exc}")


def launch(ec2: Any, params: dict[str, Any]) -> list[str]:
    try:
        reply = ec2.run_instances(**params)
    except ClientError as exc:
        code = exc.response["Error"]["Code"]
        if code in ("InsufficientInstanceCapacity", "InsufficientCapacity", "InvalidParameterValue"):
            raise UserError(f"EC2 RunInstances refused the canary's launch: {exc}") from exc
        raise _aws_error("EC2 RunInstances", exc) from exc
    except BotoCoreError as exc:
        raise _aws_error("EC2 RunInstances", exc) from exc
    return [str(i["InstanceId"]) for i in reply["Instances"]]


def terminate(ec2: Any, instance_ids: Sequence[str], timeout_s: int = 1800) -> None:
    """Terminate and wait until EC2 says terminated (a Capacity Block frees its slot only then)."""
    if not instance_ids:
        return
    try:
        ec2.terminate_instances(InstanceIds=list(instance_ids))
        delay = 15
        ec2.get_waiter("instance_terminated").wait(
            InstanceIds=list(instance_ids),
            WaiterConfig={"Delay": delay, "MaxAttempts": max(1, timeout_s // delay)},
        )
    except (ClientError, BotoCoreError, WaiterError) as exc:
        raise ExternalError(
            f"could not terminate canary instances {', '.join(instance_ids)}: {exc}; terminate them by hand "
            f"(tag {CANARY_TAG})"
        ) from exc
    LOG.info("terminated %s", ", ".join(instance_ids))


def wait_running(ec2: Any, instance_ids: Sequence[str], timeout_s: int) -> list[str]:
    """Wait for state running; return the instances' primary private IPs, in the order given."""
    delay = 15
    try:
        ec2.get_waiter("instance_running").wait(
            InstanceIds=list(instance_ids),
            WaiterConfig={"Delay": delay, "MaxAttempts": max(1, timeout_s // delay)},
        )
        pages = ec2.get_paginator("describe_instances").paginate(InstanceIds=list(instance_ids))
        found = {
            i["InstanceId"]: i.get("PrivateIpAddress", "")
            for page in pages
            for reservation in page["Reservations"]
            for i in reservation["Instances"]
        }
    except (ClientError, BotoCoreError, WaiterError) as exc:
        raise _aws_error("waiting for the canary instances to run", exc) from exc
    return [found.get(i, "") for i in instance_ids]


def wait_managed(
    ssm: Any,
    instance_ids: Sequence[str],
    timeout_s: int,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Wait until SSM reports every instance's agent Online (it needs the instance profile's SSM core
    permissions and a route to the SSM endpoints)."""
    deadline = clock() + timeout_s
    while True:
        try:
            reply = ssm.describe_instance_information(
                Filters=[{"Key": "InstanceIds", "Values": list(instance_ids)}]
            )
        except (ClientError, BotoCoreError) as exc:
            raise _aws_error("SSM DescribeInstanceInformation", exc) from exc
        online = {
            i["InstanceId"]
            for i in reply.get("InstanceInformationList", [])
            if i.get("PingStatus") == "Online"
        }
        missing = [i for i in instance_ids if i not in online]
        if not missing:
            return
        if clock() >= deadline:
            raise ExternalError(
                f"SSM does not manage {', '.join(missing)} after {timeout_s} s: the instance profile needs "
                "AmazonSSMManagedInstanceCore and the subnet a route to the SSM endpoints (NAT or VPC "
                "endpoints)"
            )
        sleep(15)


def node_bundle(root: Path | None = None) -> str:
    """The node-side files as base64 of a gzip'd tar, laid out as in a checkout."""
    base = root or paths.share_root()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in NODE_FILES:
            path = base / name
            if not path.is_file():
                raise UserError(
                    f"{path} is missing: the canary sends it to the nodes; run gpuforge from a checkout "
                    "(pip install -e .)"
                )
            info = tar.gettarinfo(str(path), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            with path.open("rb") as stream:
                tar.addfile(info, stream)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def node_commands(bundle: str, argv: Sequence[str]) -> list[str]:
    """AWS-RunShellScript's commands: unpack the bundle, run gpuforge-canary.sh with argv."""
    script = f"{_NODE_DIR}/scripts/canary/gpuforge-canary.sh"
    commands = [
        "set -eu",
        f"rm -rf {_NODE_DIR} && mkdir -p -m 0700 {_NODE_DIR}",
        f"echo {bundle} | base64 -d | tar -xz -C {_NODE_DIR}",
        f"bash {script} {shlex.join(argv)}",
    ]
    size = len(json.dumps({"commands": commands}))
    if size > MAX_COMMAND_BYTES:
        raise UserError(
            f"the canary's command is {size} bytes, over the {MAX_COMMAND_BYTES} it keeps under "
            "(scripts/gpu-smoke.sh or the canary script grew); ship them on the image instead"
        )
    return commands


def send(ssm: Any, request: Request, run_id: str, instance_ids: Sequence[str], commands: list[str]) -> str:
    try:
        reply = ssm.send_command(
            InstanceIds=list(instance_ids),
            DocumentName=DOCUMENT,
            Comment=f"gpuforge {run_id}"[:100],
            Parameters={"commands": commands, "executionTimeout": [str(request.command_timeout_s)]},
            OutputS3BucketName=request.results_bucket,
            OutputS3KeyPrefix=f"{request.results_prefix}/{run_id}",
            TimeoutSeconds=600,
        )
    except (ClientError, BotoCoreError) as exc:
        raise _aws_error("SSM SendCommand", exc) from exc
    return str(reply["Command"]["CommandId"])


def wait_command(
    ssm: Any,
    command_id: str,
    instance_ids: Sequence[str],
    timeout_s: int,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, str]:
    """Each instance's final status (Success, Failed, TimedOut, ...)."""
    deadline = clock() + timeout_s
    statuses: dict[str, str] = {}
    while True:
        for instance in instance_ids:
            if instance in statuses:
                continue
            try:
                reply = ssm.get_command_invocation(CommandId=command_id, InstanceId=instance)
            except ClientError as exc:
                # Right after SendCommand the invocation may not exist yet.
                if exc.response["Error"]["Code"] == "InvocationDoesNotExist":
                    continue
                raise _aws_error("SSM GetCommandInvocation", exc) from exc
            except BotoCoreError as exc:
                raise _aws_error("SSM GetCommandInvocation", exc) from exc
            if reply.get("Status") in _TERMINAL:
                statuses[instance] = str(reply["Status"])
        if len(statuses) == len(instance_ids):
            return statuses
        if clock() >= deadline:
            raise ExternalError(f"SSM command {command_id} did not finish within {timeout_s} s")
        sleep(10)


def node_output(s3: Any, request: Request, run_id: str, command_id: str, instance: str) -> dict[str, Any]:
    """The one JSON document gpuforge-canary.sh printed on `instance`."""
    key = _STDOUT_KEY.format(
        prefix=f"{request.results_prefix}/{run_id}", command=command_id, instance=instance
    )
    try:
        body = s3.get_object(Bucket=request.results_bucket, Key=key)["Body"].read().decode("utf-8", "replace")
    except (ClientError, BotoCoreError) as exc:
        raise _aws_error(f"reading s3://{request.results_bucket}/{key}", exc) from exc
    lines = [line for line in body.splitlines() if line.strip()]
    try:
        document = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        document = None
    if not isinstance(document, dict) or document.get("run_id") != run_id:
        raise ExternalError(f"s3://{request.results_bucket}/{key} holds no canary result of {run_id}")
    return document


def judge_check(instance: str, result: dict[str, Any]) -> list[str]:
    """Reasons the image failed on this node: any health check failed, or the smoke test failed."""
    reasons = []
    health = result.get("health") or {}
    report = health.get("report") or {}
    failed = [r.get("check", "?") for r in report.get("results", []) if r.get("status") == "fail"]
    if not report:
        reasons.append(f"{instance}: the health checks gave no report (exit {health.get('rc')})")
    elif failed or not report.get("healthy", False):
        reasons.append(f"{instance}: health checks failed: {', '.join(failed) or 'unhealthy'}")
    smoke = result.get("smoke") or {}
    smoke_report = smoke.get("report") or {}
    if smoke.get("rc") != 0:
        reasons.append(f"{instance}: GPU smoke test failed (exit {smoke.get('rc')})")
    elif smoke_report.get("status") != "ran":
        reasons.append(f"{instance}: GPU smoke test did not run on a GPU ({smoke_report.get('status')})")
    return reasons


def judge_allreduce(request: Request, result: dict[str, Any], out_dir: Path | None) -> list[str]:
    """Judge the 2-node all_reduce log with the code `gpuforge accept` judges its pairs with
    (gpuforge.nccl.judge); only PASS passes (SKIP: no baseline to compare with, reported and never
    passed)."""
    nccl = result.get("nccl") or {}
    log = str(nccl.get("log") or "")
    if not log.strip():
        return [
            f"nccl-tests all_reduce printed nothing (exit {nccl.get('rc')}): {nccl.get('stderr', '')[-300:]}"
        ]
    config = settings(request.instance_type, request.baseline_file, request.threshold, 2, "all_reduce")
    rc = nccl.get("rc")
    judgement = judge_log(log, config, "canary-all_reduce", rc if isinstance(rc, int) else None, "mpirun")
    if out_dir is not None and judgement.evaluations:
        nccl_report.write(judgement.evaluations, out_dir)
    return [] if judgement.verdict is Verdict.PASS else list(judgement.reasons)


def record(
    ami: str, outcome: Outcome, instance_type: str, region: str | None, now: datetime.datetime
) -> None:
    """The verdict on the image, where `gpuforge promote` reads it."""
    images.add_tags(
        ami,
        {
            CANARY_TAG: PASSED if outcome.passed else FAILED,
            CANARY_AT_TAG: now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            CANARY_TYPE_TAG: instance_type,
            CANARY_RUN_TAG: outcome.run_id,
        },
        region,
    )


def _save(out_dir: Path | None, name: str, document: dict[str, Any]) -> None:
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")


def _one_command(
    clients: dict[str, Any], request: Request, outcome: Outcome, ids: Sequence[str], argv: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Run gpuforge-canary.sh with argv on ids; each instance's JSON (ExternalError when one failed)."""
    commands = node_commands(node_bundle(), argv)
    command_id = send(clients["ssm"], request, outcome.run_id, ids, commands)
    statuses = wait_command(clients["ssm"], command_id, ids, request.command_timeout_s + 600)
    results = {}
    for instance in ids:
        if statuses[instance] != "Success":
            outcome.reasons.append(f"{instance}: {argv[0]} ended {statuses[instance]}")
        results[instance] = node_output(clients["s3"], request, outcome.run_id, command_id, instance)
    return results


def _exercise(clients: dict[str, Any], request: Request, outcome: Outcome, ips: list[str]) -> None:
    ids = outcome.instance_ids
    wait_managed(clients["ssm"], ids, request.boot_timeout_s)
    checks = _one_command(clients, request, outcome, ids, ["check", outcome.run_id, request.instance_type])
    for instance, result in checks.items():
        outcome.results[instance] = result
        outcome.reasons.extend(judge_check(instance, result))
    if request.count == 2 and not outcome.reasons:
        leader, peer = ids
        key = _one_command(clients, request, outcome, [leader], ["keygen", outcome.run_id])
        public_key = str(key[leader].get("public_key", ""))
        _one_command(clients, request, outcome, [peer], ["authorize", outcome.run_id, public_key])
        reduced = _one_command(clients, request, outcome, [leader], ["allreduce", outcome.run_id, *ips])
        outcome.results["allreduce"] = reduced[leader]
        outcome.reasons.extend(judge_allreduce(request, reduced[leader], request.out_dir))


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def run(request: Request, now: Callable[[], datetime.datetime] = _utcnow) -> Outcome:
    """One canary run; the instances are terminated whatever happens (errors, Ctrl-C included)."""
    image = images.describe(request.ami, request.region)
    facts = target_type(request, image)
    node_bundle()  # Refuse before launching anything when the node side cannot be sent.
    # Literal service names: tests/iamaudit.py finds each call's IAM action in this source.
    clients = {
        "ec2": aws.client("ec2", region_name=request.region),
        "ssm": aws.client("ssm", region_name=request.region),
        "s3": aws.client("s3", region_name=request.region),
    }
    outcome = Outcome(new_run_id(now()))
    LOG.info("canary %s: %d x %s from %s", outcome.run_id, request.count, request.instance_type, image.id)
    try:
        # Launch errors (capacity, permissions) say nothing about the image: they stop the run unrecorded.
        outcome.instance_ids = launch(clients["ec2"], launch_parameters(request, facts, outcome.run_id))
        try:
            ips = wait_running(clients["ec2"], outcome.instance_ids, request.boot_timeout_s)
            _exercise(clients, request, outcome, ips)
        except ExternalError as exc:
            # Launched but never reachable, or a node's command failed: a failed canary, recorded.
            outcome.reasons.append(str(exc))
    finally:
        terminate(clients["ec2"], outcome.instance_ids)
    summary = {
        "run_id": outcome.run_id,
        "image": image.id,
        "instance_type": request.instance_type,
        "instances": outcome.instance_ids,
        "passed": outcome.passed,
        "reasons": outcome.reasons,
        "results": outcome.results,
    }
    _save(request.out_dir, "canary.json", summary)
    record(image.id, outcome, request.instance_type, request.region, now())
    return outcome
