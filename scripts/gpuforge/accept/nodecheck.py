"""Stage 1's output, node by node, judged: what scripts/slurm/gpuforge-accept-node.sh printed between
its @@ markers.

The node stage is one srun step with one task per node and --label, so every line starts with its
task's number; each task's first line names its Slurm node. Per node: the health checks' JSON
(gpuforge-health), one line per EFA device's fi_pingpong loopback, and the all_reduce_perf log,
judged by gpuforge.nccl.judge against the type's 1-node (NVLink) baseline.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from gpuforge.accept.plan import Result
from gpuforge.nccl.evaluate import Settings, Verdict
from gpuforge.nccl.judge import Judgement, judge_log

_LABEL_RE = re.compile(r"^\s*(\d+): ?(.*)$")
_NODE_RE = re.compile(r"^@@gpuforge-accept node=(\S+)")
_END_RE = re.compile(r"^@@(health|allreduce) end rc=(\S+)")
_EFA_RE = re.compile(r"^@@efa device=(\S+) rc=(\d+) ?(.*)$")
_EFA_NONE_RE = re.compile(r"^@@efa none reason=(.*)$")
ABSENT = "absent_by_design"


@dataclass
class NodeOutput:
    """What one node's task printed, section by section."""

    node: str
    health: list[str] = field(default_factory=list)
    health_rc: str | None = None
    efa: list[tuple[str, int, str]] = field(default_factory=list)
    efa_none: str | None = None
    allreduce: list[str] = field(default_factory=list)
    allreduce_rc: str | None = None


def split(log: str) -> dict[str, NodeOutput]:
    """The labelled step output as one NodeOutput per node that announced itself."""
    by_task: dict[str, list[str]] = defaultdict(list)
    for line in log.splitlines():
        match = _LABEL_RE.match(line)
        if match:
            by_task[match.group(1)].append(match.group(2))
    out = {}
    for lines in by_task.values():
        node = next((m.group(1) for m in map(_NODE_RE.match, lines) if m), None)
        if node is not None:
            out[node] = _sections(node, lines)
    return out


def _sections(node: str, lines: list[str]) -> NodeOutput:
    output = NodeOutput(node)
    section = ""
    for line in lines:
        if line in ("@@health begin", "@@allreduce begin"):
            section = line.split()[0][2:]
            continue
        if end := _END_RE.match(line):
            if end.group(1) == "health":
                output.health_rc = end.group(2)
            else:
                output.allreduce_rc = end.group(2)
            section = ""
            continue
        if efa := _EFA_RE.match(line):
            output.efa.append((efa.group(1), int(efa.group(2)), efa.group(3)))
            continue
        if none := _EFA_NONE_RE.match(line):
            output.efa_none = none.group(1)
            continue
        if section == "health":
            output.health.append(line)
        elif section == "allreduce":
            output.allreduce.append(line)
    return output


@dataclass(frozen=True)
class NodeJudgement:
    node: str
    result: Result
    health: dict[str, Any]
    efa: list[dict[str, Any]]
    allreduce: Judgement | None
    notes: tuple[str, ...]


def _health(output: NodeOutput) -> tuple[list[str], list[str], dict[str, Any]]:
    """(failures, absent-by-design checks, the report) from gpuforge-health --json."""
    if output.health_rc == "missing":
        return ["health: gpuforge-health not found (the health role installs it)"], [], {}
    if output.health_rc is None:
        return ["health: no result (the check did not finish)"], [], {}
    text = "\n".join(output.health)
    start = text.find("{")
    try:
        report: dict[str, Any] = json.loads(text[start:]) if start >= 0 else {}
    except json.JSONDecodeError:
        report = {}
    if not report:
        return [f"health: exit {output.health_rc} without a JSON report: {text.strip()[-200:]}"], [], {}
    results = report.get("results", [])
    failed = [f"health {r['check']}: {r['detail']}" for r in results if r.get("status") == "fail"]
    absent = [r["check"] for r in results if r.get("status") == ABSENT]
    if output.health_rc != "0" and not failed:
        failed.append(f"health: exit {output.health_rc}")
    return failed, absent, report


def _efa(
    output: NodeOutput, promised: int, absent: list[str]
) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """(failures, notes, per-device results) of the loopbacks against the type's EFA device count."""
    devices = [{"device": d, "rc": rc, "detail": detail} for d, rc, detail in output.efa]
    if promised == 0:
        return [], ["efa: the type has no EFA device"], devices
    if output.efa_none is not None and not devices:
        if "efa_devices" in absent:
            # TEST DOUBLE ONLY: the lab declares its promised hardware absent (gpuforge-health says so).
            return [], [f"efa loopback {ABSENT}: {output.efa_none}"], devices
        return [f"efa loopback: {output.efa_none}"], [], devices
    failed = [
        f"efa loopback {d['device']}: fi_pingpong exit {d['rc']} {d['detail']}".strip()
        for d in devices
        if d["rc"]
    ]
    if len(devices) < promised:
        failed.append(f"efa loopback: {len(devices)} of {promised} EFA devices listed by fi_info")
    notes = [] if failed else [f"efa loopback: {len(devices)} of {promised} devices"]
    return failed, notes, devices


def judge(
    output: NodeOutput | None,
    node: str,
    config: Settings,
    gpus: int,
    efa_devices: int,
    step_failed: str | None = None,
) -> NodeJudgement:
    """The node stage's verdict on one node: a failed health check or loopback, or NVLink busbw below gate.

    `step_failed` says why the stage's srun ended badly (its exit status, a time limit): a node whose
    output stops short then has no verdict (unresolved), rather than a failure of its own.
    """
    finished = output is not None and output.allreduce_rc is not None
    if step_failed and not finished:
        why = "no output" if output is None else "output cut short"
        result = Result(False, f"no result ({why}): {step_failed}", resolved=False)
        return NodeJudgement(node, result, {}, [], None, ())
    if output is None:
        result = Result(False, "no output from the node stage (the node did not run its task)")
        return NodeJudgement(node, result, {}, [], None, ())
    failures, absent, health = _health(output)
    efa_failures, notes, efa = _efa(output, efa_devices, absent)
    failures += efa_failures
    notes = list(notes)
    judgement: Judgement | None = None
    judged = True
    busbw = expected = None
    if output.allreduce_rc == "single-gpu" or gpus < 2:
        notes.append("all_reduce: one GPU, no intra-node all_reduce")
    elif output.allreduce_rc == "missing":
        failures.append("all_reduce: all_reduce_perf not found (the nccl_tests role builds it)")
    else:
        rc = output.allreduce_rc
        judgement = judge_log(
            "\n".join(output.allreduce),
            config,
            f"{node}-alone",
            int(rc) if rc and rc.isdigit() else None,
            "all_reduce_perf",
        )
        busbw, expected = judgement.busbw_gb_s, judgement.expected_gb_s
        if judgement.verdict is Verdict.FAIL:
            failures.append(f"all_reduce alone: {judgement.figure}")
        else:
            judged = judgement.verdict is Verdict.PASS
            notes.append(f"all_reduce alone: {judgement.figure}")
    if failures:
        result = Result(False, "; ".join(failures), busbw, expected)
    else:
        result = Result(True, "; ".join(notes), busbw, expected, judged=judged)
    return NodeJudgement(node, result, health, efa, judgement, tuple(notes))


def largest_busbw(judgement: Judgement) -> tuple[float, int] | None:
    """The all_reduce's busbw at its largest message (the lowest over the log's runs), and that size."""
    figures = []
    for ev in judgement.evaluations:
        if ev.run.rows:
            size = max(r.size_bytes for r in ev.run.rows)
            figures.append((max(r.busbw_gb_s for r in ev.run.rows if r.size_bytes == size), size))
    return min(figures) if figures else None


def relative(judgements: dict[str, NodeJudgement], share: float) -> dict[str, NodeJudgement]:
    """Nodes whose NVLink all_reduce had no 1-node baseline, against the median of the same run's nodes
    (one instance type): below `share` of it fails the node with both figures. A degraded NVLink or
    GPU is still caught where no absolute figure is recorded."""
    figures = {
        n: f for n, j in judgements.items() if j.allreduce is not None and (f := largest_busbw(j.allreduce))
    }
    if not figures:
        return judgements
    median = statistics.median(f[0] for f in figures.values())
    out = dict(judgements)
    for node, j in judgements.items():
        if not (j.result.passed and not j.result.judged and node in figures):
            continue
        busbw, size = figures[node]
        if len(figures) < 2:
            note = "all_reduce alone: no 1-node baseline and no other node to compare with"
            out[node] = dataclasses.replace(
                j, result=dataclasses.replace(j.result, figure=f"{j.result.figure}; {note}")
            )
            continue
        ratio = busbw / median if median else 0.0
        figure = (
            f"all_reduce alone: busbw {busbw:.2f} GB/s at {size} B is {ratio:.0%} of the median of "
            f"{len(figures)} nodes ({median:.2f} GB/s)"
        )
        if busbw < share * median:
            result = Result(
                False, f"{figure}, below {share:.0%} (no 1-node baseline: relative check)", busbw, median
            )
        else:
            result = dataclasses.replace(j.result, figure=f"{j.result.figure}; {figure} (relative check)")
        out[node] = dataclasses.replace(j, result=result)
    return out
