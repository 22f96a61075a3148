"""The node runtime's venv step (roles/gpuforge_node/tasks/venv.yml) in check mode on the control host.

A real venv under pytest's tmp_path stands for /opt/gpuforge/node/venv; the distributions it holds
are written as installed metadata (name-version.dist-info/METADATA), which is all `pip freeze`
reads. The role's own tasks run in a check-mode play; the recap says whether anything would change.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from localplay import REPO, run_play

pytestmark = pytest.mark.slow

PINS = dict(
    line.split("==", 1)
    for line in (REPO / "roles/gpuforge_node/files/constraints.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)
PYTHON = "/usr/bin/python3"


def venv_holding(root: Path, held: dict[str, str]) -> None:
    """A venv at root/venv whose site-packages records `held` (name -> version) as installed."""
    subprocess.run([PYTHON, "-m", "venv", str(root / "venv")], check=True, timeout=120)
    site = next((root / "venv" / "lib").glob("python3*/site-packages"))
    for name, version in held.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def changed_in_check_mode(root: Path) -> int:
    """How many tasks of the venv step a check run reports as changed."""
    (root / "constraints.txt").write_text((REPO / "roles/gpuforge_node/files/constraints.txt").read_text())
    play = [
        {
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": False,
            "vars": {
                "ansible_python_interpreter": sys.executable,
                "gpuforge_node_root": str(root),
                "_gpuforge_node_python": PYTHON,
            },
            "tasks": [
                {
                    "ansible.builtin.include_role": {
                        "name": "gpuforge.gpu.gpuforge_node",
                        "tasks_from": "venv.yml",
                    }
                }
            ],
        }
    ]
    result = run_play(root, play, "--check")
    recap = re.search(r"localhost\s+: ok=\d+\s+changed=(\d+)", result.stdout)
    assert recap, result.stdout[-2000:]
    return int(recap.group(1))


def test_a_converged_venv_reports_nothing_in_check_mode(tmp_path: Path) -> None:
    """Every pin held at its version: nothing would change (the pip module alone said changed=1)."""
    venv_holding(tmp_path, PINS)
    assert changed_in_check_mode(tmp_path) == 0


def test_a_pin_at_another_version_is_a_change(tmp_path: Path) -> None:
    """boto3 one release behind (its dependencies at their pins): the check reports the install."""
    venv_holding(tmp_path, {**PINS, "boto3": "1.44.7"})
    assert changed_in_check_mode(tmp_path) == 1


def test_a_missing_dependency_is_a_change(tmp_path: Path) -> None:
    """A pinned dependency absent (ansible-core and boto3 present): the check reports the install."""
    venv_holding(tmp_path, {k: v for k, v in PINS.items() if k != "resolvelib"})
    assert changed_in_check_mode(tmp_path) == 1


def test_no_venv_is_a_change(tmp_path: Path) -> None:
    """A fresh host: no venv, so the check reports that one would be made."""
    assert changed_in_check_mode(tmp_path) == 1


def test_names_spelled_otherwise_in_the_metadata_are_the_same_distributions(tmp_path: Path) -> None:
    """pip freeze prints each distribution's own metadata Name: a venv whose metadata says jinja2,
    pyyaml, ansible_core, markupsafe and python_dateutil holds the pins Jinja2, PyYAML, ansible-core,
    MarkupSafe and python-dateutil (PEP 503 names): nothing would change."""
    respelled = {"Jinja2": "jinja2", "PyYAML": "pyyaml", "ansible-core": "ansible_core"}
    respelled |= {"MarkupSafe": "markupsafe", "python-dateutil": "Python.Dateutil"}
    assert set(respelled) <= set(PINS)
    venv_holding(tmp_path, {respelled.get(name, name): version for name, version in PINS.items()})
    assert changed_in_check_mode(tmp_path) == 0
