"""gpuforge_lab.cgroup: where each lab host's own cgroup goes, on the kinds of hierarchy a machine has.

The lab-backed half (each host's systemd in its own tree, the same-name unit race) is in
test_lab_integration.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpuforge.errors import ExternalError
from gpuforge_lab import cgroup

HYBRID_MOUNTS = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
HYBRID_CGROUP = "9:name=systemd:/\n4:memory:/process_api/c881\n1:cpu:/\n0::/\n"
UNIFIED_MOUNTS = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0\n"
UNIFIED_CGROUP = "0::/user.slice/user-0.slice/session-3.scope\n"
LEGACY_MOUNTS = (
    "cgroup /sys/fs/cgroup/systemd cgroup rw,name=systemd 0 0\n"
    "cgroup /sys/fs/cgroup/pids cgroup rw,pids 0 0\n"
)
LEGACY_CGROUP = "3:pids:/\n1:name=systemd:/ci.scope\n"


def _files(tmp_path: Path, mounts: str, own: str) -> tuple[Path, Path]:
    (tmp_path / "cgroup").write_text(own)
    (tmp_path / "mounts").write_text(mounts)
    return tmp_path / "cgroup", tmp_path / "mounts"


@pytest.mark.parametrize(
    ("mounts", "own", "expected"),
    [
        # This machine's kind: v1 controllers, the named systemd hierarchy and the unified one.
        (
            HYBRID_MOUNTS,
            HYBRID_CGROUP,
            ["/sys/fs/cgroup/systemd/gpuforge-a-0", "/sys/fs/cgroup/unified/gpuforge-a-0"],
        ),
        # A systemd machine (Debian 12's default): unified only, the caller inside a session scope.
        (
            UNIFIED_MOUNTS,
            UNIFIED_CGROUP,
            ["/sys/fs/cgroup/user.slice/user-0.slice/session-3.scope/gpuforge-a-0"],
        ),
        # Legacy v1 only: the named systemd hierarchy.
        (LEGACY_MOUNTS, LEGACY_CGROUP, ["/sys/fs/cgroup/systemd/ci.scope/gpuforge-a-0"]),
    ],
)
def test_a_host_cgroup_is_a_child_of_the_callers_own_in_every_systemd_hierarchy(
    tmp_path: Path, mounts: str, own: str, expected: list[str]
) -> None:
    proc_cgroup, proc_mounts = _files(tmp_path, mounts, own)
    assert sorted(map(str, cgroup.host_cgroups("gpuforge-a-0", proc_cgroup, proc_mounts))) == expected


def test_no_systemd_hierarchy_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc_cgroup, proc_mounts = _files(tmp_path, "tmpfs /sys/fs/cgroup tmpfs rw 0 0\n", "1:cpu:/\n")
    monkeypatch.setattr(cgroup, "PROC_CGROUP", proc_cgroup)
    monkeypatch.setattr(cgroup, "PROC_MOUNTS", proc_mounts)
    with pytest.raises(ExternalError, match="no cgroup hierarchy for systemd"):
        cgroup.create("gpuforge-a-0")


def test_the_command_moves_itself_into_each_cgroup_before_it_execs(tmp_path: Path) -> None:
    dirs = [tmp_path / "unified", tmp_path / "systemd"]
    for directory in dirs:
        directory.mkdir()
    out = subprocess.run(
        cgroup.enter_command(dirs, ["sh", "-c", "echo $$"]), capture_output=True, text=True, check=True
    )
    pid = out.stdout.strip()
    # exec keeps the pid: what was written is the pid of the command itself.
    assert [(d / "cgroup.procs").read_text().strip() for d in dirs] == [pid, pid]


def test_remove_takes_the_tree_deepest_first_and_keeps_nothing(tmp_path: Path) -> None:
    top = tmp_path / "gpuforge-a-0"
    (top / "payload" / "system.slice" / "ssh.service").mkdir(parents=True)
    (top / "supervisor").mkdir()
    cgroup.remove([top, tmp_path / "never-made"], wait=0)
    assert not top.exists()
