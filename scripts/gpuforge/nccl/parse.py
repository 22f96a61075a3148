"""Parse nccl-tests output (any *_perf test) into typed runs, as real job logs print it.

The layout follows nccl-tests src/util.cu (writeResultHeader, writeBenchmarkLinePreamble,
writeBenchmarkLineBody, writeResultFooter): `size count type redop root`, then per half
(out-of-place, in-place) `time|cputime algbw busbw #wrong` (plus `i_min i_max i_p99 i_cv%`
with per-iteration timing), then an optional `timestamp` (`-S 1`, "%Y-%m-%d %H:%M:%S", two
fields). Before nccl-tests 2.10 there was no `root` and the check column was a max-error
float (`error`). The columns are taken from each table's own header line.

Real logs are messier than the table: launcher prefixes (srun --label `0: ` or ` 0: ` padded
for 10+ tasks, Open MPI `[1,0]<stdout>:`), NCCL INFO/WARN lines between rows, `...` where a
document elided rows, docs that render the `#` away, several runs in one log with or
without a banner between them, and runs cut off before their summary. A new table header
always starts a new run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpuforge.errors import UserError
from gpuforge.nccl.network import Network

_PREFIX_RE = re.compile(r"^\s*(?:\[\d+,\d+\]<std(?:out|err)>:|\d+:(?: |$))")
_HEADER_RE = re.compile(r"^#?\s*size\s+count\s+type\s")
_ROW_RE = re.compile(r"^\s*\d+\s+\d+\s+[a-z]\w*\s")
_BANNER_RE = re.compile(r"^#?\s*nThread (\d+) nGpus (\d+) minBytes (\d+) maxBytes (\d+)")
_STARTING_RE = re.compile(r"^#?\s*Collective test (starting|concluded): (\w+?)(?:_perf)?(?:_mpi)?\s*$")
_DEVICE_RE = re.compile(
    r"^#?\s*Rank\s+(\d+)(?:\s+Group\s+\d+)?\s+Pid\s+\d+\s+on\s+(\S+)\s+device\s+(\d+)\s+\[[^\]]*\]\s+(.+?)\s*$"
)
_AVG_RE = re.compile(r"^#?\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+|nan|inf)")
_OOB_RE = re.compile(r"^#?\s*Out of bounds values\s*:\s*(\d+)")
# The command line: ".../all_reduce_perf -b 8 ...", "all_gather_perf_mpi", "srun ... alltoall_perf".
_COMMAND_RE = re.compile(r"(?:^|[\s/])([a-z_]+?)_perf(?:_mpi)?(?=\s|$)")
_ELISION_RE = re.compile(r"^\s*(?:\.{3}|…)\s*$")
_TIMESTAMP_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_NCCL_MARKERS = ("NCCL INFO", "NCCL WARN", "NCCL version", "nccl-tests version")
_ALIASES = {"cputime": "time", "wrong": "#wrong"}

COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "alltoall",
        "alltoallv",
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "sendrecv",
        "hypercube",
    }
)


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
    timestamp: str | None = None

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
    """One table of results found in a log, with what the log says around it."""

    source: str
    rows: list[Row] = field(default_factory=list)
    devices: list[Device] = field(default_factory=list)
    avg_busbw_gb_s: float | None = None
    out_of_bounds: int | None = None
    max_bytes: int | None = None
    wrong_column: str = "#wrong"
    time_column: str = "time"
    # Named by the log: "banner" (# Collective test starting), "command" (the *_perf command line).
    collective: str | None = None
    collective_from: str | None = None
    elided: bool = False
    unparsed_rows: int = 0
    network: Network = field(default_factory=Network)

    @property
    def nccl_version(self) -> str | None:
        return self.network.nccl_version

    @property
    def hosts(self) -> list[str]:
        return sorted({d.host for d in self.devices})

    @property
    def ops(self) -> list[str]:
        """The reduction ops of the table's rows (`-o all` prints several), "none" left out."""
        return sorted({r.redop for r in self.rows} - {"", "none"})

    @property
    def complete(self) -> bool:
        """nccl-tests prints the average only after the last size: without it the run was cut."""
        return self.avg_busbw_gb_s is not None

    @property
    def wrong_rows(self) -> list[Row]:
        """Rows whose data check failed (#wrong > 0); the old float "error" column is not a count."""
        if self.wrong_column != "#wrong":
            return []
        return [r for r in self.rows if any((m.wrong or 0) > 0 for m in (r.out_of_place, r.in_place))]


@dataclass
class _Context:
    """What the log said since the last table: it belongs to the next table."""

    collective: str | None = None
    collective_from: str | None = None
    max_bytes: int | None = None
    devices: list[Device] = field(default_factory=list)
    network: Network = field(default_factory=Network)


@dataclass(frozen=True)
class _Columns:
    names: tuple[str, ...]
    timestamp: bool

    @classmethod
    def from_header(cls, header: str) -> _Columns:
        """Names of a header line; each half's columns get an oop_/ip_ prefix."""
        tokens = header.lstrip("#").split()
        timestamp = bool(tokens) and tokens[-1] == "timestamp"
        if timestamp:
            tokens = tokens[:-1]
        names: list[str] = []
        halves = 0
        for token in tokens:
            # cputime (-C 1) stands where time does; docs rendered with a terminal widget drop
            # every "#", the one of "#wrong" included.
            name = _ALIASES.get(token, token)
            if name == "time":
                halves += 1
            prefix = ("oop_", "ip_")[min(halves, 2) - 1] if halves else ""
            names.append(prefix + name)
        return cls(tuple(names), timestamp)

    @property
    def check(self) -> str:
        return "#wrong" if "oop_#wrong" in self.names else "error"

    def row(self, line: str) -> Row | None:
        tokens = line.split()
        stamp = None
        if self.timestamp and len(tokens) >= 2 and _TIMESTAMP_RE.match(tokens[-2]):
            stamp = " ".join(tokens[-2:])
            tokens = tokens[:-2]
        if len(tokens) != len(self.names):
            return None
        values = dict(zip(self.names, tokens, strict=True))
        try:
            root = values.get("root")
            return Row(
                size_bytes=int(values["size"]),
                count=int(values["count"]),
                dtype=values["type"],
                redop=values.get("redop", ""),
                root=int(root) if root is not None else None,
                out_of_place=self._half(values, "oop_"),
                in_place=self._half(values, "ip_"),
                timestamp=stamp,
            )
        except (KeyError, ValueError):
            return None

    def _half(self, values: dict[str, str], prefix: str) -> Measurement:
        check = values[f"{prefix}{self.check}"]
        return Measurement(
            time_us=float(values[f"{prefix}time"]),
            algbw_gb_s=float(values[f"{prefix}algbw"]),
            busbw_gb_s=float(values[f"{prefix}busbw"]),
            wrong=None if check.upper() == "N/A" else float(check),
        )


def strip_prefix(line: str) -> str:
    """The line without its launcher prefix (srun --label, Open MPI --tag-output)."""
    return _PREFIX_RE.sub("", line, count=1).rstrip()


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source
        self.runs: list[Run] = []
        self.current: Run | None = None
        self.columns: _Columns | None = None
        self.context = _Context()

    def _close(self) -> None:
        """The current table is over: what follows belongs to the next one."""
        if self.current is not None:
            self.current = None
            self.columns = None

    def _start(self, columns: _Columns) -> None:
        ctx = self.context
        run = Run(
            source=self.source,
            devices=ctx.devices,
            max_bytes=ctx.max_bytes,
            wrong_column=columns.check,
            collective=ctx.collective,
            collective_from=ctx.collective_from,
            network=ctx.network,
        )
        self.runs.append(run)
        self.current, self.columns = run, columns
        # The next run inherits nothing but the launch command (a script that loops over sizes
        # prints it once) and the NCCL version.
        self.context = _Context(
            collective=ctx.collective if ctx.collective_from == "command" else None,
            collective_from="command" if ctx.collective_from == "command" else None,
        )
        self.context.network.nccl_version = ctx.network.nccl_version

    def _name(self, collective: str, origin: str) -> None:
        if collective not in COLLECTIVES:
            return
        if origin == "banner" or self.context.collective_from != "banner":
            self.context.collective, self.context.collective_from = collective, origin

    def feed(self, raw: str) -> None:
        line = strip_prefix(raw)
        if not line.strip():
            return
        run = self.current
        if match := _STARTING_RE.match(line):
            if match.group(1) == "starting":
                self._close()
                self._name(match.group(2), "banner")
            elif run is not None and run.collective_from != "banner" and match.group(2) in COLLECTIVES:
                run.collective, run.collective_from = match.group(2), "banner"
            return
        if match := _BANNER_RE.match(line):
            self._close()
            self.context.max_bytes = int(match.group(4))
            return
        if match := _DEVICE_RE.match(line):
            if run is not None and run.rows:
                self._close()
            self.context.devices.append(Device(int(match[1]), match[2], int(match[3]), match[4]))
            return
        if _HEADER_RE.match(line):
            self._close()
            self._start(_Columns.from_header(line))
            return
        if any(marker in line for marker in _NCCL_MARKERS):
            # Lines inside an unfinished table come from its ranks; after its summary they
            # belong to the next run (its communicator's init).
            (run.network if run is not None and not run.complete else self.context.network).observe(line)
            return
        if run is not None and self.columns is not None:
            if _ROW_RE.match(line):
                row = self.columns.row(line)
                if row is None:
                    run.unparsed_rows += 1
                else:
                    run.rows.append(row)
                return
            if _ELISION_RE.match(line):
                run.elided = True
                return
            if match := _AVG_RE.match(line):
                run.avg_busbw_gb_s = float(match.group(1))
                return
            if match := _OOB_RE.match(line):
                run.out_of_bounds = int(match.group(1))
                return
        if not line.lstrip().startswith("#") and (match := _COMMAND_RE.search(line)):
            self._name(match.group(1), "command")


def parse(text: str, source: str = "<log>") -> list[Run]:
    """Every result table in text, in order; UserError when there is none."""
    parser = _Parser(source)
    for raw in text.splitlines():
        parser.feed(raw)
    runs = [r for r in parser.runs if r.rows]
    if not runs:
        raise UserError(f"{source}: no nccl-tests result rows found; is this nccl-tests output?")
    if len(runs) > 1:
        for index, run in enumerate(runs, start=1):
            run.source = f"{source}#{index}"
    return runs
