"""`gpuforge preflight`: check that a cluster's AWS setup is ready for EFA/NCCL jobs."""

from __future__ import annotations

import argparse

from gpuforge import aws
from gpuforge.commands.base import Command
from gpuforge.preflight import runner
from gpuforge.preflight.result import any_failed, render_table


class Preflight(Command):
    name = "preflight"
    help = "check placement group, AZ, EFA interfaces, security group and quotas of a cluster"
    description = __doc__

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--cluster-name", required=True, help="ParallelCluster cluster name (its EC2 tag)"
        )
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

    def execute(self, args: argparse.Namespace) -> int:
        runner.check_request(args.cluster_name, args.region, args.spare_nodes)
        region = args.region or aws.region()
        results = runner.run_in(region, args.cluster_name, args.placement_group, args.spare_nodes, args.queue)
        print(f"preflight for cluster {args.cluster_name} in {region}")
        print(render_table(results))
        return 1 if any_failed(results) else 0


COMMANDS = (Preflight,)
