"""TEST DOUBLE: a kilobyte stand-in for PyTorch's 190 MB CPU wheel, for bakes that assert nothing on torch.

The real wheel (/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl, served by every
lab's artifact server) takes pip about 85 s to unpack on a loaded 2-core machine, and importing it
another 6-8 s, in every bake. The bakes of tests/test_twins.py and tests/test_ami_local_bake.py assert
on the other components and on the image; the pytorch role only has to find torch at the pin. They
install this double instead. The real wheel is still installed and imported where torch itself is
asserted: molecule/stack (converge.yml pins its file name; its verifier imports it) and the benches
(gpuforge.bench.labrun bakes with the lab's own wheel).

What the double keeps from the real wheel, recorded from its dist-info and torch/version.py (read
with `unzip -p <wheel> torch-2.13.0+cpu.dist-info/WHEEL torch/version.py`): the file name, so the
pytorch role's pin check passes; Name, Version and the platform tag, so pip installs it into the
role's venv and importlib.metadata reads the pinned version; and the attributes the role's verify
step reads (torch.__version__, torch.version.cuda, torch.cuda.is_available(),
torch.distributed.is_nccl_available(), torch.__file__). Its Requires-Dist is left out on purpose: the
dependencies come from PyPI through the lab's proxy, which is what molecule/stack covers.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import yaml

from gpuforge.bench import labrun

# Recorded from the real wheel (see the module docstring).
FILE_NAME = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
VERSION = "2.13.0+cpu"
TAG = "cp311-cp311-manylinux_2_28_x86_64"
GIT_VERSION = "cf30153c4c131c8164ee7798e5022d810682e2cb"
MARKER = "gpuforge TEST DOUBLE of the torch CPU wheel"

_FILES = {
    "torch/__init__.py": f'"""{MARKER}: not PyTorch."""\n\n'
    "from . import cuda, distributed, version\n\n"
    f"__version__ = {VERSION!r}\n",
    "torch/version.py": f"# {MARKER}.\n"
    f"__version__ = {VERSION!r}\n"
    "debug = False\n"
    "cuda = None  # a CPU build\n"
    f"git_version = {GIT_VERSION!r}\n"
    "hip = None\nrocm = None\nxpu = None\n",
    "torch/cuda/__init__.py": f"# {MARKER}: a CPU build sees no GPU.\n\n\n"
    "def is_available():\n    return False\n",
    "torch/distributed/__init__.py": f"# {MARKER}: a CPU build has no NCCL.\n\n\n"
    "def is_nccl_available():\n    return False\n",
}
_DIST_INFO = f"torch-{VERSION}.dist-info"


def _metadata() -> dict[str, str]:
    return {
        f"{_DIST_INFO}/METADATA": "Metadata-Version: 2.1\n"
        "Name: torch\n"
        f"Version: {VERSION}\n"
        f"Summary: {MARKER}\n",
        f"{_DIST_INFO}/WHEEL": "Wheel-Version: 1.0\n"
        "Generator: gpuforge tests/torchdouble.py\n"
        "Root-Is-Purelib: false\n"
        f"Tag: {TAG}\n",
    }


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def build(directory: Path) -> Path:
    """Write the double as `directory`/FILE_NAME (same bytes every time: fixed timestamps); its path."""
    directory.mkdir(parents=True, exist_ok=True)
    members = {name: text.encode() for name, text in {**_FILES, **_metadata()}.items()}
    record = f"{_DIST_INFO}/RECORD"
    members[record] = (
        "".join(_record_line(name, data) for name, data in members.items()) + f"{record},,\n"
    ).encode()
    path = directory / FILE_NAME
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in members.items():
            wheel.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), data)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def bake_vars(artifacts: str, work_dir: Path) -> Path:
    """labrun.write_bake_vars, with the pytorch role pointed at the double, served by the lab.

    `artifacts` is the lab's GPUFORGE_LAB_ARTIFACTS (the directory its artifact server serves).
    """
    wheel = build(Path(artifacts) / "test-doubles")
    path = labrun.write_bake_vars(work_dir)
    merged = yaml.safe_load(path.read_text())
    merged.update(
        pytorch_version=VERSION.split("+")[0],
        pytorch_cuda_build=VERSION.split("+")[1],
        pytorch_wheel_url="{{ gpuforge_lab_server.url }}/test-doubles/" + FILE_NAME,
        pytorch_wheel_sha256=sha256(wheel),
    )
    path.write_text(yaml.safe_dump(merged))
    return path
