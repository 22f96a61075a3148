"""The TEST DOUBLE of PyTorch's CPU wheel (tests/torchdouble.py) passes what the pytorch role reads."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

import torchdouble

REAL = Path("/opt/wheels") / torchdouble.FILE_NAME
REPO = Path(__file__).resolve().parents[1]


def _unpacked(tmp_path: Path) -> Path:
    wheel = torchdouble.build(tmp_path / "wheels")
    # Where the role's venv has it: the probe reads the Python release from the path.
    site = tmp_path / "venv/lib/python3.11/site-packages"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def test_the_role_reads_the_pin_and_a_cpu_build_from_the_double(tmp_path: Path) -> None:
    """The pytorch role's own version read and verify probe, run against the unpacked double."""
    site = _unpacked(tmp_path)
    tasks = yaml.safe_load((REPO / "roles/pytorch/tasks/verify.yml").read_text())
    probe = tasks[0]["ansible.builtin.command"]["argv"][2]
    env = {"PYTHONPATH": str(site)}
    found = json.loads(
        subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env
        ).stdout
    )
    assert found["torch"] == torchdouble.VERSION
    assert (found["cuda_build"], found["cuda_available"], found["nccl"]) == (None, False, None)
    read = "import importlib.metadata as m; print(m.version('torch'))"  # roles/pytorch/tasks/install.yml
    version = subprocess.run(
        [sys.executable, "-c", read], capture_output=True, text=True, check=True, env=env
    )
    assert version.stdout.strip() == torchdouble.VERSION


def test_the_double_is_the_same_bytes_every_time(tmp_path: Path) -> None:
    first = torchdouble.sha256(torchdouble.build(tmp_path / "a"))
    assert torchdouble.sha256(torchdouble.build(tmp_path / "b")) == first


@pytest.mark.skipif(not REAL.is_file(), reason=f"the real wheel {REAL} is absent")
def test_the_double_keeps_what_was_recorded_from_the_real_wheel(tmp_path: Path) -> None:
    double = torchdouble.build(tmp_path)
    assert double.name == REAL.name
    dist_info = f"torch-{torchdouble.VERSION}.dist-info"
    with zipfile.ZipFile(REAL) as real, zipfile.ZipFile(double) as fake:
        for member in (f"{dist_info}/WHEEL", f"{dist_info}/METADATA"):
            fields = ("Tag:", "Name:", "Version:", "Root-Is-Purelib:")
            assert [line for line in fake.read(member).decode().splitlines() if line.startswith(fields)] == [
                line for line in real.read(member).decode().splitlines() if line.startswith(fields)
            ]
        real_version: dict[str, object] = {}
        fake_version: dict[str, object] = {}
        exec(real.read("torch/version.py").decode(), real_version)  # noqa: S102 - a recorded file, read here
        exec(fake.read("torch/version.py").decode(), fake_version)  # noqa: S102
        for key in ("__version__", "cuda", "git_version"):
            assert fake_version[key] == real_version[key], key
