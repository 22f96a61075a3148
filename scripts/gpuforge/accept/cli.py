"""`gpuforge accept`: the field guide's acceptance test of a Slurm partition or node list."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any

from gpuforge import instance_types
from gpuforge.accept import plan, report, slurm
from gpuforge.accept.stages import Options, SlurmTester
from gpuforge.cliargs import existing_file, positive_int
from gpuforge.errors import ExternalError, UserError
from gpuforge.nccl import baseline
from gpuforge.nccl.evaluate import THRESHOLD, Settings, settings

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


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "accept",
        help="acceptance test of a Slurm cluster: nodes alone, pairs over EFA, doubling; drains bad nodes",
        description="Run on the head node. Stage 1: every node alone at once (gpuforge-health with dcgmi "
        "diag, each EFA device's fi_pingpong loopback, an all_reduce over the node's own GPUs). Stage 2: "
        "disjoint pairs over EFA; each node of a pair that falls short is re-paired with a node that passed. "
        f"Stage 3: all_reduce on 2, 4, 8 ... N nodes against {THRESHOLD:.0%} of the baseline for each "
        "node count. Nodes that fail are drained with the stage and the figure, unless --report-only. "
        "Exit status 0: accepted; 1: not accepted; 3: everything passed but some pair or doubling result "
        "had no baseline to be judged against (see --accept-unjudged).",
    )
    p.add_argument("--partition", help="the Slurm partition (ParallelCluster queue) to accept")
    p.add_argument("--nodes", metavar="LIST", help="Slurm node list to accept, e.g. gpu-st-p5-[1-64]")
    p.add_argument("--instance-type", required=True, help="the nodes' EC2 type, e.g. p5.48xlarge")
    p.add_argument(
        "--dcgm-level",
        type=int,
        choices=sorted(DCGM_S),
        default=DCGM_LEVEL,
        help=f"dcgmi diag level of the node stage (default {DCGM_LEVEL}, about two minutes; 3 takes ~15)",
    )
    p.add_argument(
        "--baseline",
        type=existing_file,
        metavar="FILE",
        help="baseline file from `gpuforge nccl-baseline` instead of data/nccl_baselines.yml",
    )
    p.add_argument(
        "--threshold", type=float, default=THRESHOLD, help=f"fraction of the baseline (default {THRESHOLD})"
    )
    p.add_argument("--report-only", action="store_true", help="report what would be drained; drain nothing")
    p.add_argument(
        "--accept-unjudged",
        action="store_true",
        help="accept pair and doubling results that had no baseline for their node count (default: not "
        "accepted, exit 3)",
    )
    p.add_argument("--out", type=Path, metavar="DIR", help="report folder (default ./gpuforge-accept-<time>)")
    p.add_argument(
        "--all-reduce", default="/opt/nccl-tests/build/all_reduce_perf", help="all_reduce_perf on the nodes"
    )
    p.add_argument("--health", default="/usr/local/sbin/gpuforge-health", help="gpuforge-health on the nodes")
    p.add_argument(
        "--efa-bin", default="/opt/amazon/efa/bin", help="the EFA installer's fi_info and fi_pingpong"
    )
    p.add_argument(
        "--max-bytes", default="8G", help="largest all_reduce message (default 8G, the baselines' size)"
    )
    p.add_argument(
        "--iters", type=positive_int, default=20, help="timed iterations per message size (default 20)"
    )
    p.add_argument(
        "--time-limit",
        type=positive_int,
        default=60,
        metavar="MIN",
        help="limit of each stage's job (default 60)",
    )
    p.set_defaults(handler=handle)


class Progress:
    """The progress line while the stages run: rewritten in place on a terminal, else one line a change."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = ""

    def __call__(self, line: str) -> None:
        if line == self.last:
            return
        self.last = line
        if self.tty:
            sys.stderr.write(f"\r\033[K{line}")
        else:
            sys.stderr.write(f"{line}\n")
        sys.stderr.flush()

    def end(self) -> None:
        if self.tty and self.last:
            sys.stderr.write("\n")


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


def _partition(args: argparse.Namespace, nodes: list[slurm.Node]) -> str | None:
    if args.partition:
        return str(args.partition)
    shared = set.intersection(*(set(n.partitions) for n in nodes)) if nodes else set()
    if not shared:
        raise UserError("the nodes share no partition: pass --partition, or a node list of one partition")
    return sorted(shared)[0]


def handle(args: argparse.Namespace) -> int:
    nccl = settings(args.instance_type, args.baseline, args.threshold, None, "all_reduce")
    facts = instance_types.get(args.instance_type)
    slurm.require()
    found = slurm.find_nodes(args.partition, args.nodes)
    not_tested = {n.name: why for n in found if (why := n.untestable)}
    testable = [n for n in found if n.name not in not_tested]
    if not testable:
        raise UserError(f"no node can be tested now: {'; '.join(f'{k}: {v}' for k, v in not_tested.items())}")
    gres = {n.gpus for n in testable}
    if len(gres) > 1:
        raise UserError(
            f"the nodes list different GPU counts in Slurm ({sorted(gres)}): accept one type at a time"
        )
    estimate = projection(len(testable), args.dcgm_level, facts.efa_interfaces)
    check_time_limit(estimate, args.time_limit, args.dcgm_level)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out: Path = args.out or Path(f"gpuforge-accept-{stamp}")
    workdir = out / "logs"
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {workdir}: {exc.strerror or exc}") from exc
    options = Options(
        instance_type=args.instance_type,
        gpus=facts.gpus,
        efa_devices=facts.efa_interfaces,
        gres_gpus=gres.pop(),
        nccl=nccl,
        dcgm_level=args.dcgm_level,
        all_reduce=args.all_reduce,
        health=args.health,
        efa_bin=args.efa_bin,
        max_bytes=args.max_bytes,
        iters=args.iters,
    )
    runner = slurm.Slurm(workdir, _partition(args, testable), args.time_limit, "gpuforge-accept")
    print(
        f"gpuforge accept: {len(testable)} nodes ({len(not_tested)} not testable now); {estimate.describe()}"
    )
    for warning in warn_baselines(nccl, len(testable)):
        print(warning, file=sys.stderr)
    progress = Progress()
    tester = SlurmTester(runner, options, progress)
    started = datetime.datetime.now(datetime.UTC)
    context: dict[str, Any] = {
        "instance_type": args.instance_type,
        "partition": runner.partition,
        "dcgm_level": args.dcgm_level,
        "threshold": args.threshold,
        "baseline_file": str(nccl.baseline_file),
        "report_only": bool(args.report_only),
        "accept_unjudged": bool(args.accept_unjudged),
        "started": started.isoformat(),
        **report.projection_context(estimate),
    }
    try:
        acceptance = plan.run(
            [n.name for n in testable], tester, not_tested, progress, accept_unjudged=args.accept_unjudged
        )
    except (UserError, ExternalError, KeyboardInterrupt) as exc:
        # Whatever ran is kept: the node stage's judgements and every finished step's log.
        progress.end()
        report.write_partial(out, {**context, **_tested(tester)}, f"{type(exc).__name__}: {exc}")
        raise
    progress.end()
    logs = {" ".join(m.nodes): str(m.log) for m in tester.multi}
    drained: dict[str, str] = {}
    drain_errors: dict[str, str] = {}

    def write() -> None:
        context["wall_s"] = (datetime.datetime.now(datetime.UTC) - started).total_seconds()
        document = report.to_dict(acceptance, {**context, **_tested(tester)}, drained, logs)
        document["drain_errors"] = drain_errors
        report.write(out, document, acceptance, args.threshold)

    # The report first: a drain that fails (not root, slurmctld gone) must not lose the results.
    write()
    if not args.report_only and acceptance.to_drain:
        try:
            for verdict in acceptance.to_drain:
                try:
                    runner.drain(verdict.node, verdict.drain_reason)
                    drained[verdict.node] = verdict.drain_reason
                except (UserError, ExternalError) as exc:
                    drain_errors[verdict.node] = str(exc)
        finally:
            write()
    for line in report.summary(acceptance, args.instance_type, drained, args.report_only, out, drain_errors):
        print(line)
    if acceptance.accepted:
        return 0
    return EXIT_UNJUDGED if acceptance.passed_all and acceptance.unjudged_multi else 1


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
