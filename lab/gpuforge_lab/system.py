"""Thin, logged wrappers around the host commands the lab runs (ip, mount, ssh-keygen...)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from gpuforge.errors import ExternalError, UserError

log = logging.getLogger(__name__)

REQUIRED_TOOLS = {
    "systemd-nspawn": "systemd-container",
    "debootstrap": "debootstrap",
    "ip": "iproute2",
    "ssh-keygen": "openssh-client",
    "ssh": "openssh-client",
}


def run(
    cmd: Sequence[str], *, check: bool = True, input_text: str | None = None
) -> subprocess.CompletedProcess[str]:
    log.debug("run: %s", " ".join(cmd))
    proc = subprocess.run(list(cmd), capture_output=True, text=True, input=input_text, check=False)
    if check and proc.returncode != 0:
        raise ExternalError(
            f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def require_root_and_tools() -> None:
    if os.geteuid() != 0:
        raise UserError("the lab needs root: it creates network namespaces, overlay mounts and containers")
    missing = sorted({pkg for tool, pkg in REQUIRED_TOOLS.items() if shutil.which(tool) is None})
    if missing:
        raise UserError(
            f"missing tools for the lab; install them with: apt-get install -y {' '.join(missing)}"
        )


def is_mounted(path: Path) -> bool:
    target = str(path.resolve())
    with Path("/proc/self/mounts").open() as mounts:
        return any(line.split()[1] == target for line in mounts)


def pid_alive(pid: int | None, marker: str | None = None) -> bool:
    """True if pid runs and, when marker is given, its command line contains it (guards pid reuse)."""
    if not pid:
        return False
    # A process caught inside execve (just started: Popen returns once the child released the
    # parent's memory, before the new image's arguments exist) shows an empty cmdline for a moment.
    for _ in range(50):
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        if raw:
            break
        time.sleep(0.01)
    cmdline = raw.replace(b"\0", b" ").decode(errors="replace")
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    if state == "Z":
        return False
    return marker is None or marker in cmdline


def stop_process(pid: int | None, marker: str, timeout: float = 20.0) -> None:
    """SIGTERM, wait, then SIGKILL; a no-op when the process is already gone."""
    if not pid_alive(pid, marker):
        return
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid, marker):
            return
        time.sleep(0.2)
    log.warning("pid %s (%s) ignored SIGTERM for %.0fs; killing it", pid, marker, timeout)
    os.kill(pid, signal.SIGKILL)
    for _ in range(50):
        if not pid_alive(pid, marker):
            return
        time.sleep(0.1)
    raise ExternalError(f"process {pid} ({marker}) would not die")


# Each booted host runs its own systemd, which holds several inotify instances; the kernel's
# default of 128 per user runs out at about 16 hosts ("Failed to allocate manager object").
KERNEL_MINIMUMS = {
    "fs/inotify/max_user_instances": 8192,
    "fs/inotify/max_user_watches": 524288,
}


def raise_kernel_limits() -> None:
    """Raise the limits above to at least these values (never lower a larger setting)."""
    for key, minimum in KERNEL_MINIMUMS.items():
        path = Path("/proc/sys") / key
        try:
            if int(path.read_text()) < minimum:
                path.write_text(f"{minimum}\n")
        except OSError as exc:
            log.warning("cannot raise %s to %d (%s); many lab hosts may fail to boot", key, minimum, exc)


def _pids_in_netns(inode: int) -> set[int]:
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "ns" / "net").stat().st_ino == inode:
                found.add(int(proc.name))
        except OSError:
            continue
    return found


def kill_in_netns(netns: str, timeout: float = 20.0) -> int:
    """SIGKILL every process in the named network namespace until none is left; return how many
    there were.

    Each lab host is alone in its namespace, so this ends exactly that host's processes (its
    root shows as "/" from here, so the namespace is what identifies them). One pass is not
    enough: the container's init may fork between the scan and its own kill, and a killed
    process stays visible until it has exited, which takes a while on a loaded machine.
    """
    try:
        target = Path(f"/run/netns/{netns}").stat().st_ino
    except OSError:
        return 0
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while victims := _pids_in_netns(target):
        if time.monotonic() > deadline:
            raise ExternalError(f"processes {sorted(victims)} in network namespace {netns} survived SIGKILL")
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed |= victims
        time.sleep(0.1)
    if killed:
        log.warning("killed %d orphaned process(es) in network namespace %s", len(killed), netns)
    return len(killed)
