"""`gpuforge preflight`: check that a cluster's AWS setup is ready for EFA/NCCL jobs."""

from __future__ import annotations

import argparse
import re
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpuforge import aws
from gpuforge.errors import ExternalError, UserError
from gpuforge.preflight import runner
from gpuforge.preflight.result import any_failed, render_table

_REGION_RE = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+$")
# ParallelCluster cluster names: a letter, then letters, digits and hyphens, at most 60 characters.
_CLUSTER_RE = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,59}$")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "preflight",
        help="check placement group, AZ, EFA interfaces, security group and quotas of a cluster",
        description=__doc__,
    )
    parser.add_argument("--cluster-name", required=True, help="ParallelCluster cluster name (its EC2 tag)")
    parser.add_argument("--region", help="AWS Region (default: AWS_REGION, else us-east-1)")
    parser.add_argument(
        "--placement-group", help="placement group to check (default: the one the compute nodes are in)"
    )
    parser.add_argument("--queue", help="check only the compute nodes of this Slurm queue")
    parser.add_argument(
        "--spare-nodes",
        type=int,
        default=1,
        help="vCPU quota headroom to require, in nodes of the cluster's largest type (default 1)",
    )
    parser.set_defaults(handler=handle)


def validate(args: argparse.Namespace) -> None:
    if not _CLUSTER_RE.match(args.cluster_name):
        raise UserError(
            f"--cluster-name {args.cluster_name!r} is not a ParallelCluster name "
            "(a letter, then letters, digits or hyphens, 60 characters at most)"
        )
    if args.region is not None and not _REGION_RE.match(args.region):
        raise UserError(f"--region {args.region!r} is not an AWS Region name such as us-east-1")
    if args.spare_nodes < 0:
        raise UserError("--spare-nodes must be 0 or more")


def handle(args: argparse.Namespace) -> int:
    validate(args)
    region = args.region or aws.region()
    try:
        results = runner.run(
            aws.client("ec2", region),
            aws.client("service-quotas", region),
            args.cluster_name,
            placement_group=args.placement_group,
            spare_nodes=args.spare_nodes,
            queue=args.queue,
        )
    except (BotoCoreError, ClientError) as exc:
        raise ExternalError(f"AWS call failed during preflight in {region}: {exc}") from exc
    print(f"preflight for cluster {args.cluster_name} in {region}")
    print(render_table(results))
    return 1 if any_failed(results) else 0
