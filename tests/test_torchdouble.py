"""The TEST DOUBLE of the pinned PyTorch wheel (gpuforge_lab.artifacts.torchdouble) passes what the role
reads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

import torchdouble
from gpuforge_lab.artifacts import fixtures

REPO = Path(__file__).resolve().parents[1]
PINS = yaml.safe_load((REPO / "versions.yml").read_text())["gpuforge_versions"]


def _unpacked(tmp_path: Path) -> Path:
    wheel = torchdouble.build(tmp_path / "wheels")
    # Where the role's venv has it: the probe reads the Python release from the path.
    site = tmp_path / "venv/lib/python3.11/site-packages"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def _run(code: str, site: Path) -> str:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(site)},
    ).stdout


def test_the_double_is_named_as_the_pinned_cuda_wheel(tmp_path: Path) -> None:
    """The file name the pytorch role's pin check reads: versions.yml's release and CUDA build."""
    wheel = torchdouble.build(tmp_path)
    pinned = f"{PINS['pytorch']['version']}+{PINS['pytorch']['cuda_build']}"
    assert wheel.name == f"torch-{pinned}-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert pinned == torchdouble.VERSION


def test_the_role_reads_the_pinned_cuda_build_and_nccl_from_the_double(tmp_path: Path) -> None:
    """The pytorch role's own version read and verify probe, run against the unpacked double: what its
    verify step asserts for a CUDA build (the pinned version and NCCL) holds."""
    site = _unpacked(tmp_path)
    tasks = yaml.safe_load((REPO / "roles/pytorch/tasks/verify.yml").read_text())
    found = json.loads(_run(tasks[0]["ansible.builtin.command"]["argv"][2], site))
    cuda_build = PINS["pytorch"]["cuda_build"]  # cu130 -> CUDA 13.0
    assert found == {
        "torch": f"{PINS['pytorch']['version']}+{cuda_build}",
        "cuda_build": f"{int(cuda_build[2:-1])}.{cuda_build[-1]}",
        "cuda_available": False,
        "nccl": PINS["nccl"]["version"],
        "python": "python3.11",
    }
    read = "import importlib.metadata as m; print(m.version('torch'))"  # roles/pytorch/tasks/install.yml
    assert _run(read, site).strip() == torchdouble.VERSION


def test_the_double_says_it_is_one(tmp_path: Path) -> None:
    site = _unpacked(tmp_path)
    assert "TEST DOUBLE" in _run("import torch; print(torch.__doc__, torch.version.git_version)", site)


def test_the_double_is_the_same_bytes_every_time(tmp_path: Path) -> None:
    first = torchdouble.sha256(torchdouble.build(tmp_path / "a"))
    assert torchdouble.sha256(torchdouble.build(tmp_path / "b")) == first


@pytest.mark.skipif(shutil.which("gpg") is None, reason="the fixtures are signed with gpg")
def test_every_lab_serves_the_double_and_records_it(tmp_path: Path) -> None:
    """gpuforge_lab.artifacts.fixtures (what `gpuforge-lab up` and Molecule's stack scenario run) serves the
    double under test-doubles/ and records its file and sha256 in fixture.json."""
    built = fixtures.build(tmp_path, "9.8.7")
    record = json.loads((tmp_path / "fixture.json").read_text())
    served = tmp_path / "test-doubles" / torchdouble.FILE_NAME
    assert (
        record["torch_double"]
        == built.torch_double
        == {
            "file": torchdouble.FILE_NAME,
            "sha256": torchdouble.sha256(served),
        }
    )
    (tmp_path / "work").mkdir()
    assert torchdouble.bake_vars(str(tmp_path), tmp_path / "work").is_file()
