"""Parse nccl-tests all_reduce_perf output into typed rows.

Handles both column layouts nccl-tests has printed: the current one (`redop root ... #wrong`)
and the pre-2.10 one (`redop ... error`, no root column), with the column order taken from the
log's own header line. Launcher prefixes are stripped: Open MPI's `--tag-output`
(`[1,0]<stdout>:`) and srun's `--label` (`0: `). Lines that are not table rows (NCCL INFO,
warnings, the launch command) are ignored, so a raw job log can be fed in as is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpuforge.errors import UserError

_PREFIX_RE = re.compile(r"^(\[\d+,\d+\]<std(?:out|err)>:|\d+: )")
_HEADER_RE = re.compile(r"^#\s+size\s+count\s+type\s")
_ROW_RE = re.compile(r"^\s*\d+\s+\d+\s+[a-z]\w*\s")
_RUN_START_RE = re.compile(r"^# nThread (\d+) nGpus (\d+) minBytes (\d+) maxBytes (\d+)")
_DEVICE_RE = re.compile(
    r"^#\s+Rank\s+(\d+)(?:\s+Group\s+\d+)?\s+Pid\s+\d+\s+on\s+(\S+)\s+device\s+(\d+)\s+\[[^\]]*\]\s+(.+?)\s*$"
)
_AVG_RE = re.compile(r"^# Avg bus bandwidth\s*:\s*([0-9.eE+-]+)")
_OOB_RE = re.compile(r"^# Out of bounds values\s*:\s*(\d+)")
_NCCL_VERSION_RE = re.compile(r"NCCL version (\S+)")


@dataclass(frozen=True)
class Measurement:
    """One half of a row: the out-of-place or the in-place result."""

    time_us: float
    algbw_gb_s: float
    busbw_gb_s: float
    # Wrong elements (#wrong) or max error (old "error" column); None when validation was off (N/A).
    wrong: float | None


@dataclass(frozen=True)
class Row:
    size_bytes: int
    count: int
    dtype: str
    redop: str
    root: int | None
    out_of_place: Measurement
    in_place: Measurement

    @property
    def busbw_gb_s(self) -> float:
        """The better of the two halves: what the link sustained at this size."""
        return max(self.out_of_place.busbw_gb_s, self.in_place.busbw_gb_s)


@dataclass(frozen=True)
class Device:
    rank: int
    host: str
    device: int
    name: str


@dataclass
class Run:
    """One all_reduce_perf invocation found in a log."""

    source: str
    rows: list[Row] = field(default_factory=list)
    devices: list[Device] = field(default_factory=list)
    avg_busbw_gb_s: float | None = None
    out_of_bounds: int | None = None
    nccl_version: str | None = None
    max_bytes: int | None = None
    wrong_column: str = "#wrong"

    @property
    def hosts(self) -> list[str]:
        return sorted({d.host for d in self.devices})

    @property
    def wrong_rows(self) -> list[Row]:
        """Rows whose data check failed (#wrong > 0); the old float "error" column is not a count."""
        if self.wrong_column != "#wrong":
            return []
        return [r for r in self.rows if any((m.wrong or 0) > 0 for m in (r.out_of_place, r.in_place))]


def _strip(line: str) -> str:
    return _PREFIX_RE.sub("", line, count=1).rstrip()


def _number(token: str) -> float | None:
    return None if token.upper() == "N/A" else float(token)


def _columns(header: str) -> list[str]:
    """Column names of a header line; the repeated time/algbw/busbw/check get oop_/ip_ prefixes."""
    names = header.lstrip("#").split()
    out: list[str] = []
    seen_time = 0
    for name in names:
        if name == "time":
            seen_time += 1
        half = "oop_" if seen_time == 1 else "ip_"
        out.append(f"{half}{name}" if seen_time else name)
    return out


def _row(columns: list[str], line: str) -> Row | None:
    tokens = line.split()
    if len(tokens) != len(columns):
        return None
    values = dict(zip(columns, tokens, strict=True))
    check = "wrong" if "oop_#wrong" in values else "error"
    key = "#wrong" if check == "wrong" else "error"

    def half(prefix: str) -> Measurement:
        return Measurement(
            time_us=float(values[f"{prefix}time"]),
            algbw_gb_s=float(values[f"{prefix}algbw"]),
            busbw_gb_s=float(values[f"{prefix}busbw"]),
            wrong=_number(values[f"{prefix}{key}"]),
        )

    root = values.get("root")
    return Row(
        size_bytes=int(values["size"]),
        count=int(values["count"]),
        dtype=values["type"],
        redop=values.get("redop", ""),
        root=int(root) if root is not None else None,
        out_of_place=half("oop_"),
        in_place=half("ip_"),
    )


def parse(text: str, source: str = "<log>") -> list[Run]:
    """Every all_reduce_perf run in text, in order; UserError when there is none."""
    runs: list[Run] = []
    current: Run | None = None
    columns: list[str] | None = None
    version: str | None = None
    for raw in text.splitlines():
        line = _strip(raw)
        if (match := _NCCL_VERSION_RE.search(line)) and version is None:
            version = match.group(1)
        if match := _RUN_START_RE.match(line):
            current = Run(source=f"{source}#{len(runs) + 1}", max_bytes=int(match.group(4)))
            runs.append(current)
            columns = None
            continue
        if current is None and (_HEADER_RE.match(line) or _ROW_RE.match(line)):
            # Output cut before its "# nThread" banner still holds a usable table.
            current = Run(source=f"{source}#{len(runs) + 1}")
            runs.append(current)
        if current is None:
            continue
        if match := _DEVICE_RE.match(line):
            current.devices.append(Device(int(match[1]), match[2], int(match[3]), match[4]))
        elif _HEADER_RE.match(line):
            columns = _columns(line)
            current.wrong_column = "#wrong" if "oop_#wrong" in columns else "error"
        elif columns is not None and _ROW_RE.match(line) and (row := _row(columns, line)) is not None:
            current.rows.append(row)
        elif match := _AVG_RE.match(line):
            current.avg_busbw_gb_s = float(match.group(1))
        elif match := _OOB_RE.match(line):
            current.out_of_bounds = int(match.group(1))
    runs = [r for r in runs if r.rows]
    if not runs:
        raise UserError(f"{source}: no all_reduce_perf result rows found; is this nccl-tests output?")
    if len(runs) == 1:
        runs[0].source = source
    for run in runs:
        run.nccl_version = version
    return runs
