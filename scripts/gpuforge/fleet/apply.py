"""`gpuforge fleet`'s steps with typed values: the document's parameters, sending it, and its outcome."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from botocore.exceptions import EndpointConnectionError

from gpuforge.errors import UserError
from gpuforge.fleet import ssm

# What `fleet apply` shows of the command SSM accepted.
SHOWN = (
    "CommandId",
    "DocumentName",
    "DocumentVersion",
    "Targets",
    "MaxConcurrency",
    "MaxErrors",
    "OutputS3BucketName",
    "OutputS3KeyPrefix",
    "Status",
)


@contextmanager
def reachable() -> Iterator[None]:
    """SSM's endpoint out of reach is an ExternalError that says so (ssm.unreachable)."""
    try:
        yield
    except EndpointConnectionError as exc:
        raise ssm.unreachable(exc) from exc


def parameters(
    entry_point: str,
    node_type: str,
    drain_timeout_s: int,
    apply_timeout_s: int,
    reason: str,
    revision: str | None = None,
    sha256: str | None = None,
    revision_bucket: str | None = None,
    revision_prefix: str | None = None,
) -> dict[str, str]:
    """The shipped document's parameters (ssm/gpuforge-apply.yml) for one apply."""
    if not (bool(revision) == bool(sha256) == bool(revision_bucket)):
        raise UserError(
            "--revision, --sha256 and --revision-bucket go together (the node fetches the revision's "
            "archive from that bucket and checks it by its sha256)"
        )
    params = {
        "EntryPoint": entry_point,
        "DrainNode": "false" if node_type == "head" else "true",
        # The targets are ParallelCluster's tags, and its clustermgtd replaces drained idle nodes: hold the
        # node with a maintenance reservation instead (ssm/gpuforge-apply.yml HoldWith).
        "HoldWith": "reservation",
        "DrainTimeoutSeconds": str(drain_timeout_s),
        "Reason": reason,
        # The step may run for the drain wait plus the apply itself.
        "ExecutionTimeout": str(drain_timeout_s + apply_timeout_s),
    }
    if revision and sha256 and revision_bucket:
        params["Revision"] = revision
        params["Sha256"] = sha256
        params["RevisionBucket"] = revision_bucket
        if revision_prefix:
            params["RevisionPrefix"] = revision_prefix
    return params


def shown(command: dict[str, Any]) -> dict[str, Any]:
    return {k: command.get(k) for k in SHOWN}


def outcome_lines(outcome: ssm.Outcome) -> Iterator[str]:
    """Each node's status, then the command's."""
    for inv in sorted(outcome.invocations, key=lambda i: str(i.get("InstanceId"))):
        yield f"  {inv.get('InstanceId')}: {inv.get('Status')} {inv.get('StatusDetails', '')}".rstrip()
    counts = ", ".join(f"{k} {v}" for k, v in outcome.counts.items())
    yield f"command {outcome.status}: {counts}"
