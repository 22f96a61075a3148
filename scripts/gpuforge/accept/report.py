"""What `gpuforge accept` leaves behind: one screen of summary, report.json, and two pictures.

doubling.png: bus bandwidth against node count, each step's baseline and its 90% gate.
pairs.png: every pair test's bus bandwidth against its gate, failing pairs in red.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuforge.accept.plan import Acceptance, NodeStatus, Projection, Result
from gpuforge.errors import UserError

# Names listed per line of the summary before "... and N more": the summary stays one screen.
SHOWN = 8


def _result(result: Result | None) -> dict[str, Any] | None:
    if result is None:
        return None
    return {
        "passed": result.passed,
        "judged": result.judged,
        "figure": result.figure,
        "busbw_gb_s": result.busbw_gb_s,
        "expected_gb_s": result.expected_gb_s,
    }


def to_dict(
    acceptance: Acceptance, context: dict[str, Any], drained: dict[str, str], logs: dict[str, str]
) -> dict[str, Any]:
    search = acceptance.search
    return {
        "accepted": acceptance.accepted,
        **context,
        "nodes": {
            n: {"status": v.status.value, "stage": v.stage, "figure": v.figure, "drained": n in drained}
            for n, v in acceptance.verdicts.items()
        },
        "alone": {n: _result(r) for n, r in acceptance.alone.items()},
        "pairs": [
            {
                "round": t.round,
                "purpose": t.purpose,
                "nodes": list(t.pair),
                **(_result(t.result) or {}),
                "log": logs.get(" ".join(t.pair)),
            }
            for t in search.tests
        ],
        "pair_rounds": search.rounds,
        "doubling": [
            {
                "nodes": s.size,
                "members": s.nodes,
                "result": _result(s.result),
                "log": logs.get(" ".join(s.nodes)),
            }
            for s in acceptance.steps
        ],
        "drained": drained,
        "unjudged": acceptance.unjudged,
        "unjudged_pairs_and_doubling": acceptance.unjudged_multi,
    }


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown + (f" ... and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def summary(
    acceptance: Acceptance,
    instance_type: str,
    drained: dict[str, str],
    report_only: bool,
    out: Path,
    drain_errors: dict[str, str] | None = None,
) -> list[str]:
    """At most about 20 lines, whatever the cluster's size; the details are in report.json."""
    v = acceptance.verdicts
    tested = [n for n, x in v.items() if x.status is not NodeStatus.NOT_TESTED]
    failed_alone = [n for n, r in acceptance.alone.items() if not r.passed]
    search = acceptance.search
    first = [t for t in search.tests if t.round == 1]
    unjudged_multi = acceptance.unjudged_multi
    why = ""
    if unjudged_multi and not acceptance.accepted and acceptance.passed_all:
        why = f": {len(unjudged_multi)} pair/doubling result(s) not judged ({unjudged_multi[0]})"
    elif unjudged_multi and acceptance.accepted:
        why = f" with --accept-unjudged: {len(unjudged_multi)} pair/doubling result(s) not judged"
    lines = [
        (
            f"gpuforge accept: {'ACCEPTED' if acceptance.accepted else 'NOT ACCEPTED'} "
            f"({instance_type}, {len(tested)} nodes tested of {len(v)}){why}"
        )[:300],
        f"  stage 1, alone:    {len(tested) - len(failed_alone)} of {len(tested)} passed"
        + (f"; failed: {_names(failed_alone)}" if failed_alone else ""),
        f"  stage 2, pairs:    {len(first)} pairs in round 1, "
        f"{sum(not t.result.passed for t in first)} fell short; "
        f"{search.rounds} round(s); named: {_names(sorted(search.bad)) or 'none'}",
    ]
    if acceptance.steps:
        ran = [s for s in acceptance.steps if s.result is not None]
        last = ran[-1]
        assert last.result is not None
        lines.append(
            f"  stage 3, doubling: {' '.join(str(s.size) for s in ran)} nodes; "
            f"{'fell short at' if not last.result.passed else 'last'} {last.size}: {last.result.figure}"
        )
    else:
        lines.append("  stage 3, doubling: not run (fewer than 2 nodes left)")
    for label, status in (("failed", NodeStatus.FAILED), ("unresolved", NodeStatus.UNRESOLVED)):
        nodes = [n for n, x in v.items() if x.status is status]
        for node in nodes[:SHOWN]:
            lines.append(f"  {label} {node}: {v[node].stage}: {v[node].figure}"[:200])
        if len(nodes) > SHOWN:
            lines.append(f"  ... and {len(nodes) - SHOWN} more {label} (report.json)")
    untested = [n for n, x in v.items() if x.status is NodeStatus.NOT_TESTED]
    if untested:
        lines.append(f"  not tested: {_names([f'{n} ({v[n].figure})' for n in untested])}")
    if drained:
        lines.append(f"  drained: {_names(sorted(drained))}")
    elif report_only and acceptance.to_drain:
        lines.append(f"  --report-only: would drain {_names([x.node for x in acceptance.to_drain])}")
    for node, error in sorted((drain_errors or {}).items())[:SHOWN]:
        lines.append(f"  NOT drained {node}: {error}"[:200])
    unjudged = acceptance.unjudged
    if unjudged:
        lines.append(f"  not judged ({len(unjudged)}): {unjudged[0]}"[:200])
    lines.append(f"  report: {out / 'report.json'}; pictures: {out / 'doubling.png'}, {out / 'pairs.png'}")
    return lines


def _doubling_figure(acceptance: Acceptance, threshold: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps = [s for s in acceptance.steps if s.result is not None and s.result.busbw_gb_s is not None]
    measured = [s.result.busbw_gb_s or 0.0 for s in steps if s.result is not None]
    expected = [s for s in steps if s.result is not None and s.result.expected_gb_s is not None]
    if expected:
        xs = [s.size for s in expected]
        base = [s.result.expected_gb_s or 0.0 for s in expected if s.result is not None]
        ax.plot(xs, base, color="green", linestyle="--", marker=".", label="baseline for the node count")
        ax.plot(
            xs,
            [b * threshold for b in base],
            color="red",
            linestyle=":",
            label=f"{threshold:.0%} of baseline",
        )
    ax.scatter(
        [s.size for s in steps],
        measured,
        color=["tab:blue" if s.result is not None and s.result.passed else "red" for s in steps],
        zorder=5,
        s=40,
    )
    if steps:
        ax.plot(
            [s.size for s in steps],
            measured,
            color="tab:blue",
            label="measured busbw",
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks([s.size for s in steps], [str(s.size) for s in steps])
    else:
        ax.text(0.5, 0.5, "no doubling step ran", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("nodes")
    ax.set_ylabel("all_reduce bus bandwidth (GB/s)")
    ax.set_title("gpuforge accept: doubling", fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize="small")
    fig.tight_layout()
    return fig


def _pairs_figure(acceptance: Acceptance, threshold: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    tests = [t for t in acceptance.search.tests if t.result.busbw_gb_s is not None]
    tests.sort(key=lambda t: (t.round, t.result.busbw_gb_s or 0.0))
    if tests:
        xs = list(range(len(tests)))
        ax.bar(
            xs,
            [t.result.busbw_gb_s or 0.0 for t in tests],
            color=["tab:blue" if t.result.passed else "red" for t in tests],
            width=0.8,
        )
        gates = [t.result.expected_gb_s for t in tests if t.result.expected_gb_s is not None]
        if gates:
            ax.axhline(
                min(gates) * threshold,
                color="red",
                linestyle=":",
                label=f"{threshold:.0%} of the 2-node baseline",
            )
            ax.axhline(min(gates), color="green", linestyle="--", label="2-node baseline")
            ax.legend(loc="lower right", fontsize="small")
        if len(tests) <= 40:
            ax.set_xticks(
                xs, [f"r{t.round} {t.pair[0]}\n{t.pair[1]}" for t in tests], rotation=90, fontsize="x-small"
            )
        else:
            ax.set_xlabel(f"{len(tests)} pair tests, by round, slowest first")
    else:
        ax.text(0.5, 0.5, "no pair test ran", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("all_reduce bus bandwidth (GB/s)")
    ax.set_title("gpuforge accept: pairs (red: below the gate)", fontsize="medium")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def write(out: Path, document: dict[str, Any], acceptance: Acceptance, threshold: float) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(document, indent=2) + "\n")
        _doubling_figure(acceptance, threshold).savefig(out / "doubling.png", format="png")
        _pairs_figure(acceptance, threshold).savefig(out / "pairs.png", format="png")
    except OSError as exc:
        raise UserError(f"cannot write the report into {out}: {exc.strerror or exc}") from exc


def write_partial(out: Path, context: dict[str, Any], error: str) -> None:
    """report.json of a run that stopped before its verdict: what ran, and why it stopped."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        document = {"accepted": False, "partial": True, "error": error, **context}
        (out / "report.json").write_text(json.dumps(document, indent=2) + "\n")
    except OSError:
        pass  # The error that stopped the run is the one to report.


def projection_context(projection: Projection) -> dict[str, Any]:
    return {
        "projection": {
            "nodes": projection.nodes,
            "node_stage_s": projection.node_stage_s,
            "pair_round_s": projection.pair_round_s,
            "doubling_steps": projection.steps,
            "step_s": projection.step_s,
            "total_s": projection.total_s,
        }
    }
