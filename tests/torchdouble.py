"""TEST DOUBLE of the pinned PyTorch wheel, for the bakes of the twins and golden images (tests' side).

The double itself is built by gpuforge_lab.artifacts.torchdouble (its docstring says what it reports and
what it cannot show: no CUDA kernels, no NCCL library), and every lab's artifact server serves it
(gpuforge_lab.artifacts.fixtures, test-doubles/ and fixture.json's torch_double). It carries the
production identity from versions.yml (torch-2.14.1+cu130-...whl, torch.version.cuda 13.0, NCCL
2.30.7), so the pytorch role runs with its defaults and only pytorch_wheel_url and
pytorch_wheel_sha256 point at the lab (inventory/group_vars/gpuforge_lab/artifacts.yml), in the
bakes here as in `make demo` and Molecule's stack scenario.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from gpuforge_lab.artifacts import torchdouble
from gpuforge_lab.bench import labrun

IDENTITY = torchdouble.pinned()
FILE_NAME = IDENTITY.file_name
VERSION = IDENTITY.full_version
MARKER = torchdouble.MARKER


def build(directory: Path) -> Path:
    """Write the double as `directory`/FILE_NAME (same bytes every time); its path."""
    return torchdouble.build(directory, IDENTITY)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def bake_vars(artifacts: str, work_dir: Path) -> Path:
    """labrun.write_bake_vars for a lab whose artifact server serves the double (`artifacts` is its
    GPUFORGE_LAB_ARTIFACTS): the lab's artifact sources only, no pytorch version or build override."""
    served = json.loads((Path(artifacts) / "fixture.json").read_text()).get("torch_double", {})
    if served.get("file") != FILE_NAME:
        raise AssertionError(
            f"the lab at {artifacts} serves {served.get('file')!r}, not the double of the pin {FILE_NAME}"
        )
    return labrun.write_bake_vars(work_dir)
