"""The health role's Slurm hooks on the control host: configure refuses a hook whose script is missing.

A real (not check-mode) play runs the role's platform and slurm task files on localhost with every
path under pytest's tmp_path: the prolog and epilog directories, the script. IMDS and the manifest
are off, so nothing outside tmp_path changes.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from localplay import REPO, record, run_cases

pytestmark = pytest.mark.slow

SCRIPT = REPO / "roles" / "health" / "files" / "gpuforge-health"


def hook_case(name: str, root: Path, script: Path) -> list[dict[str, Any]]:
    """Case `name`: the role's platform and slurm tasks with the hooks under root; "ok" when they pass."""
    include = {"name": "gpuforge.gpu.health"}
    return [
        {
            "name": "Include the role's platform and slurm tasks",
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
        }
    ]


def test_configure_refuses_a_hook_whose_script_is_missing(tmp_path: Path) -> None:
    """A hook pointing at a missing script fails configure before any hook is written; a real one passes."""
    installed = tmp_path / "present" / "gpuforge-health"
    installed.parent.mkdir()
    shutil.copy(SCRIPT, installed)
    installed.chmod(0o755)
    cases = {
        "missing": hook_case("missing", tmp_path / "missing", tmp_path / "missing" / "gpuforge-health"),
        "present": hook_case("present", tmp_path / "present", installed),
    }
    play_vars = {
        "gpuforge_instance_type": "p5.48xlarge",
        "gpuforge_common_imds_enabled": False,
        "gpuforge_common_manifest_enabled": False,
    }
    results = run_cases(tmp_path, cases, play_vars, check=False)
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
