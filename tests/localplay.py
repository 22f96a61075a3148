"""Run role cases on the control host in one check-mode play and collect what each one did.

Each case is a list of tasks run inside block/rescue; a case that fails records its failure
message, and a case may record its own outcome with `record(case, {...})`. IMDS stays off in the
callers' play vars, so no request leaves loopback.

The cases run under the mitogen_linear strategy (plugins/strategy, a dev dependency): one Python
interpreter runs every module instead of one process per task. The nine modules that use
run_cases, run one after the other at load 6-9: 165 s of CPU and 423 s wall under `linear`, 106 s and 324 s
under mitogen. The cases test what the roles decide, which no strategy changes; the default
`linear` strategy still runs these roles in Molecule and the lab tests, and test_mitogen_strategy
keeps the two in agreement on lab hosts.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# mitogen is in the dev extras; without it (a bare `pip install .`) the cases run under `linear`.
CASES_STRATEGY = "mitogen_linear" if importlib.util.find_spec("ansible_mitogen") else "linear"


def record(case: str, value: Any) -> dict[str, Any]:
    """A task that stores `value` (templated) as the case's result."""
    return {
        "ansible.builtin.set_fact": {"_results": "{{ _results | combine({_case: _value}) }}"},
        "vars": {"_case": case, "_value": value},
    }


def results_task(out: Path) -> dict[str, Any]:
    """The task that writes what the cases recorded to out/results.json (read back by run_play)."""
    return {
        "name": "Write the collected results",
        "ansible.builtin.copy": {
            "content": "{{ _results | to_json }}",
            "dest": str(out / "results.json"),
            "mode": "0600",
        },
        "check_mode": False,
    }


def run_play(
    out: Path,
    play: list[dict[str, Any]],
    *options: str,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Write `play` to out/play.yml and run it on localhost with the checkout's ansible.cfg; it must pass.

    `env` is added to a minimal environment whose HOME is `out`; `options` go to ansible-playbook.
    """
    (out / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    result = subprocess.run(
        [str(BIN / "ansible-playbook"), *options, "-i", "localhost,", str(out / "play.yml")],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        timeout=timeout,
        env={
            **(env or {}),
            "PATH": f"{BIN}:/usr/bin:/bin",
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "HOME": str(out),
        },
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result


def read_results(out: Path) -> dict[str, Any]:
    """What results_task wrote."""
    collected: dict[str, Any] = json.loads((out / "results.json").read_text())
    return collected


def run_cases(
    out: Path, cases: dict[str, list[dict[str, Any]]], play_vars: dict[str, Any], *, check: bool = True
) -> dict[str, Any]:
    """Run the cases in one play (check mode unless told otherwise: then the cases must only touch `out`)."""
    tasks: list[dict[str, Any]] = [
        {
            "name": f"Case {case}",
            "block": block,
            "rescue": [record(case, "{{ ansible_failed_result.msg | default('none') }}")],
        }
        for case, block in cases.items()
    ]
    play = [
        {
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": True,
            "vars": {"_results": {}, "ansible_python_interpreter": sys.executable, **play_vars},
            "tasks": [*tasks, results_task(out)],
        }
    ]
    # One play holds every case of a module (the nccl_tests plan: about 40): at CI's load on the 2-CPU
    # machine it can pass run_play's default ten minutes, which would fail the module for no fault.
    run_play(
        out, play, *(["--check"] if check else []), env={"ANSIBLE_STRATEGY": CASES_STRATEGY}, timeout=1500
    )
    return read_results(out)
