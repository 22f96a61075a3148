"""PNG plot of busbw against message size for one run (matplotlib's Agg canvas, no display needed)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from gpuforge.nccl.evaluate import Evaluation


def plot(evaluation: Evaluation, path: Path) -> Path:
    run = evaluation.run
    rows = [r for r in run.rows if r.size_bytes > 0]
    sizes = [r.size_bytes for r in rows]
    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(sizes, [r.out_of_place.busbw_gb_s for r in rows], marker="o", markersize=3, label="out-of-place")
    ax.plot(sizes, [r.in_place.busbw_gb_s for r in rows], marker="s", markersize=3, label="in-place")
    ax.axhline(
        evaluation.peak_gb_s, color="green", linestyle="--", label=f"expected peak {evaluation.peak_gb_s:g}"
    )
    ax.axhline(
        evaluation.threshold * evaluation.peak_gb_s,
        color="red",
        linestyle=":",
        label=f"{evaluation.threshold:.0%} of peak",
    )
    ax.axvline(evaluation.large_bytes, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"all_reduce_perf {run.source} on {evaluation.instance_type}: {evaluation.verdict.value}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
