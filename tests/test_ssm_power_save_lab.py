"""The SSM document under Slurm power saving, on a lab cluster (Debian 12's Slurm 22.05).

Three bare lab hosts (head + 2 compute) configured by playbooks/fleet.yml; slurmctld then gets power
saving with a stand-in SuspendProgram and ResumeProgram that only log their arguments (a lab host
cannot be powered off; slurmctld's decision to suspend is what is looked at). Slurm 22.05 has no
run-time `scontrol update SuspendExcNodes+=` (Slurm 23.02 added it; ParallelCluster 3.16.1 ships
25.11.8), so the lab shows what it can:

- with power saving on, the document refuses on 22.05 before it holds or changes anything;
- SuspendExcNodes is what keeps an idle node held by the MAINT reservation up: with the node in
  SuspendExcNodes and SuspendTime far shorter than the apply, slurmctld suspends the other idle
  node during the apply and never the one being changed, and the document leaves a configured
  exclusion as it is.
The run-time exclusion on 23.02+ is tested against Slurm's recorded behaviour in tests/test_fleet_ssm.py.
"""

from __future__ import annotations

import base64
import re
import shlex
from collections.abc import Iterator
from typing import Any

import pytest

import labtools
import ssmdouble
from gpuforge.fleet import document as fleet_document
from labtools import LAB_MARKS, gpuforge_lab

LAB = labtools.lab_name("powersave")
pytestmark = [*LAB_MARKS, pytest.mark.slow]

STANDIN = "/usr/local/sbin/gpuforge-power-standin"
POWER_LOG = "/tmp/gpuforge-power.log"
ENTRY = "/usr/local/sbin/gpuforge-node-ssm-standin"
APPLY_S = 45


def on(host: str, command: str, check: bool = True) -> str:
    return labtools.on(LAB, host, command, check=check)


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    with labtools.lab(LAB, 3) as info:
        env = info["env"]
        labtools.put_munge_key(env)
        run = labtools.playbook(env, "--flush-cache", "playbooks/fleet.yml")
        assert run.returncode == 0, run.stdout[-6000:]
        head = next(h["name"] for h in info["hosts"] if h["role"] == "HeadNode")
        compute = [h["name"] for h in info["hosts"] if h["role"] == "Compute"]
        standin = f'#!/bin/sh\necho "$(date +%s) $(basename "$0") $*" >> {POWER_LOG}\n'
        encoded = base64.b64encode(standin.encode()).decode()
        on(head, f"echo {encoded} | base64 -d > {STANDIN}-suspend && chmod 755 {STANDIN}-suspend")
        on(
            head,
            f"cp {STANDIN}-suspend {STANDIN}-resume && cp /etc/slurm/slurm.conf /etc/slurm/slurm.conf.orig",
        )
        entry = (
            "#!/bin/sh\n"
            + f"date +%s > /var/tmp/applied-start\nsleep {APPLY_S}\ndate +%s > /var/tmp/applied-end\n"
        )
        encoded = base64.b64encode(entry.encode()).decode()
        for node in compute:
            on(node, f"echo {encoded} | base64 -d > {ENTRY} && chmod 755 {ENTRY}")
        yield {"head": head, "compute": compute}


def power_saving(head: str, suspend_time: int, exclude: str = "") -> None:
    """slurm.conf as the role wrote it plus power saving, then slurmctld restarted with it."""
    lines = [
        f"SuspendProgram={STANDIN}-suspend",
        f"ResumeProgram={STANDIN}-resume",
        f"SuspendTime={suspend_time}",
        "SuspendTimeout=30",
        "ResumeTimeout=60",
        *([f"SuspendExcNodes={exclude}"] if exclude else []),
    ]
    conf = "\n".join(lines)
    on(
        head,
        "cp /etc/slurm/slurm.conf.orig /etc/slurm/slurm.conf && "
        f"printf '%s\\n' {shlex.quote(conf)} >> /etc/slurm/slurm.conf",
    )
    on(head, f"rm -f {POWER_LOG} && systemctl restart slurmctld")
    on(head, "for i in $(seq 60); do scontrol ping | grep -q UP && exit 0; sleep 1; done; exit 1")
    assert re.search(rf"^SuspendTime\s+= {suspend_time}\b", on(head, "scontrol show config"), re.M)


def apply_on(node: str) -> ssmdouble.Run:
    def execute(target: str, script: str) -> tuple[int, str]:
        payload = base64.b64encode(script.encode()).decode()
        command = f"echo {payload} | base64 -d > /tmp/ssm-apply.sh && sh /tmp/ssm-apply.sh"
        run = gpuforge_lab(
            "ssh", "--name", LAB, target, "--", f"sudo sh -c {shlex.quote(command)}", timeout=600
        )
        return run.returncode, run.stdout + run.stderr

    parameters = {
        "EntryPoint": ENTRY,
        "PollSeconds": "2",
        "HoldWith": "reservation",
        "ExecutionTimeout": "600",
    }
    runner = ssmdouble.document_runner(fleet_document.load(), parameters, execute)
    return ssmdouble.run([node], runner, max_concurrency="1", max_errors="0")


def test_slurm_22_05_cannot_exclude_at_run_time_so_nothing_is_changed(cluster: dict[str, Any]) -> None:
    head, (first, _) = cluster["head"], cluster["compute"]
    power_saving(head, suspend_time=3600)
    outcome = apply_on(first)
    (result,) = outcome.results
    assert result.status == "Failed", result.output[-2000:]
    assert f"cannot keep {first} from power saving during the change" in result.output
    assert "No reservations in the system" in on(head, "scontrol show reservation")
    assert on(first, "ls /var/tmp/applied-start 2>/dev/null || true").strip() == ""


def test_an_excluded_node_is_not_suspended_while_it_applies(cluster: dict[str, Any]) -> None:
    """SuspendTime 10 s, the apply 45 s: the other idle node is suspended meanwhile, this one never."""
    head, (first, second) = cluster["head"], cluster["compute"]
    power_saving(head, suspend_time=10, exclude=first)
    # A job on both makes them busy, then idle: from here their idle time counts (last_busy).
    on(head, f"srun --nodes=2 --nodelist={first},{second} true")
    outcome = apply_on(first)
    (result,) = outcome.results
    assert result.status == "Success", result.output[-2000:]
    start, end = int(on(first, "cat /var/tmp/applied-start")), int(on(first, "cat /var/tmp/applied-end"))
    assert end - start >= APPLY_S
    suspended = [line.split() for line in on(head, f"cat {POWER_LOG} 2>/dev/null || true").splitlines()]
    suspend_calls = [(int(t), nodes) for t, program, nodes, *_ in suspended if program.endswith("suspend")]
    # Power saving ran while the node was held: it suspended the other node, idle since the same job
    # ended (the same last_busy), before the apply was over...
    assert any(nodes == second and t <= end for t, nodes in suspend_calls), suspended
    # ...and never the node being changed, held by the MAINT reservation and in SuspendExcNodes.
    assert not any(first in nodes for _, nodes in suspend_calls), suspended
    assert "No reservations in the system" in on(head, "scontrol show reservation")
    assert re.search(rf"^SuspendExcNodes\s+= {first}$", on(head, "scontrol show config"), re.M)
