"""`gpuforge fleet`: apply a change in place to a running cluster's nodes (Run Command), and its SSM document.

  gpuforge fleet ssm-document install [--document NAME]
  gpuforge fleet apply --via ssm --cluster-name NAME [--queue Q] [--max-concurrency 10%] [--max-errors 1]
                       [--output-s3-bucket B] [--document NAME] [--wait]

The SSH path for small fleets and the lab stays `ansible-playbook playbooks/rolling_update.yml`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from botocore.exceptions import EndpointConnectionError

from gpuforge import aws
from gpuforge.cliargs import nonempty, positive_int
from gpuforge.errors import UserError
from gpuforge.fleet import document, ssm

# EC2 tag values: up to 256 Unicode letters, digits, spaces and _ . : / = + - @ (EC2 "Tag restrictions").
_TAG_VALUE = re.compile(r"^[\w .:/=+\-@]{1,256}$")


def _tag_value(text: str) -> str:
    if not _TAG_VALUE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid EC2 tag value")
    return text


def _pattern(pattern: str, what: str) -> Any:
    def check(text: str) -> str:
        if not re.fullmatch(pattern, text):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return text

    return check


def _sha256(text: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a sha256 (64 lowercase hexadecimal digits)")
    return text


def _client(region: str | None) -> Any:
    return aws.client("ssm", region)


def _install(args: argparse.Namespace) -> int:
    doc = document.load()
    try:
        print(ssm.install(_client(args.region), doc, args.document))
    except EndpointConnectionError as exc:
        raise ssm.unreachable(exc) from exc
    return 0


def _parameters(args: argparse.Namespace) -> dict[str, str]:
    if not (bool(args.revision) == bool(args.sha256) == bool(args.revision_bucket)):
        raise UserError(
            "--revision, --sha256 and --revision-bucket go together (the node fetches the revision's "
            "archive from that bucket and checks it by its sha256)"
        )
    params = {
        "EntryPoint": args.entry_point,
        "DrainNode": "false" if args.node_type == "head" else "true",
        # The targets are ParallelCluster's tags, and its clustermgtd replaces drained idle nodes: hold the
        # node with a maintenance reservation instead (ssm/gpuforge-apply.yml HoldWith).
        "HoldWith": "reservation",
        "DrainTimeoutSeconds": str(args.drain_timeout),
        "Reason": args.reason,
        # The step may run for the drain wait plus the apply itself.
        "ExecutionTimeout": str(args.drain_timeout + args.apply_timeout),
    }
    if args.revision:
        params["Revision"] = args.revision
        params["Sha256"] = args.sha256
        params["RevisionBucket"] = args.revision_bucket
        if args.revision_prefix:
            params["RevisionPrefix"] = args.revision_prefix
    return params


def _report(outcome: ssm.Outcome) -> None:
    for inv in sorted(outcome.invocations, key=lambda i: str(i.get("InstanceId"))):
        print(f"  {inv.get('InstanceId')}: {inv.get('Status')} {inv.get('StatusDetails', '')}".rstrip())
    counts = ", ".join(f"{k} {v}" for k, v in outcome.counts.items())
    print(f"command {outcome.status}: {counts}")


def _apply(args: argparse.Namespace) -> int:
    doc = document.load()
    request = ssm.ApplyRequest(
        cluster=args.cluster_name,
        document=args.document,
        parameters=_parameters(args),
        max_concurrency=args.max_concurrency,
        max_errors=args.max_errors,
        queue=args.queue,
        node_type=args.node_type,
        output_bucket=args.output_s3_bucket,
        output_prefix=args.output_s3_key_prefix,
        cloudwatch_log_group=args.cloudwatch_log_group,
        delivery_timeout_s=args.delivery_timeout,
    )
    # Checked before any AWS call: bad input is refused offline.
    ssm.send_command_args(request, doc, "$DEFAULT")
    client = _client(args.region)
    try:
        version = ssm.installed_version(client, doc, args.document)
        command = ssm.send(client, ssm.send_command_args(request, doc, version))
        print(
            json.dumps(
                {
                    k: command.get(k)
                    for k in (
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
                },
                default=str,
            )
        )
        if not args.wait:
            return 0
        outcome = ssm.follow(client, command["CommandId"], poll_s=args.poll)
    except EndpointConnectionError as exc:
        raise ssm.unreachable(exc) from exc
    _report(outcome)
    return 0 if outcome.status == "Success" else 1


def register(subparsers: Any) -> None:
    fleet = subparsers.add_parser("fleet", help="apply a change in place to a running cluster's nodes")
    sub = fleet.add_subparsers(dest="fleet_command", required=True, metavar="ACTION")

    doc = sub.add_parser("ssm-document", help="the shipped SSM Command document")
    doc_sub = doc.add_subparsers(dest="ssm_document_command", required=True, metavar="ACTION")
    install = doc_sub.add_parser(
        "install", help=f"create or update the SSM document from {document.SHIPPED} (idempotent)"
    )
    install.add_argument("--document", type=nonempty, default=document.DEFAULT_NAME, help="its name in SSM")
    install.add_argument("--region", type=nonempty, help="AWS region (default: AWS_REGION, else us-east-1)")
    install.set_defaults(handler=_install)

    apply = sub.add_parser(
        "apply",
        help="drain, apply and resume a cluster's nodes through SSM Run Command (tag targets, rate controls)",
        description=(
            "Send the shipped SSM document to a ParallelCluster cluster's nodes: each drains itself in "
            "Slurm, waits for its jobs to end, runs the node-side entry point and resumes (or stays "
            "drained with the reason). Small fleets and the lab: ansible-playbook "
            "playbooks/rolling_update.yml."
        ),
    )
    apply.add_argument("--via", choices=["ssm"], required=True, help="the engine that moves the fleet")
    apply.add_argument(
        "--cluster-name", type=_tag_value, required=True, help="the parallelcluster:cluster-name tag"
    )
    apply.add_argument(
        "--queue", type=_tag_value, help="only this queue's nodes (parallelcluster:queue-name)"
    )
    apply.add_argument(
        "--node-type",
        choices=sorted(ssm.NODE_TYPES),
        default="compute",
        help="compute nodes (drained around the change; default) or the head node (no drain)",
    )
    apply.add_argument(
        "--max-concurrency",
        # Not a format string (ArgumentTypeError's text is printed as it is): one %.
        type=_pattern(ssm.MAX_CONCURRENCY_PATTERN, "a count or a percentage (1-100%)"),
        default="10%",
        help="nodes changed at once: a count or a percentage of the targets (default 10%%)",
    )
    apply.add_argument(
        "--max-errors",
        type=_pattern(ssm.MAX_ERRORS_PATTERN, "a count or a percentage (0-100%)"),
        default="1",
        help="failed nodes tolerated before no further node gets the command (default 1)",
    )
    apply.add_argument(
        "--output-s3-bucket", type=nonempty, help="keep each node's full output in this bucket"
    )
    apply.add_argument(
        "--output-s3-key-prefix",
        type=nonempty,
        help="key prefix there (default gpuforge/fleet-apply/CLUSTER)",
    )
    apply.add_argument(
        "--cloudwatch-log-group",
        type=nonempty,
        help="also send output to this CloudWatch Logs group (off by default)",
    )
    apply.add_argument(
        "--document", type=nonempty, default=document.DEFAULT_NAME, help="the SSM document's name"
    )
    apply.add_argument(
        "--entry-point",
        default=document.ENTRY_POINT,
        help=f"the node-side entry point (default {document.ENTRY_POINT})",
    )
    apply.add_argument(
        "--revision",
        type=_pattern(r"[0-9a-f]{40}", "an exact git commit (40 lowercase hexadecimal digits)"),
        help="a published revision to apply instead of the image's (needs --sha256, --revision-bucket)",
    )
    apply.add_argument("--sha256", type=_sha256, help="the sha256 of that revision's archive")
    apply.add_argument(
        "--revision-bucket", type=nonempty, help="the S3 bucket `gpuforge node-revision publish` wrote it to"
    )
    apply.add_argument(
        "--revision-prefix", type=nonempty, help="its key prefix there (default gpuforge/revisions/)"
    )
    apply.add_argument(
        "--drain-timeout",
        type=positive_int,
        default=3600,
        help="seconds a node waits for its jobs (default 3600)",
    )
    apply.add_argument(
        "--apply-timeout",
        type=positive_int,
        default=3600,
        help="seconds the entry point may run (default 3600)",
    )
    apply.add_argument(
        "--delivery-timeout",
        type=positive_int,
        default=ssm.DEFAULT_DELIVERY_TIMEOUT_S,
        help="seconds a node may wait for its turn before it is skipped (default two days)",
    )
    apply.add_argument("--reason", default="gpuforge fleet apply", help="the Slurm drain reason")
    apply.add_argument(
        "--wait", action="store_true", help="follow the command to its end; exit 1 unless Success"
    )
    apply.add_argument("--poll", type=positive_int, default=15, help="seconds between two looks with --wait")
    apply.add_argument("--region", type=nonempty, help="AWS region (default: AWS_REGION, else us-east-1)")
    apply.set_defaults(handler=_apply)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - gpuforge.cli is the entry point
    from gpuforge.cli import main as cli_main

    return cli_main(["fleet", *(argv or sys.argv[1:])])
