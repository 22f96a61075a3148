"""One dead host never stops the fleet: sshd stopped on one of four hosts while fleet.yml runs.

Four lab hosts (head + 3 compute; systemd-nspawn with real systemd, sshd, munge and Slurm) found
through the real aws_ec2 inventory against moto (the test double for EC2 and SSM). Once the play
reaches the slurm role, the SSH daemon of one compute host is stopped and its sessions ended
(gpuforge_lab.bench.labrun.stop_sshd): the host keeps running, only SSH is refused, as when a node's
sshd dies. The other three must finish configure with failed=0 and a working Slurm; the run names
the host it left out; after sshd returns a rerun converges, and the run after it changes nothing.

The hosts boot from this tree's golden lab image (tests/goldenlab.py, shared with test_ami_local_bake
and test_fleet_lab), as a fleet's nodes boot from the baked AMI: the runs configure, they do not
install munge and Slurm first (molecule/slurm covers that on bare hosts).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

import goldenlab
import labtools
from gpuforge_lab import core as lab_core
from gpuforge_lab.bench import labrun
from labtools import LAB_MARKS, lab_up, recap

LAB = labtools.lab_name("partial")
PLAYBOOK = "playbooks/fleet.yml"
# The slurm role's task headers, by short or collection (FQCN) role name.
SLURM_TASK = r"TASK \[(?:gpuforge\.gpu\.)?slurm : "

pytestmark = [*LAB_MARKS, pytest.mark.slow]


def on(host: str, command: str) -> str:
    return labtools.on(LAB, host, command)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    info = lab_up(LAB, 4, image=goldenlab.shared_golden_image()["image"])
    env = {
        **lab_core.env_exports(LAB),
        # A fact cache of this run's own: what a node keeps when it cannot be reached is what
        # this test's first run read, nothing older.
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(tmp_path_factory.mktemp("facts")),
        "ANSIBLE_NOCOLOR": "1",
    }
    labtools.put_munge_key(env)
    head = next(h for h in info["hosts"] if h["role"] == "HeadNode")
    compute = [h for h in info["hosts"] if h["role"] == "Compute"]
    try:
        yield {"env": env, "head": head, "compute": compute, "victim": compute[1]}
    finally:
        labtools.gpuforge_lab("down", "--name", LAB)


def run_stopping_sshd(env: dict[str, str], victim: str) -> tuple[int, str]:
    """fleet.yml, stopping the victim's sshd once the slurm role's first task starts."""
    return labtools.playbook_interrupted(
        env,
        "--flush-cache",
        PLAYBOOK,
        at=SLURM_TASK,
        then=lambda: labrun.stop_sshd(LAB, victim),
        timeout=1800,
    )


def host_key(stats: dict[str, dict[str, int]], ip: str) -> str:
    """The recap's name (the inventory's private DNS name) of the lab host with this address."""
    (key,) = [name for name in stats if ip.replace(".", "-") in name or name == ip]
    return key


def node_states(head: str) -> dict[str, str]:
    text = on(head, "sinfo --noheader --Node --format='%N %T'")
    return dict(line.split() for line in text.splitlines() if line.strip())


def wait_idle(head: str, nodes: list[str], timeout: float = 120) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        states = node_states(head)
        if all(states.get(n) == "idle" for n in nodes) or time.monotonic() > deadline:
            return states
        time.sleep(3)


def test_sshd_stopped_on_one_host_leaves_the_others_configured_then_a_rerun_converges(
    lab: dict[str, Any],
) -> None:
    env, head, victim = lab["env"], lab["head"]["name"], lab["victim"]
    healthy = [h["name"] for h in lab["compute"] if h is not victim]
    returncode, out = run_stopping_sshd(env, victim["name"])

    stats = recap(out)
    assert len(stats) == 4, out[-4000:]
    victim_key = host_key(stats, victim["ip"])
    assert returncode != 0, out[-4000:]
    assert stats[victim_key]["unreachable"] >= 1, out[-4000:]
    for name, counts in stats.items():
        if name != victim_key:
            assert counts["failed"] == counts["unreachable"] == 0, (name, out[-4000:])
    # Configure finished on the healthy hosts: the last task of the play ran on each of them.
    for name in stats:
        if name != victim_key:
            assert re.search(rf"ok: \[{re.escape(name)}\]", out.split("TASK [Mark this host configured]")[-1])
    # One summary message (the YAML callback may wrap it over lines).
    flat = " ".join(out.split())
    summary = re.findall(r"gpuforge: (\d+) of (\d+) hosts not configured \([^)]*\): ([\w.,\s-]+?)'", flat)
    assert summary == [("1", "4", victim_key)], out[-4000:]

    # Slurm works on the three healthy hosts: both healthy compute nodes idle and running jobs.
    states = wait_idle(head, healthy)
    assert all(states.get(n) == "idle" for n in healthy), states
    for node in healthy:
        assert on(head, f"srun --nodelist={node} --time=1 hostname").strip() == node

    labrun.start_sshd(LAB, victim["name"])
    rerun = labtools.playbook(env, PLAYBOOK)
    assert rerun.returncode == 0, rerun.stdout[-4000:]
    assert all(c["failed"] == c["unreachable"] == 0 for c in recap(rerun.stdout).values())
    every = [h["name"] for h in lab["compute"]]
    states = wait_idle(head, every)
    assert all(states.get(n) == "idle" for n in every), states
    assert on(head, f"srun --nodelist={victim['name']} --time=1 hostname").strip() == victim["name"]

    again = labtools.playbook(env, PLAYBOOK)
    assert again.returncode == 0, again.stdout[-4000:]
    assert all(c["changed"] == 0 for c in recap(again.stdout).values()), again.stdout[-4000:]
    assert "hosts not configured" not in again.stdout
