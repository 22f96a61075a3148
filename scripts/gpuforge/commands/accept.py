"""`gpuforge accept`: the field guide's acceptance test of a Slurm partition or node list."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpuforge.accept import acceptance, report
from gpuforge.cliargs import existing_file, positive_int
from gpuforge.commands.base import Command
from gpuforge.nccl.evaluate import THRESHOLD


class Progress:
    """The progress line while the stages run: rewritten in place on a terminal, else one line a change."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = ""

    def __call__(self, line: str) -> None:
        if line == self.last:
            return
        self.last = line
        if self.tty:
            sys.stderr.write(f"\r\033[K{line}")
        else:
            sys.stderr.write(f"{line}\n")
        sys.stderr.flush()

    def end(self) -> None:
        if self.tty and self.last:
            sys.stderr.write("\n")


class Accept(Command):
    name = "accept"
    help = "acceptance test of a Slurm cluster: nodes alone, pairs over EFA, doubling; drains bad nodes"
    description = (
        "Run on the head node. Stage 1: every node alone at once (gpuforge-health with dcgmi "
        "diag, each EFA device's fi_pingpong loopback, an all_reduce over the node's own GPUs). Stage 2: "
        "disjoint pairs over EFA; each node of a pair that falls short is re-paired with a node that passed. "
        f"Stage 3: all_reduce on 2, 4, 8 ... N nodes against {THRESHOLD:.0%} of the baseline for each "
        "node count. Nodes that fail are drained with the stage and the figure, unless --report-only. "
        "Exit status 0: accepted; 1: not accepted; 3: everything passed but some pair or doubling result "
        "had no baseline to be judged against (see --accept-unjudged)."
    )

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--partition", help="the Slurm partition (ParallelCluster queue) to accept")
        parser.add_argument(
            "--nodes", metavar="LIST", help="Slurm node list to accept, e.g. gpu-st-p5-[1-64]"
        )
        parser.add_argument("--instance-type", required=True, help="the nodes' EC2 type, e.g. p5.48xlarge")
        parser.add_argument(
            "--dcgm-level",
            type=int,
            choices=sorted(acceptance.DCGM_S),
            default=acceptance.DCGM_LEVEL,
            help=f"dcgmi diag level of the node stage (default {acceptance.DCGM_LEVEL}, about two minutes; 3 "
            f"takes ~15)",
        )
        parser.add_argument(
            "--baseline",
            type=existing_file,
            metavar="FILE",
            help="baseline file from `gpuforge nccl-baseline` instead of data/nccl_baselines.yml",
        )
        parser.add_argument(
            "--threshold",
            type=float,
            default=THRESHOLD,
            help=f"fraction of the baseline (default {THRESHOLD})",
        )
        parser.add_argument(
            "--report-only", action="store_true", help="report what would be drained; drain nothing"
        )
        parser.add_argument(
            "--accept-unjudged",
            action="store_true",
            help="accept pair and doubling results that had no baseline for their node count (default: not "
            "accepted, exit 3)",
        )
        parser.add_argument(
            "--out", type=Path, metavar="DIR", help="report folder (default ./gpuforge-accept-<time>)"
        )
        parser.add_argument(
            "--all-reduce",
            default="/opt/nccl-tests/build/all_reduce_perf",
            help="all_reduce_perf on the nodes",
        )
        parser.add_argument(
            "--health", default="/usr/local/sbin/gpuforge-health", help="gpuforge-health on the nodes"
        )
        parser.add_argument(
            "--efa-bin", default="/opt/amazon/efa/bin", help="the EFA installer's fi_info and fi_pingpong"
        )
        parser.add_argument(
            "--max-bytes", default="8G", help="largest all_reduce message (default 8G, the baselines' size)"
        )
        parser.add_argument(
            "--iters", type=positive_int, default=20, help="timed iterations per message size (default 20)"
        )
        parser.add_argument(
            "--time-limit",
            type=positive_int,
            default=60,
            metavar="MIN",
            help="limit of each stage's job (default 60)",
        )

    def execute(self, args: argparse.Namespace) -> int:
        request = acceptance.Request(
            instance_type=args.instance_type,
            partition=args.partition,
            nodes=args.nodes,
            dcgm_level=args.dcgm_level,
            baseline_file=args.baseline,
            threshold=args.threshold,
            report_only=args.report_only,
            accept_unjudged=args.accept_unjudged,
            out=args.out,
            all_reduce=args.all_reduce,
            health=args.health,
            efa_bin=args.efa_bin,
            max_bytes=args.max_bytes,
            iters=args.iters,
            time_limit_min=args.time_limit,
        )
        prepared = acceptance.prepare(request)
        print(
            f"gpuforge accept: {len(prepared.testable)} nodes ({len(prepared.not_tested)} not testable now); "
            f"{prepared.estimate.describe()}"
        )
        for warning in acceptance.warn_baselines(prepared.nccl, len(prepared.testable)):
            print(warning, file=sys.stderr)
        progress = Progress()
        try:
            outcome = acceptance.run(prepared, progress)
        finally:
            progress.end()
        for line in report.summary(
            outcome.acceptance,
            request.instance_type,
            outcome.drained,
            request.report_only,
            prepared.out,
            outcome.drain_errors,
        ):
            print(line)
        return outcome.exit_code


COMMANDS = (Accept,)
