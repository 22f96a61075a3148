"""Run role cases on the control host in one check-mode play and collect what each one did.

Each case is a list of tasks run inside block/rescue; a case that fails records its failure
message, and a case may record its own outcome with `record(case, {...})`. IMDS stays off in the
callers' play vars, so no request leaves loopback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def record(case: str, value: Any) -> dict[str, Any]:
    """A task that stores `value` (templated) as the case's result."""
    return {
        "ansible.builtin.set_fact": {"_results": "{{ _results | combine({_case: _value}) }}"},
        "vars": {"_case": case, "_value": value},
    }


def run_cases(out: Path, cases: dict[str, list[dict[str, Any]]], play_vars: dict[str, Any]) -> dict[str, Any]:
    tasks: list[dict[str, Any]] = [
        {
            "name": f"Case {case}",
            "block": block,
            "rescue": [record(case, "{{ ansible_failed_result.msg | default('none') }}")],
        }
        for case, block in cases.items()
    ]
    tasks.append(
        {
            "name": "Write the collected results",
            "ansible.builtin.copy": {
                "content": "{{ _results | to_json }}",
                "dest": str(out / "results.json"),
                "mode": "0600",
            },
            "check_mode": False,
        }
    )
    play = [
        {
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": True,
            "vars": {"_results": {}, "ansible_python_interpreter": sys.executable, **play_vars},
            "tasks": tasks,
        }
    ]
    (out / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    result = subprocess.run(
        [str(BIN / "ansible-playbook"), "--check", "-i", "localhost,", str(out / "play.yml")],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        timeout=600,
        env={
            "PATH": f"{BIN}:/usr/bin:/bin",
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "HOME": str(out),
        },
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    collected: dict[str, Any] = json.loads((out / "results.json").read_text())
    return collected
