"""The opt-in mitogen strategy (plugins/strategy/mitogen_linear.py) on lab hosts over SSH.

docs/performance.md measures it faster than the project's default strategy on the full stack;
this test holds that it also keeps Ansible's meaning: the same play over SSH with become
converges, reruns with changed=0, and check mode changes nothing. It also proves mitogen really
ran (one interpreter per host), so a silent fallback to the stock strategy cannot pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import labtools
from labtools import LAB_MARKS, REPO, lab, on, playbook, recap

pytestmark = [*LAB_MARKS, pytest.mark.slow]
pytest.importorskip("ansible_mitogen", reason="mitogen is a dev dependency: pip install -e '.[dev]'")

LAB = labtools.lab_name("mitogen")
# Real work on every host that reruns quickly: the gpuforge_common role.
PLAYBOOK = "molecule/default/converge.yml"


@pytest.fixture(scope="module")
def info(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with lab(LAB, 2) as data:
        data["env"] = {
            **data["env"],
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_STRATEGY": "mitogen_linear",
            "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(tmp_path_factory.mktemp("facts")),
        }
        yield data


def test_mitogen_converges_and_reruns_with_nothing_changed(info: dict[str, Any]) -> None:
    first = playbook(info["env"], PLAYBOOK)
    assert first.returncode == 0, first.stdout[-3000:]
    stats = recap(first.stdout)
    assert len(stats) == 2, first.stdout[-3000:]
    assert all(c["changed"] > 0 for c in stats.values()), first.stdout[-3000:]
    # The role wrote its record on each host, as root through become.
    for host in info["hosts"]:
        assert on(LAB, host["name"], "stat -c '%U %a' /etc/gpuforge/manifest.json").strip() == "root 644"

    again = playbook(info["env"], PLAYBOOK)
    assert again.returncode == 0, again.stdout[-3000:]
    assert all(c["changed"] == 0 for c in recap(again.stdout).values()), again.stdout[-3000:]

    check = playbook(info["env"], PLAYBOOK, "--check")
    assert check.returncode == 0, check.stdout[-3000:]
    assert all(c["changed"] == 0 for c in recap(check.stdout).values()), check.stdout[-3000:]


# mitogen runs modules inside one persistent interpreter per host, so two tasks' commands share a
# parent process; Ansible's own strategies start a new module process for every task.
SAME_INTERPRETER = """\
- name: Do two tasks run in the same interpreter?
  hosts: all
  become: true
  gather_facts: false
  tasks:
    - name: First parent
      ansible.builtin.command: sh -c 'echo $PPID'
      register: first
      changed_when: false
    - name: Second parent
      ansible.builtin.command: sh -c 'echo $PPID'
      register: second
      changed_when: false
    - name: Same interpreter
      ansible.builtin.assert:
        that: first.stdout == second.stdout
"""


def test_the_play_really_ran_under_mitogen(info: dict[str, Any], tmp_path: Path) -> None:
    play = tmp_path / "same-interpreter.yml"
    play.write_text(SAME_INTERPRETER)
    out = playbook(info["env"], str(play))
    assert out.returncode == 0, out.stdout[-3000:]
    # The control: Ansible's own linear strategy runs each task in a new process.
    stock = playbook({**info["env"], "ANSIBLE_STRATEGY": "linear"}, str(play))
    assert stock.returncode != 0, stock.stdout[-3000:]
    assert all(c["failed"] == 1 for c in recap(stock.stdout).values()), stock.stdout[-3000:]
