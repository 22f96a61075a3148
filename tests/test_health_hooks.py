"""The health role's Slurm hooks on the control host: configure refuses a hook whose script is missing.

A real (not check-mode) play runs the role's platform and slurm task files on localhost with every
path under pytest's tmp_path: the prolog and epilog directories, the script. IMDS and the manifest
are off, so nothing outside tmp_path changes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from localplay import BIN, REPO, record

pytestmark = pytest.mark.slow

SCRIPT = REPO / "roles" / "health" / "files" / "gpuforge-health"


def hook_case(name: str, root: Path, script: Path) -> dict[str, Any]:
    """Include the role's platform and slurm tasks with the hooks under root, recording the outcome."""
    include = {"name": "gpuforge.gpu.health"}
    return {
        "name": f"Case {name}",
        "vars": {
            "health_script_path": str(script),
            "health_slurm_prolog_dir": str(root / "prolog.d"),
            "health_slurm_epilog_dir": str(root / "epilog.d"),
        },
        "block": [
            {"ansible.builtin.include_role": {**include, "tasks_from": "platform.yml"}},
            {"ansible.builtin.include_role": {**include, "tasks_from": "slurm.yml"}},
            record(name, "ok"),
        ],
        "rescue": [record(name, "{{ ansible_failed_result.msg }}")],
    }


def test_configure_refuses_a_hook_whose_script_is_missing(tmp_path: Path) -> None:
    """A hook pointing at a missing script fails configure before any hook is written; a real one passes."""
    installed = tmp_path / "present" / "gpuforge-health"
    installed.parent.mkdir()
    shutil.copy(SCRIPT, installed)
    installed.chmod(0o755)
    play = [
        {
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": True,
            "vars": {
                "_results": {},
                "ansible_python_interpreter": str(BIN / "python"),
                "gpuforge_instance_type": "p5.48xlarge",
                "gpuforge_common_imds_enabled": False,
                "gpuforge_common_manifest_enabled": False,
            },
            "tasks": [
                hook_case("missing", tmp_path / "missing", tmp_path / "missing" / "gpuforge-health"),
                hook_case("present", tmp_path / "present", installed),
                {
                    "ansible.builtin.copy": {
                        "content": "{{ _results | to_json }}",
                        "dest": str(tmp_path / "results.json"),
                        "mode": "0600",
                    }
                },
            ],
        }
    ]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    run = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", str(tmp_path / "play.yml")],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        timeout=600,
        env={
            "PATH": f"{BIN}:/usr/bin:/bin",
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "HOME": str(tmp_path),
        },
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert (
        f"The Slurm hooks would run {tmp_path}/missing/gpuforge-health, which is missing"
        in results["missing"]
    )
    assert not (tmp_path / "missing" / "prolog.d" / "50-gpuforge-health").exists()
    assert results["present"] == "ok"
    hook = (tmp_path / "present" / "prolog.d" / "50-gpuforge-health").read_text()
    assert f"exec {installed} --config /etc/gpuforge/health.json --mode prolog --drain" in hook
    epilog = (tmp_path / "present" / "epilog.d" / "50-gpuforge-health").read_text()
    assert "--mode epilog --drain" in epilog
