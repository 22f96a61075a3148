"""One cgroup per lab host, so the systemd inside each host owns its cgroup tree alone.

systemd-nspawn started with --keep-unit and --register=no (the lab runs where no systemd on the
control host could give each container a scope of its own) puts the container under the cgroup
of the process that started it: every host of every lab then shared one `payload` tree, each
host's systemd creating, populating and removing the same /system.slice/ssh.service and
/init.scope as the others. A host that stopped a unit could remove the cgroup another host was
about to start the same unit in: an intermittent boot where sshd or systemd-user-sessions never
ran. Each host's systemd-nspawn now starts in a cgroup of its own, in every hierarchy systemd
uses (the unified one and, on a hybrid host, the named v1 `systemd` one); nspawn makes its
supervisor/payload split under it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import time
from pathlib import Path

from gpuforge.errors import ExternalError

PROC_CGROUP = Path("/proc/self/cgroup")
PROC_MOUNTS = Path("/proc/self/mounts")


def _own_paths(proc_cgroup: Path) -> dict[str, str]:
    """This process's cgroup path per hierarchy: '' for the unified one, 'name=systemd' for v1's."""
    paths: dict[str, str] = {}
    for line in proc_cgroup.read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers in ("", "name=systemd"):
            paths[controllers] = path
    return paths


def _mounts(proc_mounts: Path) -> dict[str, Path]:
    """Mount points of the unified hierarchy ('') and of v1's name=systemd one, where present."""
    found: dict[str, Path] = {}
    for line in proc_mounts.read_text().splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        mount, kind, options = Path(fields[1]), fields[2], fields[3].split(",")
        if kind == "cgroup2":
            found.setdefault("", mount)
        elif kind == "cgroup" and "name=systemd" in options:
            found.setdefault("name=systemd", mount)
    return found


def host_cgroups(name: str, proc_cgroup: Path | None = None, proc_mounts: Path | None = None) -> list[Path]:
    """The directories of host `name`'s cgroup, one per hierarchy systemd uses here: a child of
    this process's own cgroup in each (where nspawn --keep-unit made its supervisor/payload)."""
    own = _own_paths(proc_cgroup or PROC_CGROUP)
    mounts = _mounts(proc_mounts or PROC_MOUNTS)
    return [mount / own[key].lstrip("/") / name for key, mount in mounts.items() if key in own]


def create(name: str) -> list[Path]:
    dirs = host_cgroups(name)
    if not dirs:
        raise ExternalError("no cgroup hierarchy for systemd found in /proc/self/mounts; lab hosts need one")
    for directory in dirs:
        try:
            directory.mkdir(exist_ok=True)
        except OSError as exc:
            raise ExternalError(f"cannot create the lab host's cgroup {directory}: {exc}") from exc
    return dirs


def enter_command(dirs: list[Path], argv: list[str]) -> list[str]:
    """argv, started by a shell that first moves itself into each of `dirs` (then execs argv)."""
    moves = "".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))} && " for d in dirs)
    return ["sh", "-c", f'{moves}exec "$@"', "sh", *argv]


def remove(dirs: list[Path], wait: float = 10.0) -> None:
    """Remove a host's cgroups, deepest first, once its processes are gone.

    Processes just sent SIGKILL (lab down of a host whose nspawn was killed) leave their cgroup a
    moment later, so a busy cgroup is retried for up to `wait` seconds; one still busy then stays
    for the next boot of the host to clear.
    """
    deadline = time.monotonic() + wait
    for top in dirs:
        while top.is_dir():
            for directory in sorted((Path(d) for d, _, _ in os.walk(top)), key=lambda d: -len(d.parts)):
                with contextlib.suppress(OSError):
                    directory.rmdir()
            if not top.is_dir() or time.monotonic() > deadline:
                break
            time.sleep(0.1)
