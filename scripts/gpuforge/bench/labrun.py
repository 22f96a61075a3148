"""Drive a lab from benchmarks and reliability tests: up/down through the real CLI, env, host faults.

Lab hosts are systemd-nspawn containers (gpuforge.lab.host). A "killed" host is the
container's init (systemd, nspawn's child) sent SIGKILL: the kernel then kills every process in
its PID namespace at once, as a power loss would, and nspawn exits. (SIGKILL to nspawn itself
would orphan a still-running container.) `restart_host` boots the same writable layer again,
like an instance start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuforge.errors import ExternalError, UserError
from gpuforge.lab import host, state, system
from gpuforge.lab.moto import free_port

BIN = Path(sys.executable).parent


def gpuforge(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "gpuforge"), *args], capture_output=True, text=True, check=False, timeout=timeout
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
        """The exports of `gpuforge lab env`, as a dict."""
        out = gpuforge("lab", "env", "--name", self.name)
        if out.returncode != 0:
            raise ExternalError(out.stderr.strip())
        env: dict[str, str] = {}
        for line in out.stdout.splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value.strip("'")
        return env

    def ssh(self, host_name: str, command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "gpuforge"), "lab", "ssh", "--name", self.name, host_name, "--", command],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
        )


def up(name: str, nodes: int, attempts: int = 2) -> Lab:
    """A fresh lab (an old one of the same name is taken down first) with moto on a free port.

    On a loaded machine a host occasionally fails to boot; `lab up` then tears everything down,
    so trying once more is safe.
    """
    error = ""
    for _ in range(attempts):
        gpuforge("lab", "down", "--name", name)
        port = str(free_port())
        out = gpuforge("lab", "up", "--name", name, "--nodes", str(nodes), "--moto-port", port, "--json")
        if out.returncode == 0:
            return Lab(name=name, info=json.loads(out.stdout))
        error = out.stderr.strip()
        print(f"gpuforge lab up --name {name} failed, retrying: {error}", file=sys.stderr)
    raise ExternalError(f"gpuforge lab up --name {name} failed {attempts} times: {error}")


def down(name: str) -> None:
    gpuforge("lab", "down", "--name", name)


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
