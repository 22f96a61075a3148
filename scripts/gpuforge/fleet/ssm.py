"""Run Command for `gpuforge fleet`: install the shipped document, send it to a cluster's nodes, follow it.

Facts used here (botocore's SSM service model, as installed with the pinned boto3, and AWS's Run Command
guide "Run commands at scale", https://docs.aws.amazon.com/systems-manager/latest/userguide/send-commands-multiple.html):
- Targets: up to 5 Key/Values pairs, all of which an instance must match; `tag:<key>` matches an EC2 tag.
- MaxConcurrency: a count or a percentage of the targets (pattern below); Run Command starts with one
  node, then two more, growing until the limit. MaxErrors: a count or a percentage; once more invocations
  have failed than it allows, the command is sent to no further targets (those running finish).
- TimeoutSeconds is the delivery timeout: a node whose invocation has not started by then never runs it.
  A rolling change waits for jobs node after node, so it is long here.
- ErrorCount counts targets whose status is Failed or (execution) TimedOut.
ParallelCluster tags every instance with parallelcluster:cluster-name, parallelcluster:node-type
(HeadNode or Compute) and, on compute nodes, parallelcluster:queue-name (inventory/aws_ec2.yml groups by
the same tags).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml
from botocore.exceptions import ClientError, EndpointConnectionError

from gpuforge.errors import ExternalError, UserError
from gpuforge.fleet.document import Document, check_parameters

CLUSTER_TAG = "tag:parallelcluster:cluster-name"
QUEUE_TAG = "tag:parallelcluster:queue-name"
NODE_TYPE_TAG = "tag:parallelcluster:node-type"
NODE_TYPES = {"compute": "Compute", "head": "HeadNode"}

# botocore data ssm/2014-11-06/service-2.json, SendCommandRequest MaxConcurrency and MaxErrors.
MAX_CONCURRENCY_PATTERN = r"^([1-9][0-9]*|[1-9][0-9]%|[1-9]%|100%)$"
MAX_ERRORS_PATTERN = r"^([1-9][0-9]*|[0]|[1-9][0-9]%|[0-9]%|100%)$"
# The same model: TimeoutSeconds 30 to 2592000; Comment at most 100 characters.
DELIVERY_TIMEOUT_MAX_S = 2_592_000
# A node's invocation may wait behind the others' drains: two days before an undelivered node gives up.
DEFAULT_DELIVERY_TIMEOUT_S = 172_800
TERMINAL = frozenset({"Success", "Cancelled", "Failed", "TimedOut"})


@dataclass(frozen=True)
class ApplyRequest:
    """What `gpuforge fleet apply --via ssm` sends."""

    cluster: str
    document: str
    parameters: dict[str, str]
    max_concurrency: str = "10%"
    max_errors: str = "1"
    queue: str | None = None
    node_type: str = "compute"
    output_bucket: str | None = None
    output_prefix: str | None = None
    cloudwatch_log_group: str | None = None
    delivery_timeout_s: int = DEFAULT_DELIVERY_TIMEOUT_S


def targets(cluster: str, node_type: str, queue: str | None) -> list[dict[str, Any]]:
    """The instances of one cluster, of one node type, of one queue when given (all must match)."""
    chosen = [
        {"Key": CLUSTER_TAG, "Values": [cluster]},
        {"Key": NODE_TYPE_TAG, "Values": [NODE_TYPES[node_type]]},
    ]
    if queue:
        chosen.append({"Key": QUEUE_TAG, "Values": [queue]})
    return chosen


def send_command_args(request: ApplyRequest, doc: Document, version: str) -> dict[str, Any]:
    """SendCommand's arguments; the parameters checked against the shipped document's rules first."""
    if request.node_type == "head" and request.queue:
        raise UserError("--queue selects compute nodes; the head node belongs to no queue")
    for value, pattern, option in (
        (request.max_concurrency, MAX_CONCURRENCY_PATTERN, "--max-concurrency"),
        (request.max_errors, MAX_ERRORS_PATTERN, "--max-errors"),
    ):
        if not re.fullmatch(pattern, value):
            raise UserError(f"{option} {value!r} is neither a count nor a percentage (1-100%)")
    if not 30 <= request.delivery_timeout_s <= DELIVERY_TIMEOUT_MAX_S:
        raise UserError(f"--delivery-timeout must be 30 to {DELIVERY_TIMEOUT_MAX_S} seconds")
    values = check_parameters(doc, request.parameters)
    args: dict[str, Any] = {
        "DocumentName": request.document,
        "DocumentVersion": version,
        "Targets": targets(request.cluster, request.node_type, request.queue),
        "Parameters": {name: [value] for name, value in values.items()},
        "MaxConcurrency": request.max_concurrency,
        "MaxErrors": request.max_errors,
        "TimeoutSeconds": request.delivery_timeout_s,
        "Comment": f"gpuforge fleet apply {request.cluster}"[:100],
        # Output goes where it is asked to go and nowhere else: CloudWatch Logs only on request.
        "CloudWatchOutputConfig": (
            {"CloudWatchOutputEnabled": True, "CloudWatchLogGroupName": request.cloudwatch_log_group}
            if request.cloudwatch_log_group
            else {"CloudWatchOutputEnabled": False}
        ),
    }
    if request.output_bucket:
        args["OutputS3BucketName"] = request.output_bucket
        args["OutputS3KeyPrefix"] = request.output_prefix or f"gpuforge/fleet-apply/{request.cluster}"
    elif request.output_prefix:
        raise UserError("--output-s3-key-prefix needs --output-s3-bucket")
    return args


def _same(doc: Document, stored: str) -> bool:
    """Whether a stored document says what the shipped one says (SSM may store YAML re-serialized)."""
    try:
        return bool(yaml.safe_load(stored) == doc.content)
    except yaml.YAMLError:
        return False


def _stored(client: Any, name: str) -> dict[str, Any] | None:
    """GetDocument's answer for the default version, or None when there is no such document."""
    try:
        answer: dict[str, Any] = client.get_document(Name=name, DocumentFormat="YAML")
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "InvalidDocument":
            return None
        raise
    return answer


def install(client: Any, doc: Document, name: str) -> str:
    """Create the document, or give it a new default version when the shipped content changed.

    Returns what was done, for the user."""
    stored = _stored(client, name)
    if stored is None:
        created = client.create_document(
            Content=doc.text,
            Name=name,
            DocumentType="Command",
            DocumentFormat="YAML",
            TargetType="/AWS::EC2::Instance",
        )
        return f"created {name} version {created['DocumentDescription']['DocumentVersion']}"
    if _same(doc, stored["Content"]):
        return f"{name} version {stored['DocumentVersion']} already has {doc.path.name}'s content"
    updated = client.update_document(
        Content=doc.text, Name=name, DocumentVersion="$LATEST", DocumentFormat="YAML"
    )
    version = updated["DocumentDescription"]["DocumentVersion"]
    client.update_document_default_version(Name=name, DocumentVersion=version)
    return f"updated {name} to version {version} (now its default)"


def installed_version(client: Any, doc: Document, name: str) -> str:
    """The default version of `name` when it has the shipped content; UserError otherwise."""
    stored = _stored(client, name)
    if stored is None:
        raise UserError(f"SSM has no document {name}; run `gpuforge fleet ssm-document install` first")
    if not _same(doc, stored["Content"]):
        raise UserError(
            f"SSM document {name} (default version {stored['DocumentVersion']}) differs from this gpuforge's "
            f"{doc.path.name}; run `gpuforge fleet ssm-document install` to update it"
        )
    return str(stored["DocumentVersion"])


def send(client: Any, args: dict[str, Any]) -> dict[str, Any]:
    command: dict[str, Any] = client.send_command(**args)["Command"]
    return command


@dataclass
class Outcome:
    status: str
    invocations: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


def follow(
    client: Any,
    command_id: str,
    *,
    poll_s: float = 15.0,
    timeout_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Outcome:
    """Poll ListCommands until the command ends; its status, counts and per-node invocations."""
    start = clock()
    while True:
        (command,) = client.list_commands(CommandId=command_id)["Commands"]
        if command["Status"] in TERMINAL:
            break
        if timeout_s is not None and clock() - start > timeout_s:
            raise ExternalError(f"command {command_id} still {command['Status']} after {timeout_s:.0f} s")
        sleep(poll_s)
    invocations: list[dict[str, Any]] = []
    for page in client.get_paginator("list_command_invocations").paginate(CommandId=command_id):
        invocations.extend(page["CommandInvocations"])
    counts = {
        key: int(command.get(key, 0))
        for key in ("TargetCount", "CompletedCount", "ErrorCount", "DeliveryTimedOutCount")
    }
    return Outcome(str(command["Status"]), invocations, counts)


def unreachable(exc: EndpointConnectionError) -> ExternalError:
    return ExternalError(
        f"cannot reach Systems Manager ({exc}); check AWS_REGION, AWS_ENDPOINT_URL and the network"
    )
