"""The gpuforge.gpu.drift_files filter: ansible.posix.json output of a --check --diff run, per host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible.errors import AnsibleFilterError

import sourcefile

REPO = Path(__file__).resolve().parents[1]
drift_files = sourcefile.load("drift_files", "plugins/filter/drift_files.py")


def _output(tasks: list[dict[str, object]]) -> str:
    # The callback prints a deprecation or warning line first at times: the filter starts at "{".
    return "[WARNING]: something\n" + json.dumps({"plays": [{"tasks": tasks}], "stats": {}})


def test_files_per_host_and_other_changes() -> None:
    out = _output(
        [
            {  # A template that would change on node-a only.
                "hosts": {
                    "node-a": {"changed": True, "diff": [{"before_header": "/etc/nccl.conf", "before": "x"}]},
                    "node-b": {"changed": False},
                }
            },
            {  # A loop: a file's mode on node-b, a package on node-a.
                "hosts": {
                    "node-b": {
                        "changed": True,
                        "results": [{"changed": True, "diff": {"before": {"path": "/etc/x"}}}],
                    },
                    "node-a": {"changed": True, "results": [{"changed": True}, {"changed": False}]},
                }
            },
        ]
    )
    assert drift_files.drift_files(out) == {
        "node-a": {"files": ["/etc/nccl.conf"], "install_files": [], "other_changes": 1},
        "node-b": {"files": ["/etc/x"], "install_files": [], "other_changes": 0},
    }


def test_files_the_install_playbook_writes_are_told_apart() -> None:
    """Only an install run rewrites a file of the install play (a golden node's converge skips it); a
    file of the fleet play is put back by any converge. The callback's play path is FILE:LINE."""
    changed = {"changed": True, "diff": [{"before_header": "/etc/modprobe.d/nvidia.conf", "before": "x"}]}
    fleet = {"changed": True, "diff": [{"before_header": "/etc/gpuforge/nccl.env", "before": "x"}]}
    out = json.dumps(
        {
            "plays": [
                {
                    "play": {"id": "1", "path": "/c/gpuforge/gpu/playbooks/bake.yml:58"},
                    "tasks": [{"hosts": {"n": changed}}],
                },
                {
                    "play": {"id": "2", "path": "/c/gpuforge/gpu/playbooks/fleet.yml:7"},
                    "tasks": [{"hosts": {"n": fleet}}],
                },
            ]
        }
    )
    assert drift_files.drift_files(out) == {
        "n": {
            "files": ["/etc/gpuforge/nccl.env", "/etc/modprobe.d/nvidia.conf"],
            "install_files": ["/etc/modprobe.d/nvidia.conf"],
            "other_changes": 0,
        }
    }


def test_output_that_is_not_json_is_an_error() -> None:
    with pytest.raises(AnsibleFilterError, match="not the json callback's output"):
        drift_files.drift_files("ERROR! the playbook could not be found")


def test_two_playbooks_of_one_run_as_the_real_callback_prints_them(tmp_path: Path) -> None:
    """playbooks/drift.yml passes two playbooks (bake and fleet) to one ansible-playbook run; the
    json callback then prints one document per playbook, the second repeating the first's plays."""
    target = tmp_path / "managed.conf"
    target.write_text("old\n")
    for name, line in (("one.yml", "new"), ("two.yml", "newer")):
        (tmp_path / name).write_text(
            "- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n"
            f"    - ansible.builtin.copy:\n        dest: {target}\n"
            f'        content: "{line}\\n"\n        mode: "0644"\n'
            "    - ansible.builtin.command: /bin/true\n      changed_when: true\n      check_mode: false\n"
        )
    env = {
        **os.environ,
        "ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json",
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_LOCALHOST_WARNING": "false",
        "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false",
    }
    playbook = Path(sys.executable).with_name("ansible-playbook")
    interpreter = f"ansible_python_interpreter={sys.executable}"
    playbooks = [str(tmp_path / "one.yml"), str(tmp_path / "two.yml")]
    proc = subprocess.run(
        [str(playbook), "-i", "localhost,", "-e", interpreter, "--check", "--diff", *playbooks],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    # The case this test exists for: more than one document (json.loads of it all fails).
    with pytest.raises(json.JSONDecodeError):
        json.loads(proc.stdout[proc.stdout.index("{") :])
    assert drift_files.drift_files(proc.stdout) == {
        "localhost": {"files": [str(target)], "install_files": [], "other_changes": 2},
    }
    # The play path the callback records (FILE:LINE) tells the install playbook's plays apart.
    assert drift_files.drift_files(proc.stdout, install_playbook="one.yml")["localhost"]["install_files"] == [
        str(target)
    ]


def test_the_drift_bench_fails_when_its_site_yml_rerun_changes_something() -> None:
    # bench/drift.py compares the drift runs with an idempotent rerun: a rerun that changed
    # something is no baseline, and the bench must say so (and exit 1), not print "ok".
    bench = sourcefile.load("bench_drift", "bench/drift.py")
    assert bench.verdict(bench.BASELINE, 0, 0) == "ok"
    assert bench.verdict(bench.BASELINE, 0, 3) == "changed 3, not idempotent"
    assert bench.verdict(bench.BASELINE, 2, 0) == "exit 2"
    # The drift runs report no changes of their own; their exit status is their verdict.
    assert bench.verdict("drift.yml", 0, 0) == "ok"


def test_the_default_report_on_a_golden_node_names_what_it_did_not_compare() -> None:
    """The default check runs a converge in check mode, which skips a golden node's install roles: its
    line must say their files were not compared, and how to compare them, never pass in silence."""
    clean = {"files": [], "install_files": [], "other_changes": 0}
    remedy = "ansible-playbook site.yml --limit node-a"
    line = drift_files.drift_files_report(clean, "node-a", remedy, golden=True, install_checked=False)
    assert line == (
        "managed files as the roles would write them (0 other task(s) would change something); "
        "NOT COMPARED: the install phase's files (golden node: a converge skips the install roles, "
        "and the manifest comparison stands for them); to compare them too: "
        "ansible-playbook playbooks/drift.yml -e gpuforge_drift_install=true --limit node-a"
    )
    # The deep check compared them; a node that is not golden had its install roles in the converge.
    for golden, checked in ((True, True), (False, False)):
        line = drift_files.drift_files_report(clean, "node-a", remedy, golden=golden, install_checked=checked)
        assert line == "managed files as the roles would write them (0 other task(s) would change something)"
    drifted = {"files": ["/etc/nccl.conf"], "install_files": [], "other_changes": 2}
    line = drift_files.drift_files_report(drifted, "node-a", remedy, golden=True, install_checked=False)
    assert line.startswith(
        "DRIFT: 1 managed file(s) differ from what the roles would write: /etc/nccl.conf; to put them "
        "back: ansible-playbook site.yml --limit node-a (2 other task(s) would change something); "
        "NOT COMPARED: the install phase's files"
    )


def test_the_drift_playbook_reports_files_through_the_report_filter() -> None:
    """drift.yml's line is the filter's, told whether the node is golden and whether install ran."""
    play = yaml.safe_load((REPO / "playbooks/drift.yml").read_text())[0]
    task = next(t for t in play["tasks"] if t["name"].startswith("Report managed files"))
    msg = " ".join(task["ansible.builtin.debug"]["msg"].split())
    assert msg == (
        "{{ _drift_host | gpuforge.gpu.drift_files_report(inventory_hostname, _drift_remedy, "
        "_drift_golden_node | bool, gpuforge_drift_install | bool) }}"
    )
    assert play["vars"]["gpuforge_drift_install"] is False
