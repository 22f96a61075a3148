"""Reliability on real lab hosts: a host killed mid-run, a held apt lock, an interrupted install.

Lab hosts are systemd-nspawn containers booted from Debian 12 with systemd and sshd (see
gpuforge_lab); EC2 is moto_server (the test double) and the inventory is the real aws_ec2 one.
A killed host is its container sent SIGKILL (gpuforge_lab.bench.labrun.kill_host): every process
on it dies at once and SSH connections drop, as on a power loss. Needs root, like the lab.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import labtools
from gpuforge_lab.bench import labrun
from labtools import LAB_MARKS, REPO, recap

LAB = labtools.lab_name("rel")
EFA_PACKAGES = ("rdma-core", "ibverbs-providers", "libfabric1", "libfabric-bin")
# Only the efa role's distribution packages (a real role's ansible.builtin.apt task): the
# installer and the sysctl/limits steps are switched off, so its pinned checksum is moot here.
# {lock_timeout}: ansible.builtin.apt's lock_timeout (its default is 60 s; the role leaves it so).
EFA_PACKAGES_PLAY = """\
- name: The efa role's distribution packages only
  hosts: all
  become: true
  module_defaults:
    ansible.builtin.apt:
      lock_timeout: {lock_timeout}
  roles:
    - role: gpuforge.gpu.efa
      vars:
        efa_install_enabled: false
        efa_installer_sha256: "{zeros}"
        efa_sysctl_enabled: false
        efa_limits_enabled: false
""".replace("{zeros}", "0" * 64)
# Holds apt's frontend lock the way apt itself takes it (an fcntl write lock) for argv[1]
# seconds; it records its pid in /run/gpuforge-lock-held once it holds the lock.
HOLD_LOCK = (
    "import fcntl, os, sys, time\n"
    "f = open('/var/lib/dpkg/lock-frontend', 'w')\n"
    "fcntl.lockf(f, fcntl.LOCK_EX)\n"
    "open('/run/gpuforge-lock-held', 'w').write(str(os.getpid()))\n"
    "time.sleep(float(sys.argv[1]))\n"
)
# Starts an apt-get install and SIGKILLs its dpkg child (found by parent pid) once dpkg starts
# configuring: the packages stay unpacked but unconfigured, as after a crash mid-install.
INTERRUPT_INSTALL = """\
set -u
apt-get install -y -q {packages} >/tmp/apt-interrupted.log 2>&1 &
apt=$!
while :; do
  d=$(pgrep -P "$apt" -f "dpkg .*--configure" | head -1)
  [ -n "$d" ] && break
  kill -0 "$apt" 2>/dev/null || {{ echo "apt-get finished before dpkg could be interrupted"; exit 3; }}
  sleep 0.01
done
kill -9 "$d" "$apt"
"""

pytestmark = [*LAB_MARKS, pytest.mark.slow]


@pytest.fixture(scope="module")
def lab() -> Iterator[labrun.Lab]:
    lab = labrun.up(LAB, 3)
    yield lab
    labrun.down(LAB)


@pytest.fixture(scope="module")
def env(lab: labrun.Lab, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Ansible against the lab with the project's ansible.cfg and a fact cache of its own."""
    return {
        **lab.env(),
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(tmp_path_factory.mktemp("facts")),
        "ANSIBLE_NOCOLOR": "1",
    }


@pytest.fixture(scope="module")
def names(env: dict[str, str]) -> dict[str, str]:
    """Lab host IP -> its inventory hostname (the aws_ec2 plugin's private DNS name)."""
    return {ip: name for name, ip in labtools.inventory_addresses(env).items()}


def playbook(env: dict[str, str], *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return labtools.playbook(env, *args, timeout=timeout)


# A playbook of real work on every host that reruns quickly (gpuforge_common); the full stack's
# own reruns are proven by Molecule and the demo.
PLAYBOOK = "molecule/default/converge.yml"


def sudo(lab: labrun.Lab, host: str, command: str) -> subprocess.CompletedProcess[str]:
    return lab.ssh(host, f"sudo sh -c {shlex.quote(command)}")


def test_killed_host_is_reported_others_finish_and_rerun_converges(
    lab: labrun.Lab, env: dict[str, str], names: dict[str, str]
) -> None:
    victim = lab.hosts[1]
    victim_name = names[victim["ip"]]
    # Kill the host once the first role task (after fact gathering) is under way. The role's tasks
    # show as "TASK [gpuforge.gpu.gpuforge_common : ..." (FQCN) or short.
    returncode, out = labtools.playbook_interrupted(
        env,
        PLAYBOOK,
        at=r"TASK \[(?:gpuforge\.gpu\.)?gpuforge_common : ",
        then=lambda: labrun.kill_host(LAB, victim["name"]),
        timeout=900,
    )
    assert returncode != 0, out[-3000:]
    stats = recap(out)
    assert set(stats) == set(names.values()), out[-3000:]
    assert stats[victim_name]["unreachable"] + stats[victim_name]["failed"] >= 1, out[-3000:]
    for host, counts in stats.items():
        if host != victim_name:
            assert counts["unreachable"] == counts["failed"] == 0, (host, out[-3000:])
    labrun.restart_host(LAB, victim["name"])
    rerun = playbook(env, PLAYBOOK)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    after = recap(rerun.stdout)
    assert set(after) == set(names.values())
    assert all(c["unreachable"] == c["failed"] == 0 for c in after.values()), rerun.stdout[-3000:]
    again = playbook(env, PLAYBOOK)
    assert again.returncode == 0, again.stdout[-3000:]
    assert all(c["changed"] == 0 for c in recap(again.stdout).values()), again.stdout[-3000:]


def _purge_efa_packages(lab: labrun.Lab, host: str) -> None:
    out = sudo(lab, host, f"apt-get purge -y -q {' '.join(EFA_PACKAGES)} >/dev/null 2>&1; dpkg --audit")
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def _efa_packages_play(directory: Path, lock_timeout: int = 60) -> Path:
    play = directory / "efa_packages.yml"
    play.write_text(EFA_PACKAGES_PLAY.replace("{lock_timeout}", str(lock_timeout)))
    return play


def _package_states(lab: labrun.Lab, host: str) -> dict[str, str]:
    out = lab.ssh(host, "dpkg-query -W -f='${Package} ${db:Status-Abbrev}\\n' " + " ".join(EFA_PACKAGES))
    pairs = (line.split() for line in out.stdout.splitlines() if line.strip())
    return {p[0]: p[1] if len(p) > 1 else "" for p in pairs}


def _hold_apt_lock(lab: labrun.Lab, host: str, seconds: float) -> None:
    """Start the lock holder in the background on the host and wait until it holds the lock."""
    holder = f"python3 -c {shlex.quote(HOLD_LOCK)} {seconds}"
    start = f"rm -f /run/gpuforge-lock-held; nohup {holder} >/dev/null 2>&1 &"
    assert sudo(lab, host, start).returncode == 0
    deadline = time.monotonic() + 15
    while lab.ssh(host, "test -s /run/gpuforge-lock-held").returncode != 0:
        assert time.monotonic() < deadline, "the lock holder did not start"
        time.sleep(0.2)


def test_apt_task_waits_for_a_held_lock_and_succeeds_once_released(
    lab: labrun.Lab, env: dict[str, str], names: dict[str, str], tmp_path: Path
) -> None:
    host = lab.hosts[1]
    _purge_efa_packages(lab, host["name"])
    hold_for = 20.0
    _hold_apt_lock(lab, host["name"], hold_for)
    held_since = time.monotonic()
    play = _efa_packages_play(tmp_path)
    result = playbook(env, str(play), "--limit", names[host["ip"]])
    waited = time.monotonic() - held_since
    assert result.returncode == 0, result.stdout[-3000:]
    assert waited >= hold_for, f"the play finished {waited:.1f}s after the lock was taken: it did not wait"
    assert set(_package_states(lab, host["name"]).values()) == {"ii"}


def test_apt_lock_held_past_the_timeout_fails_with_a_clear_message(
    lab: labrun.Lab, env: dict[str, str], names: dict[str, str], tmp_path: Path
) -> None:
    """apt's own DPkg::Lock::Timeout (ansible.builtin.apt's lock_timeout) then a clear failure.

    The module's default (60 s) is shortened to 10 s for this play: the same wait and failure, sooner.
    """
    host = lab.hosts[1]
    _purge_efa_packages(lab, host["name"])
    _hold_apt_lock(lab, host["name"], 150)
    try:
        play = _efa_packages_play(tmp_path, lock_timeout=10)
        result = playbook(env, str(play), "--limit", names[host["ip"]])
        assert result.returncode != 0, result.stdout[-3000:]
        assert re.search(
            r"Could not get lock /var/lib/dpkg/lock-frontend|Failed to lock apt", result.stdout
        ), result.stdout[-3000:]
    finally:
        # The holder was started by this test; end it by the pid it recorded.
        sudo(lab, host["name"], "kill $(cat /run/gpuforge-lock-held)")


def test_interrupted_package_install_is_recovered_by_a_rerun(
    lab: labrun.Lab, env: dict[str, str], names: dict[str, str], tmp_path: Path
) -> None:
    host = lab.hosts[2]
    _purge_efa_packages(lab, host["name"])
    interrupted = sudo(lab, host["name"], INTERRUPT_INSTALL.format(packages=" ".join(EFA_PACKAGES)))
    assert interrupted.returncode == 0, interrupted.stdout + interrupted.stderr
    assert "iU" in _package_states(lab, host["name"]).values(), "the install was not left half-done"
    play = _efa_packages_play(tmp_path)
    result = playbook(env, str(play), "--limit", names[host["ip"]])
    assert result.returncode == 0, result.stdout[-3000:]
    assert set(_package_states(lab, host["name"]).values()) == {"ii"}
    audit = sudo(lab, host["name"], "dpkg --audit")
    assert not audit.stdout.strip(), audit.stdout
