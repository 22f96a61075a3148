"""Slurm, as `gpuforge accept` drives it from the head node: sinfo/scontrol to find nodes, salloc for one
allocation per stage, srun for the steps inside it, scontrol to drain.

Each stage is one job (salloc --no-shell, --exclusive, --no-kill: a node lost in the middle ends its
own step, not the job) with one step per pair or doubling step, or, for the node stage, one step with
one independent task per node. The steps are started from the head node, so their output comes back
over srun's own connection and no shared filesystem is needed; nothing here is one MPI job over the
whole cluster (runs of a few hundred nodes as one job are what fails). sacct is not used: a
ParallelCluster cluster keeps no job accounting unless one configures slurmdbd.
"""

from __future__ import annotations

import getpass
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from gpuforge.errors import ExternalError, UserError

COMMANDS = ("sinfo", "scontrol", "salloc", "srun", "scancel")
# Base states a node can be tested in; the rest (DOWN, DRAIN..., FAIL, FUTURE) say why it cannot. A node
# running a job (ALLOCATED, MIXED, COMPLETING) is left out rather than waited for: an exclusive salloc
# would queue behind that job for as long as it runs.
_TESTABLE = {"IDLE"}
_BUSY = {"MIXED", "ALLOCATED", "COMPLETING"}
_UNTESTABLE_FLAGS = {
    "DRAIN",
    "DRAINING",
    "DRAINED",
    "FAIL",
    "NOT_RESPONDING",
    "MAINTENANCE",
    "REBOOT_REQUESTED",
}
_GRANTED_RE = re.compile(r"Granted job allocation (\d+)")
_GPU_GRES_RE = re.compile(r"(?:^|,)gpu(?::[^:,()]+)?:(\d+)")


@dataclass(frozen=True)
class Node:
    name: str
    state: str
    partitions: tuple[str, ...]
    gpus: int  # GPUs in Slurm's Gres for the node (0 where Slurm lists none)
    reason: str = ""

    @property
    def untestable(self) -> str | None:
        """Why the node cannot be tested now, or None."""
        parts = set(self.state.upper().split("+"))
        base = self.state.upper().split("+")[0]
        flags = sorted(parts & _UNTESTABLE_FLAGS)
        if base in _BUSY and not flags:
            return f"busy: state {self.state} (a job runs there; accept it again when the job ends)"
        if base not in _TESTABLE or flags:
            why = f"state {self.state}"
            return f"{why} ({self.reason})" if self.reason else why
        return None


def require() -> None:
    """Slurm's commands on PATH, or a UserError saying where to run."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        raise UserError(
            f"Slurm's commands are not on PATH ({', '.join(missing)} not found): run gpuforge accept on the "
            "cluster's head node (ParallelCluster puts them in /opt/slurm/bin)"
        )


def _run(argv: Sequence[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as exc:
        raise UserError(f"{argv[0]} not found: run gpuforge accept on the cluster's head node") from exc
    except subprocess.TimeoutExpired as exc:
        raise ExternalError(
            f"{' '.join(argv[:3])} did not answer in {timeout:.0f} s: is slurmctld up?"
        ) from exc
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise ExternalError(f"{' '.join(argv[:3])} failed: {detail[-1] if detail else proc.returncode}")
    return proc


def parse_nodes(text: str) -> list[Node]:
    """`scontrol --oneliner show node` output as nodes."""
    nodes = []
    for line in text.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "NodeName" not in fields:
            continue
        gres = _GPU_GRES_RE.search(fields.get("Gres", ""))
        reason = line.split(" Reason=", 1)[1].strip() if " Reason=" in line else ""
        nodes.append(
            Node(
                name=fields["NodeName"],
                state=fields.get("State", "UNKNOWN"),
                partitions=tuple(p for p in fields.get("Partitions", "").split(",") if p),
                gpus=int(gres.group(1)) if gres else 0,
                reason=reason,
            )
        )
    return nodes


def hostnames(expression: str) -> list[str]:
    """A Slurm node list expression (gpu-st-p5-[1-4,7]) as names, by scontrol."""
    try:
        return _run(["scontrol", "show", "hostnames", expression]).stdout.split()
    except ExternalError as exc:
        # A malformed --nodes is the user's to fix, not an outage.
        raise UserError(f"--nodes {expression!r} is not a Slurm node list: {exc}") from exc


def hostlist(names: Sequence[str]) -> str:
    """Names as one compressed Slurm node list (gpu-st-p5-[1-1000]): short on any command line."""
    return _run(["scontrol", "show", "hostlist", ",".join(names)]).stdout.strip()


def find_nodes(partition: str | None, nodelist: str | None) -> list[Node]:
    """The nodes of a partition and/or a node list, as slurmctld sees them now."""
    if partition is None and nodelist is None:
        raise UserError("name the nodes to accept: --partition NAME and/or --nodes LIST")
    names: list[str] | None = hostnames(nodelist) if nodelist else None
    if partition is not None:
        listed = _run(
            ["sinfo", "--noheader", "--Node", "--partition", partition, "--format=%N"]
        ).stdout.split()
        if not listed:
            raise UserError(f"partition {partition} has no nodes (sinfo --partition {partition})")
        in_partition = set(listed)
        names = [n for n in names if n in in_partition] if names is not None else sorted(in_partition)
        if not names:
            raise UserError(f"none of {nodelist} is in partition {partition}")
    assert names is not None
    found = parse_nodes(_run(["scontrol", "--oneliner", "show", "node", ",".join(names)]).stdout)
    unknown = sorted(set(names) - {n.name for n in found})
    if unknown:
        raise UserError(f"Slurm does not know node(s) {', '.join(unknown)}")
    return sorted(found, key=lambda n: n.name)


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: tuple[str, ...]


class Slurm:
    """The calls one acceptance run makes; `workdir` keeps the node files and every step's log."""

    def __init__(self, workdir: Path, partition: str | None, time_limit_min: int, job_name: str) -> None:
        self.workdir = workdir
        self.partition = partition
        self.time_limit_min = time_limit_min
        self.job_name = job_name

    def allocate(self, nodes: Sequence[str], stage: str, gpus_per_node: int) -> Allocation:
        """One exclusive allocation of exactly these nodes (with their GPUs, where Slurm lists them as
        GRES: --exclusive alone does not hand them to the job); returns once Slurm granted it."""
        argv = [
            "salloc",
            "--no-shell",
            "--exclusive",
            "--no-kill",
            f"--job-name={self.job_name}-{stage}",
            f"--nodes={len(nodes)}",
            f"--nodelist={hostlist(nodes)}",
            f"--time={self.time_limit_min}",
        ]
        if self.partition:
            argv.append(f"--partition={self.partition}")
        if gpus_per_node:
            argv.append(f"--gpus-per-node={gpus_per_node}")
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=self.time_limit_min * 60, check=False
            )
        except subprocess.TimeoutExpired as exc:
            # ParallelCluster sets InactiveLimit=0: a pending salloc whose process is gone stays queued.
            # Cancel it (ours: this job name, this user, still pending) before giving up.
            subprocess.run(
                [
                    "scancel",
                    f"--name={self.job_name}-{stage}",
                    f"--user={getpass.getuser()}",
                    "--state=PENDING",
                ],
                capture_output=True,
                check=False,
                timeout=60,
            )
            raise ExternalError(
                f"salloc for {stage} was not granted in {self.time_limit_min} min (the nodes stayed busy or "
                "did not boot); its pending job was cancelled"
            ) from exc
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip().splitlines()
            raise ExternalError(
                f"salloc --no-shell --exclusive failed: {detail[-1] if detail else proc.returncode}"
            )
        match = _GRANTED_RE.search(proc.stderr + proc.stdout)
        if match is None:
            raise ExternalError(f"salloc granted no allocation for {stage}: {proc.stderr.strip()[-300:]}")
        return Allocation(match.group(1), tuple(nodes))

    def release(self, allocation: Allocation) -> None:
        subprocess.run(["scancel", allocation.job_id], capture_output=True, check=False, timeout=60)

    def start_step(
        self,
        allocation: Allocation,
        nodes: Sequence[str],
        command: Sequence[str],
        log: Path,
        *,
        mpi: bool,
        gpus_per_node: int,
        label: bool = False,
        env: Mapping[str, str] | None = None,
        tasks_per_node: int = 1,
    ) -> subprocess.Popen[str]:
        """srun of `tasks_per_node` tasks on each node of `nodes` in the allocation; its output (both
        streams) into `log`."""
        argv = [
            "srun",
            f"--jobid={allocation.job_id}",
            f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes) * tasks_per_node}",
            f"--ntasks-per-node={tasks_per_node}",
            f"--nodelist={hostlist(nodes)}",
            f"--time={self.time_limit_min}",
            "--kill-on-bad-exit=0",
            "--mpi=pmix" if mpi else "--mpi=none",
        ]
        if gpus_per_node:
            argv.append(f"--gpus-per-node={gpus_per_node}")
        if tasks_per_node > 1:
            # As scripts/slurm/nccl-allreduce.sbatch: NCCL places its ranks; Slurm's binding would not.
            argv.append("--cpu-bind=none")
        if label:
            argv.append("--label")
        if env:
            # Set by env(1) on the node, not srun --export: that list is comma-separated, and values such
            # as NCCL_SOCKET_IFNAME=^docker,lo,veth hold commas.
            command = ["env", *(f"{k}={v}" for k, v in env.items()), *command]
        handle: IO[str] = log.open("w")
        try:
            return subprocess.Popen(
                [*argv, *command],
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                text=True,
            )
        finally:
            handle.close()

    def drain(self, node: str, reason: str) -> None:
        _run(["scontrol", "update", f"nodename={node}", "state=DRAIN", f"reason={reason}"])
