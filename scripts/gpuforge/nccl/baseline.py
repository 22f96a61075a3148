"""Expected busbw per instance type, collective and node count: load, pick, record.

The shipped table is data/nccl_baselines.yml (linked from data/instance_types.yml); an
operator's own file, recorded from a known-good cluster with `gpuforge nccl-baseline`, has the
same layout and replaces it with `gpuforge nccl-report --baseline FILE`. Busbw depends on
the node count (2 nodes beat line rate with NCCL's tree algorithm, 4+ nodes sit near 89% of
it on p5), so each entry holds the node count and the message size it was measured at.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpuforge import paths
from gpuforge.errors import UserError

KEY = "gpuforge_nccl_baselines"


@dataclass(frozen=True)
class Entry:
    nodes: int
    busbw_gb_s: float
    size_bytes: int
    source: str


@dataclass(frozen=True)
class Choice:
    """The entry a run is judged against, and why that one."""

    file: Path
    instance_type: str
    collective: str
    entry: Entry
    run_nodes: int

    def describe(self) -> str:
        bucket = f"{self.entry.nodes} nodes" if self.entry.nodes > 1 else "1 node (intra-node)"
        used = "" if self.entry.nodes == self.run_nodes else f", used for a {self.run_nodes}-node run"
        return (
            f"{self.file.name}: {self.instance_type} {self.collective} at {bucket}{used}: "
            f"{self.entry.busbw_gb_s:g} GB/s at {self.entry.size_bytes} B ({self.entry.source})"
        )


Table = dict[str, dict[str, list[Entry]]]


def default_file() -> Path:
    return paths.repo_root() / "data" / "nccl_baselines.yml"


def load(path: Path) -> Table:
    """The baselines in path; UserError naming the file and the entry on any schema problem."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise UserError(f"cannot read baseline file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise UserError(f"baseline file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get(KEY), dict):
        raise UserError(f"baseline file {path} has no '{KEY}:' mapping")
    table: Table = {}
    for itype, collectives in data[KEY].items():
        if not isinstance(collectives, dict):
            raise UserError(f"{path}: {itype} must map collective names to lists of entries")
        table[str(itype)] = {
            str(name): [
                _entry(path, f"{itype}.{name}", raw) for raw in _list(path, f"{itype}.{name}", entries)
            ]
            for name, entries in collectives.items()
        }
    return table


def _list(path: Path, where: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise UserError(f"{path}: {where} must be a list of entries")
    return value


def _entry(path: Path, where: str, raw: Any) -> Entry:
    try:
        entry = Entry(
            nodes=int(raw["nodes"]),
            busbw_gb_s=float(raw["busbw_gb_s"]),
            size_bytes=int(raw["size_bytes"]),
            source=str(raw["source"]),
        )
    except (TypeError, KeyError, ValueError) as exc:
        raise UserError(
            f"{path}: {where}: each entry needs nodes, busbw_gb_s, size_bytes and source ({exc!r})"
        ) from None
    if entry.nodes < 1 or entry.busbw_gb_s <= 0 or entry.size_bytes <= 0:
        raise UserError(f"{path}: {where}: nodes, busbw_gb_s and size_bytes must be positive")
    return entry


def choose(
    table: Table, file: Path, instance_type: str, collective: str, nodes: int, beyond_largest: bool = True
) -> Choice | None:
    """The entry for this node count: exact, else the next larger bucket, else (with beyond_largest)
    the largest (32+).

    A single-node run is only judged against a 1-node (intra-node) entry, and a multi-node run
    never against one: NVLink and the network are different expectations. Without beyond_largest a
    run larger than every recorded count is not judged: `gpuforge accept` must not call a 64-node
    step good or bad on a 2-node figure.
    """
    entries = table.get(instance_type, {}).get(collective, [])
    candidates = [e for e in entries if (e.nodes == 1) == (nodes == 1)]
    if not candidates:
        return None
    larger = sorted((e for e in candidates if e.nodes >= nodes), key=lambda e: e.nodes)
    if not larger and not beyond_largest:
        return None
    entry = larger[0] if larger else max(candidates, key=lambda e: e.nodes)
    return Choice(file, instance_type, collective, entry, nodes)


def record(path: Path, instance_type: str, collective: str, entry: Entry) -> None:
    """Add or replace the entry for (instance type, collective, node count) in path."""
    data: dict[str, Any] = {KEY: {}}
    if path.exists():
        load(path)  # Refuse to rewrite a file that is not a valid baseline file.
        data = yaml.safe_load(path.read_text())
    entries = data[KEY].setdefault(instance_type, {}).setdefault(collective, [])
    entries[:] = [e for e in entries if int(e["nodes"]) != entry.nodes]
    entries.append(
        {
            "nodes": entry.nodes,
            "busbw_gb_s": entry.busbw_gb_s,
            "size_bytes": entry.size_bytes,
            "source": entry.source,
        }
    )
    entries.sort(key=lambda e: int(e["nodes"]))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(data, sort_keys=False, width=1000))
    except OSError as exc:
        raise UserError(f"cannot write baseline file {path}: {exc.strerror or exc}") from exc
