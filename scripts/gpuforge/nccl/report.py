"""Write report.json, report.md and one busbw-vs-size PNG per run into an output folder."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuforge.errors import UserError
from gpuforge.nccl.evaluate import Evaluation

_SLUG_RE = re.compile(r"[^A-Za-z0-9._-]+")


def slug(source: str) -> str:
    return _SLUG_RE.sub("_", source).strip("_") or "run"


def to_dict(ev: Evaluation, png: str) -> dict[str, Any]:
    run = ev.run
    network = run.network
    return {
        "source": run.source,
        "instance_type": ev.instance_type,
        "collective": ev.identity.name,
        "collective_from": ev.identity.how,
        "ops": run.ops,
        "verdict": ev.verdict.value,
        "reasons": list(ev.reasons),
        "nodes": ev.nodes,
        "baseline": None
        if ev.choice is None
        else {
            "file": str(ev.choice.file),
            "nodes": ev.choice.entry.nodes,
            "busbw_gb_s": ev.choice.entry.busbw_gb_s,
            "size_bytes": ev.choice.entry.size_bytes,
            "source": ev.choice.entry.source,
        },
        "threshold": ev.threshold,
        "busbw_gb_s": ev.busbw_gb_s,
        "ratio_to_baseline": ev.ratio,
        "avg_busbw_gb_s": run.avg_busbw_gb_s,
        "complete": run.complete,
        "elided": run.elided,
        "hosts": run.hosts,
        "ranks": len(run.devices),
        "nccl_version": run.nccl_version,
        "network": {
            "description": network.describe(),
            "networks": sorted(network.networks),
            "ofi_version": network.ofi_version,
            "providers": sorted(network.providers),
        },
        "plot": png,
        "rows": [
            {
                "size_bytes": r.size_bytes,
                "count": r.count,
                "type": r.dtype,
                "redop": r.redop,
                "out_of_place_busbw_gb_s": r.out_of_place.busbw_gb_s,
                "in_place_busbw_gb_s": r.in_place.busbw_gb_s,
                "out_of_place_time_us": r.out_of_place.time_us,
                "in_place_time_us": r.in_place.time_us,
                "wrong": [r.out_of_place.wrong, r.in_place.wrong],
            }
            for r in run.rows
        ],
    }


def _markdown(entries: Sequence[dict[str, Any]]) -> str:
    lines = [
        "# NCCL tests report",
        "",
        "| Run | Collective | Instance type | Nodes | busbw (GB/s) | Baseline (GB/s) | Ratio | Verdict |",
        "|-----|------------|---------------|------:|-------------:|----------------:|------:|---------|",
    ]
    for e in entries:
        busbw = "-" if e["busbw_gb_s"] is None else f"{e['busbw_gb_s']:.2f}"
        expected = "-" if e["baseline"] is None else f"{e['baseline']['busbw_gb_s']:g}"
        ratio = "-" if e["ratio_to_baseline"] is None else f"{e['ratio_to_baseline']:.0%}"
        lines.append(
            f"| {e['source']} | {e['collective'] or 'unknown'} | {e['instance_type']} | {e['nodes'] or '?'} "
            f"| {busbw} | {expected} | {ratio} | {e['verdict']} |"
        )
    for e in entries:
        lines += ["", f"## {e['source']}", ""]
        lines += [f"- {reason}" for reason in e["reasons"]]
        hosts = ", ".join(e["hosts"]) or "not listed"
        ops = ", ".join(e["ops"]) or "none"
        lines += [
            f"- hosts: {hosts}; ranks: {e['ranks']}; ops: {ops}; "
            f"NCCL {e['nccl_version'] or 'version not logged'}"
        ]
        lines += ["", f"![busbw vs size]({e['plot']})"]
    return "\n".join(lines) + "\n"


def write(evaluations: Sequence[Evaluation], out_dir: Path) -> list[dict[str, Any]]:
    try:
        return _write(evaluations, out_dir)
    except OSError as exc:
        raise UserError(f"cannot write the report into {out_dir}: {exc.strerror or exc}") from exc


def _write(evaluations: Sequence[Evaluation], out_dir: Path) -> list[dict[str, Any]]:
    # Imported here: matplotlib (and numpy) took about a quarter of every gpuforge command's start-up.
    from gpuforge.nccl.plot import plot

    out_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    used: set[str] = set()
    for ev in evaluations:
        name = slug(ev.run.source)
        while name in used:
            name += "_"
        used.add(name)
        png = plot(ev, out_dir / f"{name}.png")
        entries.append(to_dict(ev, png.name))
    (out_dir / "report.json").write_text(json.dumps({"runs": entries}, indent=2) + "\n")
    (out_dir / "report.md").write_text(_markdown(entries))
    return entries
