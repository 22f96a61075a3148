"""`gpuforge nccl-report`: judge all_reduce_perf logs against the expected busbw and plot them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gpuforge.errors import UserError
from gpuforge.nccl import report
from gpuforge.nccl.evaluate import LARGE_MESSAGE_BYTES, THRESHOLD, Verdict, evaluate, expected_peak
from gpuforge.nccl.parse import parse


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "nccl-report",
        help="parse nccl-tests all_reduce_perf logs, compare busbw with the expected peak, plot",
        description=__doc__,
    )
    parser.add_argument("logs", nargs="+", type=Path, metavar="LOG", help="all_reduce_perf output (job log)")
    parser.add_argument("--instance-type", required=True, help="EC2 type the runs used, e.g. p5.48xlarge")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="folder for report and plots")
    parser.add_argument(
        "--threshold", type=float, default=THRESHOLD, help=f"fraction of peak to pass (default {THRESHOLD})"
    )
    parser.add_argument(
        "--large-bytes",
        type=int,
        default=LARGE_MESSAGE_BYTES,
        help=f"smallest message size judged, bytes (default {LARGE_MESSAGE_BYTES})",
    )
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    peak = expected_peak(args.instance_type)
    if args.large_bytes <= 0:
        raise UserError("--large-bytes must be positive")
    evaluations = []
    for log in args.logs:
        try:
            text = log.read_text(errors="replace")
        except OSError as exc:
            raise UserError(f"cannot read {log}: {exc.strerror}") from exc
        for run in parse(text, source=log.name):
            evaluations.append(evaluate(run, args.instance_type, peak, args.threshold, args.large_bytes))
    entries = report.write(evaluations, args.out)
    for entry in entries:
        print(f"{entry['verdict']:<4}  {entry['source']}: {'; '.join(entry['reasons'])}")
    print(f"report: {args.out / 'report.md'}")
    return 1 if any(ev.verdict is Verdict.FAIL for ev in evaluations) else 0
