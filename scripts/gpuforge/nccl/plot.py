"""PNG plot of busbw against message size for one run (matplotlib's Agg canvas, no display needed)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from gpuforge.nccl.evaluate import LARGE_MESSAGE_BYTES, Evaluation
from gpuforge.nccl.parse import Row

GIB_LABEL = "1 GiB"


def _expectation(ax: Axes, evaluation: Evaluation) -> None:
    if evaluation.choice is None:
        return
    entry = evaluation.choice.entry
    ax.axhline(
        entry.busbw_gb_s,
        color="green",
        linestyle="--",
        label=f"baseline {entry.busbw_gb_s:g} GB/s ({entry.nodes} node{'s' if entry.nodes > 1 else ''})",
    )
    gate = evaluation.threshold * entry.busbw_gb_s
    ax.axhline(gate, color="red", linestyle=":", label=f"{evaluation.threshold:.0%} gate {gate:.4g} GB/s")


def _group(rows: Sequence[Row]) -> tuple[str, str]:
    """One (type, op) curve: `-d all -o all` prints every combination per size."""
    groups = Counter((r.dtype, r.redop) for r in rows)
    preferred = [g for g in groups if g[0] == "float" and g[1] in ("sum", "none")]
    return preferred[0] if preferred else groups.most_common(1)[0][0]


def figure(evaluation: Evaluation) -> Figure:
    """The busbw-vs-size figure: both halves, #wrong sizes, the baseline and gate, 1 GiB marked."""
    run = evaluation.run
    group = _group(run.rows)
    rows = [r for r in run.rows if (r.dtype, r.redop) == group and r.size_bytes > 0]
    if not rows:
        rows = [r for r in run.rows if (r.dtype, r.redop) == group]
    sizes = [max(r.size_bytes, 1) for r in rows]
    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(
        sizes, [r.out_of_place.busbw_gb_s for r in rows], marker="o", markersize=3, label="out-of-place busbw"
    )
    ax.plot(sizes, [r.in_place.busbw_gb_s for r in rows], marker="s", markersize=3, label="in-place busbw")
    wrong = [r for r in run.wrong_rows if r in rows]
    if wrong:
        ax.scatter(
            [r.size_bytes for r in wrong],
            [r.busbw_gb_s for r in wrong],
            marker="x",
            s=80,
            color="red",
            zorder=5,
            label=f"#wrong > 0 ({len(wrong)} size{'s' if len(wrong) > 1 else ''})",
        )
    _expectation(ax, evaluation)
    ax.axvline(LARGE_MESSAGE_BYTES, color="grey", linewidth=0.8)
    ax.annotate(
        GIB_LABEL,
        xy=(LARGE_MESSAGE_BYTES, 0.0),
        xycoords=("data", "axes fraction"),
        xytext=(3, 4),
        textcoords="offset points",
        color="grey",
        fontsize="small",
    )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    nodes = f"{evaluation.nodes} nodes" if evaluation.nodes else "nodes unknown"
    ax.set_title(
        f"{evaluation.identity.label} ({' '.join(group)}) {run.source} on {evaluation.instance_type}, "
        f"{nodes}: {evaluation.verdict.value}",
        fontsize="medium",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    return fig


def plot(evaluation: Evaluation, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure(evaluation).savefig(path, format="png")
    return path
