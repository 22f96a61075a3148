"""`gpuforge nccl-report` and `gpuforge nccl-baseline`: judge nccl-tests logs, record baselines."""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from typing import Any

from gpuforge.cliargs import existing_file
from gpuforge.errors import UserError
from gpuforge.nccl import baseline, report
from gpuforge.nccl.collective import identify
from gpuforge.nccl.evaluate import (
    LARGE_MESSAGE_BYTES,
    THRESHOLD,
    Settings,
    Verdict,
    evaluate,
    node_count,
    settings,
)
from gpuforge.nccl.parse import COLLECTIVES, Run, parse


def _common(parser: argparse.ArgumentParser) -> None:
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


def register(subparsers: Any) -> None:
    rep = subparsers.add_parser(
        "nccl-report",
        help="judge nccl-tests logs (data check, transport, busbw vs baseline) and plot them",
        description="Judge nccl-tests logs: #wrong, completeness, the network NCCL used, and "
        f"busbw against {THRESHOLD:.0%} of the baseline for the type, collective and node count.",
    )
    _common(rep)
    rep.add_argument("--out", required=True, type=Path, metavar="DIR", help="folder for report and plots")
    rep.add_argument(
        "--baseline",
        type=existing_file,
        metavar="FILE",
        help="baseline file (from `gpuforge nccl-baseline`) instead of data/nccl_baselines.yml",
    )
    rep.add_argument(
        "--threshold",
        type=float,
        default=THRESHOLD,
        help=f"fraction of the baseline to pass (default {THRESHOLD})",
    )
    rep.set_defaults(handler=handle)
    rec = subparsers.add_parser(
        "nccl-baseline",
        help="record the busbw of a known-good cluster's nccl-tests run as a baseline file",
        description="Record each run's busbw at its largest message size into FILE, keyed by "
        "instance type, collective and node count; refuses runs with any defect.",
    )
    _common(rec)
    rec.add_argument(
        "--out", required=True, type=Path, metavar="FILE", help="baseline file to create or update"
    )
    rec.set_defaults(handler=handle_baseline)


def _runs(logs: list[Path]) -> list[Run]:
    runs = []
    for log in logs:
        try:
            text = log.read_text(errors="replace")
        except OSError as exc:
            raise UserError(f"cannot read {log}: {exc.strerror}") from exc
        runs.extend(parse(text, source=log.name))
    return runs


def handle(args: argparse.Namespace) -> int:
    config = settings(args.instance_type, args.baseline, args.threshold, args.nodes, args.collective)
    evaluations = [evaluate(run, config) for run in _runs(args.logs)]
    entries = report.write(evaluations, args.out)
    for entry in entries:
        print(f"{entry['verdict']:<4}  {entry['source']}: {'; '.join(entry['reasons'])}")
    print(f"report: {args.out / 'report.md'}")
    return 1 if any(ev.verdict is Verdict.FAIL for ev in evaluations) else 0


def handle_baseline(args: argparse.Namespace) -> int:
    # Judge each run against an empty table: every defect still fails, nothing passes by bandwidth.
    config = settings(args.instance_type, None, THRESHOLD, args.nodes, args.collective)
    empty = Settings(config.instance_type, args.out, {}, config.threshold, config.nodes, config.collective)
    for run in _runs(args.logs):
        ev = evaluate(run, empty)
        if ev.failures:
            raise UserError(f"{run.source} is not a known-good run: {'; '.join(ev.failures)}")
        nodes, _ = node_count(run, args.nodes)
        identity = identify(run, args.collective)
        if nodes is None or identity.name is None:
            missing = "--nodes" if nodes is None else "--collective"
            raise UserError(f"{run.source}: the log does not say its {missing[2:]}; pass {missing}")
        largest = max(run.rows, key=lambda r: r.size_bytes)
        if largest.size_bytes < LARGE_MESSAGE_BYTES:
            raise UserError(
                f"{run.source} stops at {largest.size_bytes} B; a baseline needs the busbw plateau: "
                f"run up to at least -e 1G (8G on p5)"
            )
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
        entry = baseline.Entry(
            nodes=nodes,
            busbw_gb_s=largest.busbw_gb_s,
            size_bytes=largest.size_bytes,
            source=f"recorded {stamp} from {run.source} (NCCL {run.nccl_version or '?'}; "
            f"network: {run.network.describe()})",
        )
        baseline.record(args.out, args.instance_type, identity.name, entry)
        print(
            f"recorded {args.instance_type} {identity.name} {nodes} nodes: "
            f"{entry.busbw_gb_s:g} GB/s at {entry.size_bytes} B -> {args.out}"
        )
    return 0
