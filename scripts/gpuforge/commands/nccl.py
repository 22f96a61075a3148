"""`gpuforge nccl-report` and `gpuforge nccl-baseline`: judge nccl-tests logs, record baselines."""

from __future__ import annotations

import argparse
from pathlib import Path

from gpuforge.cliargs import existing_file
from gpuforge.commands.base import Command
from gpuforge.nccl import logs
from gpuforge.nccl.evaluate import THRESHOLD, settings
from gpuforge.nccl.parse import COLLECTIVES


def _add_logs(parser: argparse.ArgumentParser) -> None:
    """The logs and what they may not say themselves, for both commands."""
    parser.add_argument(
        "logs", nargs="+", type=existing_file, metavar="LOG", help="nccl-tests output (job log)"
    )
    parser.add_argument("--instance-type", required=True, help="EC2 type the runs used, e.g. p5.48xlarge")
    parser.add_argument(
        "--nodes", type=int, help="node count, when the log does not list its '# Rank' devices"
    )
    parser.add_argument(
        "--collective",
        choices=sorted(COLLECTIVES),
        help="collective, when the log names it neither in a banner nor in the command line",
    )


class NcclReport(Command):
    name = "nccl-report"
    help = "judge nccl-tests logs (data check, transport, busbw vs baseline) and plot them"
    description = (
        "Judge nccl-tests logs: #wrong, completeness, the network NCCL used, and "
        f"busbw against {THRESHOLD:.0%} of the baseline for the type, collective and node count."
    )

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        _add_logs(parser)
        parser.add_argument(
            "--out", required=True, type=Path, metavar="DIR", help="folder for report and plots"
        )
        parser.add_argument(
            "--baseline",
            type=existing_file,
            metavar="FILE",
            help="baseline file (from `gpuforge nccl-baseline`) instead of data/nccl_baselines.yml",
        )
        parser.add_argument(
            "--threshold",
            type=float,
            default=THRESHOLD,
            help=f"fraction of the baseline to pass (default {THRESHOLD})",
        )

    def execute(self, args: argparse.Namespace) -> int:
        config = settings(args.instance_type, args.baseline, args.threshold, args.nodes, args.collective)
        judged = logs.judge(args.logs, config, args.out)
        for entry in judged.entries:
            print(f"{entry['verdict']:<4}  {entry['source']}: {'; '.join(entry['reasons'])}")
        print(f"report: {args.out / 'report.md'}")
        return 1 if judged.failed else 0


class NcclBaseline(Command):
    name = "nccl-baseline"
    help = "record the busbw of a known-good cluster's nccl-tests run as a baseline file"
    description = (
        "Record each run's busbw at its largest message size into FILE, keyed by "
        "instance type, collective and node count; refuses runs with any defect."
    )

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        _add_logs(parser)
        parser.add_argument(
            "--out", required=True, type=Path, metavar="FILE", help="baseline file to create or update"
        )

    def execute(self, args: argparse.Namespace) -> int:
        for done in logs.record(args.logs, args.instance_type, args.out, args.nodes, args.collective):
            print(
                f"recorded {args.instance_type} {done.collective} {done.nodes} nodes: "
                f"{done.entry.busbw_gb_s:g} GB/s at {done.entry.size_bytes} B -> {args.out}"
            )
        return 0


COMMANDS = (NcclReport, NcclBaseline)
