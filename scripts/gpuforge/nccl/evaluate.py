"""Judge a parsed nccl-tests run: data check, completeness, transport, and busbw against a baseline.

The verdict is FAIL when any defect is found, PASS only when the bandwidth was compared with a
baseline for this instance type, collective and node count and reached the threshold, and SKIP
(reported, never passed) when there is nothing to compare with.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from gpuforge import instance_types
from gpuforge.errors import UserError
from gpuforge.nccl import baseline
from gpuforge.nccl.collective import Identity, identify
from gpuforge.nccl.parse import Run

# The seed rule from the issue: below 90% of the expected busbw, something is wrong.
THRESHOLD = 0.90
# The PNG marks 1 GiB: by then per-call latency is negligible and busbw plateaus.
LARGE_MESSAGE_BYTES = 1 << 30


class Verdict(enum.StrEnum):
    PASS = "PASS"  # noqa: S105 (a verdict, not a password)
    FAIL = "FAIL"
    # Not judged: nothing to compare the bandwidth with; reported, never counted as a pass.
    SKIP = "SKIP"


@dataclass(frozen=True)
class Settings:
    instance_type: str
    baseline_file: Path
    table: baseline.Table
    threshold: float = THRESHOLD
    nodes: int | None = None
    collective: str | None = None
    # Judge a run larger than every recorded node count against the largest (nccl-report, which
    # says so in the baseline's description); `gpuforge accept` turns it off (not judged instead).
    beyond_largest: bool = True


@dataclass(frozen=True)
class Evaluation:
    run: Run
    instance_type: str
    identity: Identity
    nodes: int | None
    choice: baseline.Choice | None
    threshold: float
    busbw_gb_s: float | None
    verdict: Verdict
    # Defects first (each one fails the run), then what the report notes.
    failures: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def reasons(self) -> tuple[str, ...]:
        return self.failures + self.notes

    @property
    def expected_gb_s(self) -> float | None:
        return None if self.choice is None else self.choice.entry.busbw_gb_s

    @property
    def ratio(self) -> float | None:
        if self.busbw_gb_s is None or self.expected_gb_s is None:
            return None
        return self.busbw_gb_s / self.expected_gb_s


def settings(
    instance_type: str,
    baseline_file: Path | None = None,
    threshold: float = THRESHOLD,
    nodes: int | None = None,
    collective: str | None = None,
) -> Settings:
    """Validated settings; UserError for an unknown or GPU-less type or a bad threshold."""
    facts = instance_types.get(instance_type)
    if not facts.gpus:
        raise UserError(f"{instance_type} has no GPUs; nccl-tests results are judged on GPU instance types")
    if not 0 < threshold <= 1:
        raise UserError(f"threshold must be in (0, 1], got {threshold}")
    if nodes is not None and nodes < 1:
        raise UserError(f"--nodes must be 1 or more, got {nodes}")
    path = baseline_file or baseline.default_file()
    return Settings(instance_type, path, baseline.load(path), threshold, nodes, collective)


def node_count(run: Run, stated: int | None) -> tuple[int | None, str]:
    if stated is not None:
        return stated, "--nodes"
    if run.hosts:
        return len(run.hosts), "the log's device list"
    if run.network.nodes:
        return run.network.nodes, "NCCL INFO nNodes"
    return None, "unknown"


def _defects(run: Run, nodes: int | None, efa: bool) -> list[str]:
    found = []
    if run.wrong_rows:
        sizes = ", ".join(str(r.size_bytes) for r in run.wrong_rows)
        found.append(f"data check failed (#wrong > 0 at sizes {sizes}): results are corrupt")
    if (run.out_of_bounds or 0) > 0:
        found.append(f"{run.out_of_bounds} out-of-bounds values: results are corrupt")
    if not run.complete:
        found.append(
            "no '# Avg bus bandwidth' summary: the run did not finish (killed, timed out or cut)"
            + (" or the log is an excerpt" if run.elided or not run.devices else "")
        )
    multi_node_efa = efa and nodes is not None and nodes > 1
    if efa and nodes is None and run.network.uses_socket:
        found.append(
            "NCCL used sockets ('Using network Socket') on an EFA instance type and the node "
            "count is unknown: a multi-node run must not use sockets (pass --nodes 1 if it was one node)"
        )
    if multi_node_efa and run.network.uses_socket:
        found.append(
            "NCCL fell back to sockets ('Using network Socket') on an EFA instance type: "
            "the aws-ofi-nccl plugin was not loaded or found no EFA device"
        )
    if multi_node_efa and run.network.uses_ofi and run.network.non_efa_providers:
        providers = ", ".join(run.network.non_efa_providers)
        found.append(f"the OFI plugin used libfabric provider {providers}, not efa")
    return found


def evaluate(run: Run, config: Settings) -> Evaluation:
    facts = instance_types.get(config.instance_type)
    identity = identify(run, config.collective)
    nodes, nodes_from = node_count(run, config.nodes)
    failures = _defects(run, nodes, facts.efa_interfaces > 0)
    notes = [f"collective: {identity.label} ({identity.how})", f"network: {run.network.describe()}"]
    if run.unparsed_rows:
        notes.append(f"{run.unparsed_rows} table line(s) did not match the header (cut or garbled)")
    choice, busbw, judged, passed = None, None, "", False
    if nodes is None:
        judged = "node count unknown (the log lists no '# Rank' devices): pass --nodes to judge the bandwidth"
    elif identity.name is None:
        judged = "bandwidth not judged: the collective is unknown (pass --collective if you know it)"
    else:
        choice = baseline.choose(
            config.table,
            config.baseline_file,
            config.instance_type,
            identity.name,
            nodes,
            config.beyond_largest,
        )
        if choice is None:
            kind = "intra-node (1-node)" if nodes == 1 else f"{nodes}-node"
            judged = (
                f"bandwidth not judged: {config.baseline_file.name} has no {kind} {identity.name} baseline "
                f"for {config.instance_type} (record one with `gpuforge nccl-baseline`)"
            )
    if choice is not None:
        entry = choice.entry
        sizes = [r for r in run.rows if r.size_bytes >= entry.size_bytes]
        notes.append(f"baseline: {choice.describe()}")
        if not sizes:
            # Not a defect of the run, but busbw at smaller sizes is lower by design: not comparable.
            largest = max(r.size_bytes for r in run.rows)
            notes.append(
                f"bandwidth not judged: largest message {largest} B is below the baseline's "
                f"{entry.size_bytes} B; run up to -e {entry.size_bytes} to compare"
            )
        else:
            busbw = max(r.busbw_gb_s for r in sizes)
            share = (
                f"busbw {busbw:.2f} GB/s at >= {entry.size_bytes} B "
                f"is {busbw / entry.busbw_gb_s:.0%} of the baseline"
            )
            if busbw < config.threshold * entry.busbw_gb_s:
                failures.append(f"{share}, below {config.threshold:.0%}")
            else:
                passed = True
                notes.append(f"{share} (gate {config.threshold:.0%})")
    elif judged:
        notes.append(judged)
    if nodes is not None:
        notes.append(f"nodes: {nodes} (from {nodes_from})")
    verdict = Verdict.FAIL if failures else Verdict.PASS if passed else Verdict.SKIP
    return Evaluation(
        run,
        config.instance_type,
        identity,
        nodes,
        choice,
        config.threshold,
        busbw,
        verdict,
        tuple(failures),
        tuple(notes),
    )
