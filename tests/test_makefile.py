"""The Makefile's apt step leaves the control host's /usr/sbin/policy-rc.d as it found it.

The recipe runs for real, with its paths pointed at a temporary directory: POLICY_RC_D at a file
there and APT_GET at a stand-in that records which policy was in force when it ran.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DENY = "#!/bin/sh\nexit 101\n"
ORIGINAL = "#!/bin/sh\n# the administrator's own policy\nexit 0\n"


def _apt_step(tmp_path: Path, *, install_exit: int = 0) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "apt-get"
    fake.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$1 $(cat {tmp_path}/policy-rc.d | tr "\\n" " ")" >> {tmp_path}/apt.log\n'
        f'[ "$1" = install ] && exit {install_exit}\n'
        "exit 0\n"
    )
    fake.chmod(0o755)
    stamps = tmp_path / "stamps"
    return subprocess.run(
        [
            "make",
            "-C",
            str(REPO),
            f"STAMPS={stamps}",
            f"POLICY_RC_D={tmp_path / 'policy-rc.d'}",
            f"APT_GET={fake}",
            f"{stamps}/apt",
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "MAKEFLAGS": ""},
        timeout=60,
    )


def _policy_seen_by_apt(tmp_path: Path) -> list[str]:
    return (tmp_path / "apt.log").read_text().splitlines()


@pytest.mark.parametrize("install_exit", [0, 100], ids=["apt-succeeds", "apt-fails"])
def test_a_pre_existing_policy_is_restored(tmp_path: Path, install_exit: int) -> None:
    policy = tmp_path / "policy-rc.d"
    policy.write_text(ORIGINAL)
    policy.chmod(0o700)
    result = _apt_step(tmp_path, install_exit=install_exit)
    assert (result.returncode == 0) == (install_exit == 0), result.stderr
    # apt-get ran under the deny-all policy ...
    assert _policy_seen_by_apt(tmp_path) == [
        f"{cmd} {DENY.replace(chr(10), ' ')}" for cmd in ("update", "install")
    ]
    # ... and the administrator's policy is back, content and mode, with nothing left beside it.
    assert policy.read_text() == ORIGINAL
    assert stat.S_IMODE(policy.stat().st_mode) == 0o700
    assert sorted(p.name for p in (tmp_path / "stamps").iterdir()) == (["apt"] if install_exit == 0 else [])


def test_no_policy_before_means_none_after(tmp_path: Path) -> None:
    result = _apt_step(tmp_path)
    assert result.returncode == 0, result.stderr
    assert len(_policy_seen_by_apt(tmp_path)) == 2
    assert not (tmp_path / "policy-rc.d").exists()


def test_a_symlinked_policy_is_restored_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "real-policy"
    target.write_text(ORIGINAL)
    (tmp_path / "policy-rc.d").symlink_to(target)
    result = _apt_step(tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "policy-rc.d").readlink() == target
    assert target.read_text() == ORIGINAL
