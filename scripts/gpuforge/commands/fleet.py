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
from typing import Any

from gpuforge import aws
from gpuforge.cliargs import nonempty, positive_int
from gpuforge.commands.base import Command, Group
from gpuforge.fleet import apply, document, ssm

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


class Install(Command):
    name = "install"
    help = f"create or update the SSM document from {document.SHIPPED} (idempotent)"

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--document", type=nonempty, default=document.DEFAULT_NAME, help="its name in SSM"
        )
        parser.add_argument(
            "--region", type=nonempty, help="AWS region (default: AWS_REGION, else us-east-1)"
        )

    def execute(self, args: argparse.Namespace) -> int:
        doc = document.load()
        with apply.reachable():
            print(ssm.install(_client(args.region), doc, args.document))
        return 0


class SsmDocument(Group):
    name = "ssm-document"
    help = "the shipped SSM Command document"
    dest = "ssm_document_command"
    commands = (Install,)


class Apply(Command):
    name = "apply"
    help = "drain, apply and resume a cluster's nodes through SSM Run Command (tag targets, rate controls)"
    description = (
        "Send the shipped SSM document to a ParallelCluster cluster's nodes: each drains itself in "
        "Slurm, waits for its jobs to end, runs the node-side entry point and resumes (or stays "
        "drained with the reason). Small fleets and the lab: ansible-playbook "
        "playbooks/rolling_update.yml."
    )

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--via", choices=["ssm"], required=True, help="the engine that moves the fleet")
        parser.add_argument(
            "--cluster-name", type=_tag_value, required=True, help="the parallelcluster:cluster-name tag"
        )
        parser.add_argument(
            "--queue", type=_tag_value, help="only this queue's nodes (parallelcluster:queue-name)"
        )
        parser.add_argument(
            "--node-type",
            choices=sorted(ssm.NODE_TYPES),
            default="compute",
            help="compute nodes (drained around the change; default) or the head node (no drain)",
        )
        parser.add_argument(
            "--max-concurrency",
            # Not a format string (ArgumentTypeError's text is printed as it is): one %.
            type=_pattern(ssm.MAX_CONCURRENCY_PATTERN, "a count or a percentage (1-100%)"),
            default="10%",
            help="nodes changed at once: a count or a percentage of the targets (default 10%%)",
        )
        parser.add_argument(
            "--max-errors",
            type=_pattern(ssm.MAX_ERRORS_PATTERN, "a count or a percentage (0-100%)"),
            default="1",
            help="failed nodes tolerated before no further node gets the command (default 1)",
        )
        parser.add_argument(
            "--output-s3-bucket", type=nonempty, help="keep each node's full output in this bucket"
        )
        parser.add_argument(
            "--output-s3-key-prefix",
            type=nonempty,
            help="key prefix there (default gpuforge/fleet-apply/CLUSTER)",
        )
        parser.add_argument(
            "--cloudwatch-log-group",
            type=nonempty,
            help="also send output to this CloudWatch Logs group (off by default)",
        )
        parser.add_argument(
            "--document", type=nonempty, default=document.DEFAULT_NAME, help="the SSM document's name"
        )
        parser.add_argument(
            "--entry-point",
            default=document.ENTRY_POINT,
            help=f"the node-side entry point (default {document.ENTRY_POINT})",
        )
        parser.add_argument(
            "--revision",
            type=_pattern(r"[0-9a-f]{40}", "an exact git commit (40 lowercase hexadecimal digits)"),
            help="a published revision to apply instead of the image's (needs --sha256, --revision-bucket)",
        )
        parser.add_argument("--sha256", type=_sha256, help="the sha256 of that revision's archive")
        parser.add_argument(
            "--revision-bucket",
            type=nonempty,
            help="the S3 bucket `gpuforge node-revision publish` wrote it to",
        )
        parser.add_argument(
            "--revision-prefix", type=nonempty, help="its key prefix there (default gpuforge/revisions/)"
        )
        parser.add_argument(
            "--drain-timeout",
            type=positive_int,
            default=3600,
            help="seconds a node waits for its jobs (default 3600)",
        )
        parser.add_argument(
            "--apply-timeout",
            type=positive_int,
            default=3600,
            help="seconds the entry point may run (default 3600)",
        )
        parser.add_argument(
            "--delivery-timeout",
            type=positive_int,
            default=ssm.DEFAULT_DELIVERY_TIMEOUT_S,
            help="seconds a node may wait for its turn before it is skipped (default two days)",
        )
        parser.add_argument("--reason", default="gpuforge fleet apply", help="the Slurm drain reason")
        parser.add_argument(
            "--wait", action="store_true", help="follow the command to its end; exit 1 unless Success"
        )
        parser.add_argument(
            "--poll", type=positive_int, default=15, help="seconds between two looks with --wait"
        )
        parser.add_argument(
            "--region", type=nonempty, help="AWS region (default: AWS_REGION, else us-east-1)"
        )

    def execute(self, args: argparse.Namespace) -> int:
        doc = document.load()
        request = ssm.ApplyRequest(
            cluster=args.cluster_name,
            document=args.document,
            parameters=apply.parameters(
                args.entry_point,
                args.node_type,
                args.drain_timeout,
                args.apply_timeout,
                args.reason,
                args.revision,
                args.sha256,
                args.revision_bucket,
                args.revision_prefix,
            ),
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
        with apply.reachable():
            version = ssm.installed_version(client, doc, args.document)
            command = ssm.send(client, ssm.send_command_args(request, doc, version))
            print(json.dumps(apply.shown(command), default=str))
            if not args.wait:
                return 0
            outcome = ssm.follow(client, command["CommandId"], poll_s=args.poll)
        print(*apply.outcome_lines(outcome), sep="\n")
        return 0 if outcome.status == "Success" else 1


class Fleet(Group):
    name = "fleet"
    help = "apply a change in place to a running cluster's nodes"
    dest = "fleet_command"
    commands = (SsmDocument, Apply)


COMMANDS = (Fleet,)
