"""The stages on a Slurm cluster: plan.Tester implemented with salloc/srun, each result judged.

Stage 1 runs scripts/slurm/gpuforge-accept-node.sh on every node (one task per node). The pairs and
the doubling steps run all_reduce_perf over EFA as scripts/slurm/nccl-allreduce.sbatch does and as
the baselines were measured: one rank per GPU (--ntasks-per-node=GPUS, -g 1, --cpu-bind=none) by
srun --mpi=pmix, with that script's environment (EFA provider forced, NCCL INIT/NET logging that the
judge reads to prove EFA was used). Where Slurm lists no GPU for the nodes (no gres.conf: not a
ParallelCluster GPU queue) there is no GPU to bind a rank to, and one process per node drives the
type's GPUs (-g GPUS).
"""

from __future__ import annotations

import dataclasses
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuforge import paths
from gpuforge.accept import nodecheck
from gpuforge.accept.plan import Pair, Result
from gpuforge.accept.slurm import Allocation, Slurm
from gpuforge.errors import UserError
from gpuforge.nccl.evaluate import Settings, Verdict
from gpuforge.nccl.judge import Judgement, judge_log

# scripts/slurm/nccl-allreduce.sbatch's environment for a multi-node all_reduce (tests/test_accept_node.py
# holds the two equal): libraries of the EFA installer and CUDA, the EFA provider forced so that a
# missing EFA fails instead of falling back to TCP, and the NCCL logging that shows the network used.
NCCL_ENV = {
    "LD_LIBRARY_PATH": ":".join(
        (
            "/opt/amazon/ofi-nccl/lib",
            "/opt/amazon/efa/lib",
            "/opt/amazon/openmpi/lib",
            "/usr/local/cuda/lib64",
        )
    ),
    "FI_PROVIDER": "efa",
    "FI_EFA_FORK_SAFE": "1",
    "NCCL_DEBUG": "INFO",
    "NCCL_DEBUG_SUBSYS": "INIT,NET",
    "NCCL_SOCKET_IFNAME": "^docker,lo,veth",
    # Open MPI's own messages off EFA and off Docker's bridge, and the PMIx datastore slurmstepd's and
    # Open MPI's PMIx share (the script says why, with its sources).
    "OMPI_MCA_pml": "^cm,ucx",
    "OMPI_MCA_btl": "tcp,self",
    "OMPI_MCA_btl_tcp_if_exclude": "lo,docker0,veth_def_agent",
    "PMIX_MCA_gds": "hash",
}
# Run on each node before all_reduce_perf, as scripts/slurm/nccl-allreduce.sbatch does: source the
# nccl_tests role's launch environment (<prefix>/env beside the binary's build/ directory) and put the
# adopted build's library directory (NCCL_TESTS_LIBRARY_PATH, empty for gpuforge's own build) first on
# LD_LIBRARY_PATH. Arguments: the binary, then its arguments.
LAUNCH = (
    'env_file="$(dirname "$(dirname "$1")")/env"; NCCL_TESTS_LIBRARY_PATH=""; '
    'if [ -r "$env_file" ]; then . "$env_file"; fi; '
    'export LD_LIBRARY_PATH="${NCCL_TESTS_LIBRARY_PATH:+$NCCL_TESTS_LIBRARY_PATH:}$LD_LIBRARY_PATH"; '
    'exec "$@"'
)
POLL_S = 2.0
# What every node runs in stage 1 (the wheel carries scripts/slurm with the collection).
NODE_CHECK = "scripts/slurm/gpuforge-accept-node.sh"


@dataclass(frozen=True)
class Options:
    instance_type: str
    gpus: int  # per node, from the instance type
    efa_devices: int  # per node, from the instance type
    gres_gpus: int  # GPUs Slurm lists for the nodes (requested per step where non-zero)
    nccl: Settings  # the baseline table, threshold and collective every all_reduce is judged with
    dcgm_level: int
    all_reduce: str
    health: str
    efa_bin: str
    max_bytes: str
    iters: int


@dataclass
class PairLog:
    nodes: tuple[str, ...]
    log: Path
    judgement: Judgement


Progress = Callable[[str], None]


def node_check_script() -> str:
    """scripts/slurm/gpuforge-accept-node.sh, from the checkout or the installed collection."""
    path = paths.share_root() / NODE_CHECK
    try:
        return path.read_text()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from exc


def srun_said(log: str) -> str:
    """srun's own last message in a labelled log (its lines carry no task label): a time limit, a
    launch error."""
    said = [line for line in log.splitlines() if line.startswith(("srun:", "slurmstepd:"))]
    return f" ({said[-1].strip()[:200]})" if said else ""


class SlurmTester:
    """plan.Tester on Slurm; keeps every judgement for the report."""

    def __init__(self, slurm: Slurm, options: Options, progress: Progress) -> None:
        self.slurm = slurm
        self.options = options
        self.progress = progress
        self.node_judgements: dict[str, nodecheck.NodeJudgement] = {}
        self.multi: list[PairLog] = []
        self._round = 0

    def _judge_multi(self, nodes: Sequence[str], log: Path, rc: int | None) -> Result:
        # Only the entry for this node count or the next larger: never a 2-node figure for 64 nodes.
        config = dataclasses.replace(self.options.nccl, nodes=len(nodes), beyond_largest=False)
        text = log.read_text(errors="replace") if log.exists() else ""
        judgement = judge_log(text, config, log.name, rc, "srun")
        self.multi.append(PairLog(tuple(nodes), log, judgement))
        return Result(
            judgement.verdict is not Verdict.FAIL,
            judgement.figure,
            judgement.busbw_gb_s,
            judgement.expected_gb_s,
            judged=judgement.verdict is Verdict.PASS,
        )

    def _all_reduce(self, allocation: Allocation, nodes: Sequence[str], log: Path) -> subprocess.Popen[str]:
        o = self.options
        ranks = o.gres_gpus or 1
        command = [
            "bash",
            "-c",
            LAUNCH,
            "nccl-tests",
            o.all_reduce,
            "-b",
            "8",
            "-e",
            o.max_bytes,
            "-f",
            "2",
            "-g",
            "1" if o.gres_gpus else str(o.gpus),
            "-c",
            "1",
            "-n",
            str(o.iters),
        ]
        return self.slurm.start_step(
            allocation,
            nodes,
            command,
            log,
            mpi=True,
            gpus_per_node=o.gres_gpus,
            env=NCCL_ENV,
            tasks_per_node=ranks,
        )

    def _wait(self, procs: Sequence[subprocess.Popen[str]], what: str) -> list[int]:
        while True:
            done = sum(p.poll() is not None for p in procs)
            self.progress(f"{what}: {done}/{len(procs)} done")
            if done == len(procs):
                return [p.returncode for p in procs]
            time.sleep(POLL_S)

    def nodes_alone(self, nodes: Sequence[str]) -> Mapping[str, Result]:
        o = self.options
        allocation = self.slurm.allocate(nodes, "node", o.gres_gpus)
        log = self.slurm.workdir / "node-stage.log"
        try:
            command = [
                "bash", "-c", node_check_script(), "gpuforge-accept-node",
                o.health, str(o.dcgm_level), o.efa_bin, str(o.gpus), o.all_reduce, o.max_bytes, str(o.iters),
            ]  # fmt: skip
            proc = self.slurm.start_step(
                allocation, nodes, command, log, mpi=False, gpus_per_node=o.gres_gpus, label=True
            )
            (rc,) = self._wait([proc], f"stage 1/3: {len(nodes)} nodes alone")
        finally:
            self.slurm.release(allocation)
        text = log.read_text(errors="replace")
        outputs = nodecheck.split(text)
        step_failed = None if rc == 0 else f"the node stage's srun exited {rc}{srun_said(text)}"
        config = dataclasses.replace(o.nccl, nodes=1)
        judgements = {
            node: nodecheck.judge(outputs.get(node), node, config, o.gpus, o.efa_devices, step_failed)
            for node in nodes
        }
        self.node_judgements.update(nodecheck.relative(judgements, o.nccl.threshold))
        return {n: self.node_judgements[n].result for n in nodes}

    def pairs(self, pairs: Sequence[Pair]) -> Mapping[Pair, Result]:
        self._round += 1
        members = [n for p in pairs for n in p]
        allocation = self.slurm.allocate(members, f"pairs-{self._round}", self.options.gres_gpus)
        logs = [self.slurm.workdir / f"pair-r{self._round}-{a}-{b}.log" for a, b in pairs]
        try:
            procs = [self._all_reduce(allocation, pair, log) for pair, log in zip(pairs, logs, strict=True)]
            codes = self._wait(procs, f"stage 2/3: pairs round {self._round}")
        finally:
            self.slurm.release(allocation)
        return {
            pair: self._judge_multi(pair, log, rc) for pair, log, rc in zip(pairs, logs, codes, strict=True)
        }

    def step(self, nodes: Sequence[str]) -> Result:
        allocation = self.slurm.allocate(nodes, f"doubling-{len(nodes)}", self.options.gres_gpus)
        log = self.slurm.workdir / f"doubling-{len(nodes)}.log"
        try:
            (rc,) = self._wait([self._all_reduce(allocation, nodes, log)], f"stage 3/3: {len(nodes)} nodes")
        finally:
            self.slurm.release(allocation)
        return self._judge_multi(nodes, log, rc)
