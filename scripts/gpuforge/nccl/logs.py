"""nccl-tests job logs read from files: judged into a report, or recorded as a baseline."""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuforge.errors import UserError
from gpuforge.nccl import baseline, report
from gpuforge.nccl.collective import identify
from gpuforge.nccl.evaluate import (
    LARGE_MESSAGE_BYTES,
    THRESHOLD,
    Evaluation,
    Settings,
    Verdict,
    evaluate,
    node_count,
    settings,
)
from gpuforge.nccl.parse import Run, parse


def read_runs(logs: Sequence[Path]) -> list[Run]:
    """Every run of every log; a UserError naming a log that cannot be read."""
    runs = []
    for log in logs:
        try:
            text = log.read_text(errors="replace")
        except OSError as exc:
            raise UserError(f"cannot read {log}: {exc.strerror}") from exc
        runs.extend(parse(text, source=log.name))
    return runs


@dataclass(frozen=True)
class Judged:
    evaluations: list[Evaluation]
    entries: list[dict[str, Any]]  # report.json's, one a run

    @property
    def failed(self) -> bool:
        return any(ev.verdict is Verdict.FAIL for ev in self.evaluations)


def judge(logs: Sequence[Path], config: Settings, out: Path) -> Judged:
    """Each run judged against config, the report and plots written into out."""
    evaluations = [evaluate(run, config) for run in read_runs(logs)]
    return Judged(evaluations, report.write(evaluations, out))


@dataclass(frozen=True)
class Recorded:
    collective: str
    nodes: int
    entry: baseline.Entry


def record(
    logs: Sequence[Path], instance_type: str, out: Path, nodes: int | None, collective: str | None
) -> Iterator[Recorded]:
    """Record each known-good run's busbw at its largest size into the baseline file out, one run at a
    time (a later run's refusal leaves the earlier ones recorded); a UserError for a run with a defect."""
    # Judge each run against an empty table: every defect still fails, nothing passes by bandwidth.
    config = settings(instance_type, None, THRESHOLD, nodes, collective)
    empty = Settings(config.instance_type, out, {}, config.threshold, config.nodes, config.collective)
    for run in read_runs(logs):
        ev = evaluate(run, empty)
        if ev.failures:
            raise UserError(f"{run.source} is not a known-good run: {'; '.join(ev.failures)}")
        count, _ = node_count(run, nodes)
        identity = identify(run, collective)
        if count is None or identity.name is None:
            missing = "--nodes" if count is None else "--collective"
            raise UserError(f"{run.source}: the log does not say its {missing[2:]}; pass {missing}")
        largest = max(run.rows, key=lambda r: r.size_bytes)
        if largest.size_bytes < LARGE_MESSAGE_BYTES:
            raise UserError(
                f"{run.source} stops at {largest.size_bytes} B; a baseline needs the busbw plateau: "
                f"run up to at least -e 1G (8G on p5)"
            )
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
        entry = baseline.Entry(
            nodes=count,
            busbw_gb_s=largest.busbw_gb_s,
            size_bytes=largest.size_bytes,
            source=f"recorded {stamp} from {run.source} (NCCL {run.nccl_version or '?'}; "
            f"network: {run.network.describe()})",
        )
        baseline.record(out, instance_type, identity.name, entry)
        yield Recorded(identity.name, count, entry)
