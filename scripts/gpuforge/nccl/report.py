"""Write report.json, report.md and one busbw-vs-size PNG per run into an output folder."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuforge.nccl.evaluate import Evaluation
from gpuforge.nccl.plot import plot

_SLUG_RE = re.compile(r"[^A-Za-z0-9._-]+")


def slug(source: str) -> str:
    return _SLUG_RE.sub("_", source).strip("_") or "run"


def to_dict(ev: Evaluation, png: str) -> dict[str, Any]:
    run = ev.run
    return {
        "source": run.source,
        "instance_type": ev.instance_type,
        "verdict": ev.verdict.value,
        "reasons": list(ev.reasons),
        "expected_peak_busbw_gb_s": ev.peak_gb_s,
        "threshold": ev.threshold,
        "large_message_bytes": ev.large_bytes,
        "large_message_busbw_gb_s": ev.large_busbw_gb_s,
        "ratio_to_peak": ev.ratio,
        "avg_busbw_gb_s": run.avg_busbw_gb_s,
        "hosts": run.hosts,
        "ranks": len(run.devices),
        "nccl_version": run.nccl_version,
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
            }
            for r in run.rows
        ],
    }


def _markdown(entries: Sequence[dict[str, Any]]) -> str:
    lines = [
        "# NCCL all_reduce_perf report",
        "",
        "| Run | Instance type | Large-message busbw (GB/s) | Expected peak (GB/s) | Ratio | Verdict |",
        "|-----|---------------|---------------------------:|---------------------:|------:|---------|",
    ]
    for e in entries:
        busbw = "-" if e["large_message_busbw_gb_s"] is None else f"{e['large_message_busbw_gb_s']:.2f}"
        ratio = "-" if e["ratio_to_peak"] is None else f"{e['ratio_to_peak']:.0%}"
        lines.append(
            f"| {e['source']} | {e['instance_type']} | {busbw} | {e['expected_peak_busbw_gb_s']:g} "
            f"| {ratio} | {e['verdict']} |"
        )
    for e in entries:
        lines += ["", f"## {e['source']}", ""]
        lines += [f"- {reason}" for reason in e["reasons"]]
        hosts = ", ".join(e["hosts"]) or "unknown"
        lines += [f"- hosts: {hosts}; ranks: {e['ranks']}; NCCL {e['nccl_version'] or 'version not logged'}"]
        lines += ["", f"![busbw vs size]({e['plot']})"]
    return "\n".join(lines) + "\n"


def write(evaluations: Sequence[Evaluation], out_dir: Path) -> list[dict[str, Any]]:
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
