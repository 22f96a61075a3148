"""Wall-clock measurement and plain-text tables for benchmark scripts."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuforge.errors import ExternalError


@dataclass
class Sample:
    """Wall times (seconds) of repeated runs of one measured case."""

    label: str
    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        return max(self.seconds) - min(self.seconds) if self.seconds else 0.0


def time_call(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_timed(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    check: bool = True,
    timeout: float = 3600,
) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Run a command with the environment extended by env; return (wall seconds, result)."""
    start = time.perf_counter()
    result = subprocess.run(
        list(cmd),
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )
    elapsed = time.perf_counter() - start
    if check and result.returncode != 0:
        tail = (result.stdout + result.stderr)[-3000:]
        raise ExternalError(f"{' '.join(cmd)} exited with {result.returncode}:\n{tail}")
    return elapsed, result


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (also readable as plain text)."""
    cells = [[str(h) for h in headers], *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)
