"""One acceptance run of `gpuforge accept`, with typed values: the nodes found and checked, the stages run,
the report written and the nodes that fell short drained (docs/accept.md)."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuforge import instance_types
from gpuforge.accept import plan, report, slurm
from gpuforge.accept.stages import Options, SlurmTester
from gpuforge.errors import ExternalError, UserError
from gpuforge.nccl import baseline
from gpuforge.nccl.evaluate import Settings, settings

# dcgmi diag levels and how long NVIDIA says each takes (dcgmi-diag reference, --run: level 1 "normally
# lasting seconds", 2 "approximately two minutes", 3 "approximately 15 minutes", 4 "extended"; no figure
# is published for 4, the projection assumes an hour). Level 2 fits the "few minutes" a node stage should
# take and is the first that loads the GPUs (the memory test and the PCIe plugin).
DCGM_LEVEL = 2
DCGM_S = {1: 60.0, 2: 150.0, 3: 960.0, 4: 3600.0}
# Everything passed, but some pair or doubling result had no baseline to be judged against.
EXIT_UNJUDGED = 3
# One all_reduce_perf from 8 B to 8 GiB, 20 iterations a size, with NCCL's start-up: alone, and over EFA.
ALONE_ALLREDUCE_S = 120.0
MULTI_ALLREDUCE_S = 180.0
# The EFA loopbacks, every device at once: a second's wait for the servers plus the exchanges.
LOOPBACK_S = 5.0


@dataclass(frozen=True)
class Request:
    """`gpuforge accept`'s options."""

    instance_type: str
    partition: str | None
    nodes: str | None  # a Slurm node list
    dcgm_level: int
    baseline_file: Path | None
    threshold: float
    report_only: bool
    accept_unjudged: bool
    out: Path | None
    all_reduce: str
    health: str
    efa_bin: str
    max_bytes: str
    iters: int
    time_limit_min: int


@dataclass
class Prepared:
    """What is about to be tested, and where its report goes; nothing has run on the nodes yet."""

    request: Request
    testable: list[slurm.Node]
    not_tested: dict[str, str]
    estimate: plan.Projection
    nccl: Settings
    out: Path
    runner: slurm.Slurm
    options: Options


def projection(nodes: int, dcgm_level: int, efa_devices: int) -> plan.Projection:
    node_stage = DCGM_S[dcgm_level] + (LOOPBACK_S if efa_devices else 0.0) + ALONE_ALLREDUCE_S
    return plan.Projection(nodes, node_stage, MULTI_ALLREDUCE_S, MULTI_ALLREDUCE_S)


def check_time_limit(estimate: plan.Projection, time_limit_min: int, dcgm_level: int) -> None:
    """Refuse a --time-limit that a stage's job would hit: its nodes would end with no result."""
    for stage, seconds in (("node stage", estimate.node_stage_s), ("pair round", estimate.pair_round_s)):
        if seconds > time_limit_min * 60:
            need = int(-(-seconds * 1.25 // 60))
            raise UserError(
                f"the {stage} is projected at {seconds / 60:.0f} min (dcgmi diag level {dcgm_level}), over "
                f"--time-limit {time_limit_min}: pass --time-limit {need} or more, or a lower --dcgm-level"
            )


def warn_baselines(nccl: Settings, nodes: int) -> list[str]:
    """What the baseline file cannot judge in this run, said before it starts."""
    table, file, itype = nccl.table, nccl.baseline_file, nccl.instance_type
    warnings = []
    if baseline.choose(table, file, itype, "all_reduce", 1) is None:
        warnings.append(
            f"WARNING: {file.name} has no 1-node all_reduce baseline for {itype}: the node stage's NVLink "
            f"all_reduce is judged only against the other nodes of this run (below {nccl.threshold:.0%} of "
            "their median fails); record one with `gpuforge nccl-baseline` (docs/accept.md)"
        )
    missing = [
        n
        for n in plan.doubling_sizes(nodes)
        if baseline.choose(table, file, itype, "all_reduce", n, False) is None
    ]
    if missing:
        warnings.append(
            f"WARNING: {file.name} has no all_reduce baseline for {itype} at "
            f"{', '.join(map(str, missing))} nodes (nor a larger count): those steps are not judged, and the "
            "cluster is not accepted (exit 3) unless --accept-unjudged"
        )
    return warnings


def _partition(partition: str | None, nodes: list[slurm.Node]) -> str | None:
    if partition:
        return str(partition)
    shared = set.intersection(*(set(n.partitions) for n in nodes)) if nodes else set()
    if not shared:
        raise UserError("the nodes share no partition: pass --partition, or a node list of one partition")
    return sorted(shared)[0]


def prepare(request: Request) -> Prepared:
    """The testable nodes, the projection and the report folder; a UserError before any job is sent."""
    nccl = settings(request.instance_type, request.baseline_file, request.threshold, None, "all_reduce")
    facts = instance_types.get(request.instance_type)
    slurm.require()
    found = slurm.find_nodes(request.partition, request.nodes)
    not_tested = {n.name: why for n in found if (why := n.untestable)}
    testable = [n for n in found if n.name not in not_tested]
    if not testable:
        raise UserError(f"no node can be tested now: {'; '.join(f'{k}: {v}' for k, v in not_tested.items())}")
    gres = {n.gpus for n in testable}
    if len(gres) > 1:
        raise UserError(
            f"the nodes list different GPU counts in Slurm ({sorted(gres)}): accept one type at a time"
        )
    estimate = projection(len(testable), request.dcgm_level, facts.efa_interfaces)
    check_time_limit(estimate, request.time_limit_min, request.dcgm_level)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out: Path = request.out or Path(f"gpuforge-accept-{stamp}")
    workdir = out / "logs"
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {workdir}: {exc.strerror or exc}") from exc
    options = Options(
        instance_type=request.instance_type,
        gpus=facts.gpus,
        efa_devices=facts.efa_interfaces,
        gres_gpus=gres.pop(),
        nccl=nccl,
        dcgm_level=request.dcgm_level,
        all_reduce=request.all_reduce,
        health=request.health,
        efa_bin=request.efa_bin,
        max_bytes=request.max_bytes,
        iters=request.iters,
    )
    runner = slurm.Slurm(
        workdir, _partition(request.partition, testable), request.time_limit_min, "gpuforge-accept"
    )
    return Prepared(request, testable, not_tested, estimate, nccl, out, runner, options)


@dataclass(frozen=True)
class Outcome:
    acceptance: plan.Acceptance
    drained: dict[str, str]  # node: the reason it was drained with
    drain_errors: dict[str, str]  # node: why draining it failed

    @property
    def exit_code(self) -> int:
        if self.acceptance.accepted:
            return 0
        return EXIT_UNJUDGED if self.acceptance.passed_all and self.acceptance.unjudged_multi else 1


def run(prepared: Prepared, progress: Callable[[str], None]) -> Outcome:
    """Run the stages, write the report, then drain what fell short (unless report_only). Whatever ran is
    kept when a stage fails or is interrupted: the node stage's judgements and every finished step's log."""
    request = prepared.request
    tester = SlurmTester(prepared.runner, prepared.options, progress)
    started = datetime.datetime.now(datetime.UTC)
    context: dict[str, Any] = {
        "instance_type": request.instance_type,
        "partition": prepared.runner.partition,
        "dcgm_level": request.dcgm_level,
        "threshold": request.threshold,
        "baseline_file": str(prepared.nccl.baseline_file),
        "report_only": bool(request.report_only),
        "accept_unjudged": bool(request.accept_unjudged),
        "started": started.isoformat(),
        **report.projection_context(prepared.estimate),
    }
    try:
        acceptance = plan.run(
            [n.name for n in prepared.testable],
            tester,
            prepared.not_tested,
            progress,
            accept_unjudged=request.accept_unjudged,
        )
    except (UserError, ExternalError, KeyboardInterrupt) as exc:
        report.write_partial(prepared.out, {**context, **_tested(tester)}, f"{type(exc).__name__}: {exc}")
        raise
    logs = {" ".join(m.nodes): str(m.log) for m in tester.multi}
    drained: dict[str, str] = {}
    drain_errors: dict[str, str] = {}

    def write() -> None:
        context["wall_s"] = (datetime.datetime.now(datetime.UTC) - started).total_seconds()
        document = report.to_dict(acceptance, {**context, **_tested(tester)}, drained, logs)
        document["drain_errors"] = drain_errors
        report.write(prepared.out, document, acceptance, request.threshold)

    # The report first: a drain that fails (not root, slurmctld gone) must not lose the results.
    write()
    if not request.report_only and acceptance.to_drain:
        try:
            for verdict in acceptance.to_drain:
                try:
                    prepared.runner.drain(verdict.node, verdict.drain_reason)
                    drained[verdict.node] = verdict.drain_reason
                except (UserError, ExternalError) as exc:
                    drain_errors[verdict.node] = str(exc)
        finally:
            write()
    return Outcome(acceptance, drained, drain_errors)


def _tested(tester: SlurmTester) -> dict[str, Any]:
    return {
        "node_stage": {
            n: {"health": j.health.get("results", []), "efa": j.efa, "notes": list(j.notes)}
            for n, j in tester.node_judgements.items()
        },
        "steps_run": [
            {
                "nodes": list(m.nodes),
                "log": str(m.log),
                "verdict": m.judgement.verdict.value,
                "figure": m.judgement.figure,
            }
            for m in tester.multi
        ],
    }
