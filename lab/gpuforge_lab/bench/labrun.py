"""Drive a lab from benchmarks and reliability tests: up/down through the real CLI, env, host faults.

Lab hosts are systemd-nspawn containers (gpuforge_lab.host). A "killed" host is the
container's init (systemd, nspawn's child) sent SIGKILL: the kernel then kills every process in
its PID namespace at once, as a power loss would, and nspawn exits. (SIGKILL to nspawn itself
would orphan a still-running container.) `restart_host` boots the same writable layer again,
like an instance start.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpuforge import paths
from gpuforge.errors import ExternalError, UserError
from gpuforge_lab import core as lab_core
from gpuforge_lab import host, state, system
from gpuforge_lab.bench.timing import run_timed
from gpuforge_lab.moto import free_port

BIN = Path(sys.executable).parent

_RECAP = re.compile(
    r"^(?P<host>\S+)\s+: ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+unreachable=(?P<unreachable>\d+)\s+"
    r"failed=(?P<failed>\d+)",
    re.MULTILINE,
)


def recap(output: str) -> dict[str, dict[str, int]]:
    """An ansible-playbook PLAY RECAP: per host, its ok/changed/unreachable/failed counters."""
    return {
        m["host"]: {k: int(v) for k, v in m.groupdict().items() if k != "host"}
        for m in _RECAP.finditer(output)
    }


def recap_totals(output: str) -> tuple[int, int, int]:
    """(hosts, changed tasks, failed + unreachable) summed over a PLAY RECAP."""
    stats = recap(output).values()
    return len(stats), sum(s["changed"] for s in stats), sum(s["unreachable"] + s["failed"] for s in stats)


def gpuforge_lab(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """The lab's CLI, `gpuforge-lab`, as a subprocess."""
    return subprocess.run(
        [str(BIN / "gpuforge-lab"), *args], capture_output=True, text=True, check=False, timeout=timeout
    )


@dataclass
class Lab:
    name: str
    info: dict[str, Any]

    @property
    def hosts(self) -> list[dict[str, Any]]:
        hosts: list[dict[str, Any]] = self.info["hosts"]
        return hosts

    def env(self) -> dict[str, str]:
        """What `gpuforge-lab env` exports, as a dict."""
        return lab_core.env_exports(self.name)

    def ssh(self, host_name: str, command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "gpuforge-lab"), "ssh", "--name", self.name, host_name, "--", command],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
        )


def up(name: str, nodes: int, attempts: int = 2, image: str | None = None) -> Lab:
    """A fresh lab (an old one of the same name is taken down first) with moto on a free port.

    On a loaded machine a host occasionally fails to boot; `lab up` then tears everything down,
    so trying once more is safe. `image` boots the hosts from a lab image (`gpuforge-lab image`).
    """
    error = ""
    for _ in range(attempts):
        gpuforge_lab("down", "--name", name)
        port = str(free_port())
        args = ["up", "--name", name, "--nodes", str(nodes), "--moto-port", port, "--json"]
        out = gpuforge_lab(*args, *(["--image", image] if image else []))
        if out.returncode == 0:
            return Lab(name=name, info=json.loads(out.stdout))
        error = out.stderr.strip()
        print(f"gpuforge-lab up --name {name} failed, retrying: {error}", file=sys.stderr)
    raise ExternalError(f"gpuforge-lab up --name {name} failed {attempts} times: {error}")


# The lab cannot reach NVIDIA's repositories: this playbook builds signed TEST-FIXTURE stand-ins on
# the hosts (`make demo` runs it too). The EFA, aws-ofi-nccl and PyTorch stand-ins come from the lab's
# artifact server.
FIXTURE_PLAYBOOK = "tests/fixtures/nvidia/prepare.yml"
# The one file of lab overrides: where each artifact comes from (URLs, fixture hashes and signing-key
# fingerprints) plus the one test-double switch for the health checks; everything else is the
# roles' production defaults (tests/test_lab_overrides.py). It is the lab group's group_vars, so
# passing it with -e is redundant on a lab; kept for callers outside the lab's inventory.
FIXTURE_VARS = "inventory/group_vars/gpuforge_lab/artifacts.yml"


def prepare_fixtures(env: dict[str, str]) -> None:
    """Build the NVIDIA test-fixture repositories on every host of the lab `env` points at."""
    root = paths.repo_root()
    result = subprocess.run(
        [str(BIN / "ansible-playbook"), FIXTURE_PLAYBOOK],
        capture_output=True,
        text=True,
        check=False,
        cwd=root,
        env={**os.environ, **env},
        timeout=1800,
    )
    if result.returncode != 0:
        raise ExternalError(f"{FIXTURE_PLAYBOOK} failed:\n{result.stdout[-3000:]}")


def write_bake_vars(work_dir: Path) -> Path:
    """The lab's artifact sources (FIXTURE_VARS) as one extra-vars file for `gpuforge-lab bake`.

    Packer's ansible provisioner builds its own inventory, so the lab's group_vars do not apply;
    the same variables, and only those, are handed over as extra vars instead.
    """
    variables = yaml.safe_load((paths.repo_root() / FIXTURE_VARS).read_text())
    path = work_dir / "lab-vars.yml"
    path.write_text(yaml.safe_dump(variables))
    return path


# The instance types a lab's hosts have (head node and compute nodes, gpuforge_lab.core.LabSpec):
# a golden image baked for both is the image of a cluster whose every node boots from it, so each
# lab host is among its targets and can take the golden fast path (docs/manifest.md).
LAB_TARGETS = (lab_core.LabSpec.compute_type, lab_core.LabSpec.head_type)


def bake_image(
    image: str, work_dir: Path, lab_name: str = "bench-bake", targets: tuple[str, ...] = LAB_TARGETS
) -> float:
    """Bake a 1-host lab with the real Packer build into lab image `image`; the bake's wall seconds.

    The host gets the NVIDIA fixtures first, like every lab host that runs the stack roles. The
    image is for `targets` (gpuforge bake --target-instance-types).
    """
    root = paths.repo_root()
    lab = up(lab_name, 1)
    try:
        env = lab.env()
        prepare_fixtures(env)
        lab_vars = write_bake_vars(work_dir)
        seconds, _ = run_timed(
            [
                str(BIN / "gpuforge-lab"),
                "bake",
                "--lab",
                lab.name,
                "--work-dir",
                str(work_dir / "bake"),
                "--extra-vars",
                str(lab_vars),
                "--save-image",
                image,
                "--target-instance-types",
                ",".join(targets),
            ],
            env={"GPUFORGE_LAB_ARTIFACTS": env["GPUFORGE_LAB_ARTIFACTS"]},
            cwd=root,
        )
        return seconds
    finally:
        down(lab.name)


def down(name: str) -> None:
    gpuforge_lab("down", "--name", name)


def _host_state(name: str, host_name: str) -> tuple[state.LabState, state.HostState]:
    lab = state.load(state.validate_name(name))
    if lab is None:
        raise UserError(f"lab {name!r} is not up")
    for node in lab.hosts:
        if host_name in (node.name, node.ip):
            return lab, node
    raise UserError(f"no host {host_name!r} in lab {name!r}")


def kill_host(name: str, host_name: str) -> None:
    """SIGKILL the host's container (all its processes die at once; its disk layer stays)."""
    _, node = _host_state(name, host_name)
    if node.pid and system.pid_alive(node.pid, node.netns):
        children = Path(f"/proc/{node.pid}/task/{node.pid}/children").read_text().split()
        if not children:
            raise ExternalError(f"host {host_name}: systemd-nspawn (pid {node.pid}) has no container init")
        for child in children:
            os.kill(int(child), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while system.pid_alive(node.pid, node.netns):
        if time.monotonic() > deadline:
            raise ExternalError(f"host {host_name} (pid {node.pid}) did not die")
        time.sleep(0.1)


def restart_host(name: str, host_name: str) -> None:
    """Boot a killed host again from its own (kept) writable layer and wait for SSH."""
    lab, node = _host_state(name, host_name)
    if system.pid_alive(node.pid, node.netns):
        raise UserError(f"host {host_name} is still running")
    root = host.host_dir(lab, node) / "rootfs"
    if not system.is_mounted(root):
        raise ExternalError(f"host {host_name}'s root {root} is no longer mounted")
    node.pid = host.boot(lab, node, root)
    state.save(lab)
    host.wait_ssh(lab, node)


def _in_host(name: str, host_name: str, *command: str) -> subprocess.CompletedProcess[str]:
    """Run a command inside a running host's namespaces from the control host (not over SSH)."""
    _, node = _host_state(name, host_name)
    if not (node.pid and system.pid_alive(node.pid, node.netns)):
        raise UserError(f"host {host_name} is not running")
    init = host.init_pid(node)
    if init is None:
        raise ExternalError(f"host {host_name}: systemd-nspawn (pid {node.pid}) has no container init")
    return subprocess.run(
        [*host.inside(init), *command], capture_output=True, text=True, check=False, timeout=60
    )


def stop_sshd(name: str, host_name: str) -> None:
    """Stop the host's SSH daemon and end its sessions; the host itself keeps running.

    The listener goes (`systemctl stop ssh`) and so do the per-connection sshd processes that
    Debian's unit leaves behind (KillMode=process), so open ControlMaster connections drop too:
    every new SSH connection is refused, as on a node whose sshd died.
    """
    stopped = _in_host(name, host_name, "systemctl", "stop", "ssh.service", "ssh.socket")
    if stopped.returncode != 0:
        raise ExternalError(f"host {host_name}: systemctl stop ssh failed: {stopped.stderr.strip()}")
    # pkill exits 1 when no session was left: nothing to end.
    killed = _in_host(name, host_name, "pkill", "-KILL", "-x", "sshd")
    if killed.returncode not in (0, 1):
        raise ExternalError(f"host {host_name}: pkill sshd failed: {killed.stderr.strip()}")


def start_sshd(name: str, host_name: str) -> None:
    """Start the host's SSH daemon again (after stop_sshd) and wait until it answers."""
    started = _in_host(name, host_name, "systemctl", "start", "ssh.service")
    if started.returncode != 0:
        raise ExternalError(f"host {host_name}: systemctl start ssh failed: {started.stderr.strip()}")
    lab, node = _host_state(name, host_name)
    host.wait_ssh(lab, node)
