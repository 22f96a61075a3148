"""TEST DOUBLE of the PyTorch wheel versions.yml pins, with the production identity, a kilobyte in size.

The lab cannot reach download.pytorch.org and has no GPU. So that the pytorch role runs there with
its production defaults (pytorch_version and pytorch_cuda_build from versions.yml, the CUDA build's
NCCL check included) and only its download is pointed elsewhere (pytorch_wheel_url and
pytorch_wheel_sha256, inventory/group_vars/gpuforge_lab/artifact_sources.yml), every lab's artifact
server serves this stand-in under the real wheel's file name:

    test-doubles/torch-<pytorch.version>+<pytorch.cuda_build>-cp311-cp311-manylinux_2_28_x86_64.whl

(download.pytorch.org's naming for CUDA builds, e.g. .../whl/cu130/torch-2.11.0%2Bcu130-cp311-cp311-
manylinux_2_28_x86_64.whl; cp311 because lab hosts run Debian 12's Python 3.11).

What it reports, as the real CUDA wheel would on a host without a GPU (what the role's
roles/pytorch/tasks/install.yml and verify.yml read):
- importlib.metadata's version and torch.__version__: <version>+<cuda_build> (2.14.1+cu130);
- torch.version.cuda: the build's CUDA release (cu130 -> "13.0", PyTorch's cuNNN tags);
- torch.distributed.is_nccl_available(): True, and torch.cuda.nccl.version(): versions.yml's
  nccl.version as a tuple of ints, as torch/cuda/nccl.py's version() returns it (the CUDA wheel loads
  the nvidia-nccl-cu13 release its metadata pins, which versions.yml's NCCL pin is);
- torch.cuda.is_available(): False (no GPU on a lab host).

What it cannot show: it holds no CUDA kernels and no NCCL library, so nothing runs on a GPU and no
collective is exercised; its version attributes are constants written from versions.yml, not read
from a built library; it has no Requires-Dist (the real wheel's nvidia-* dependencies, gigabytes,
are not installed); torch.version.git_version is a marker, not the release's commit. A real GPU host
(the lent machine, the GPU smoke tests) covers those.
"""

from __future__ import annotations

import base64
import hashlib
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from gpuforge import versions
from gpuforge.errors import UserError

MARKER = "gpuforge TEST DOUBLE of the PyTorch wheel"
# Lab hosts are Debian 12 (Python 3.11); the CUDA wheels' platform tag on download.pytorch.org.
TAG = "cp311-cp311-manylinux_2_28_x86_64"
DIRECTORY = "test-doubles"


@dataclass(frozen=True)
class Identity:
    """What the double claims to be: the pinned release, its build and the NCCL it reports."""

    version: str  # 2.14.1
    cuda_build: str  # cu130 or cpu
    nccl: str  # 2.30.7 (ignored for a CPU build)

    @property
    def full_version(self) -> str:
        return f"{self.version}+{self.cuda_build}"

    @property
    def cuda(self) -> str | None:
        """torch.version.cuda: cu130 -> '13.0', cu128 -> '12.8'; None for a CPU build."""
        if self.cuda_build == "cpu":
            return None
        match = re.fullmatch(r"cu([0-9]+)([0-9])", self.cuda_build)
        if match is None:
            raise UserError(f"pytorch.cuda_build {self.cuda_build!r} is neither cpu nor a cuNNN tag")
        return f"{int(match[1])}.{match[2]}"

    @property
    def file_name(self) -> str:
        return f"torch-{self.full_version}-{TAG}.whl"


def pinned(manifest: versions.Manifest | None = None) -> Identity:
    """The identity versions.yml pins (pytorch.version, pytorch.cuda_build, nccl.version)."""
    pins = manifest or versions.load()
    return Identity(
        version=pins.version("pytorch"),
        cuda_build=pins.components["pytorch"]["cuda_build"],
        nccl=pins.version("nccl"),
    )


def _files(identity: Identity) -> dict[str, str]:
    cuda = identity.cuda
    nccl = tuple(int(part) for part in identity.nccl.split("."))
    return {
        "torch/__init__.py": f'"""{MARKER}: not PyTorch."""\n\n'
        "from . import cuda, distributed, version\n\n"
        f"__version__ = {identity.full_version!r}\n",
        "torch/version.py": f"# {MARKER}.\n"
        f"__version__ = {identity.full_version!r}\n"
        "debug = False\n"
        f"cuda = {cuda!r}\n"
        f"git_version = {MARKER!r}\n"
        "hip = None\nrocm = None\nxpu = None\n",
        "torch/cuda/__init__.py": f"# {MARKER}: a lab host has no GPU.\n\n"
        "from . import nccl\n\n\n"
        "def is_available():\n    return False\n",
        "torch/cuda/nccl.py": f"# {MARKER}: versions.yml's NCCL, as torch.cuda.nccl.version() gives it.\n\n\n"
        "def version():\n"
        + (f"    return {nccl!r}\n" if cuda else '    raise RuntimeError("a CPU build has no NCCL")\n'),
        "torch/distributed/__init__.py": f"# {MARKER}.\n\n\n"
        f"def is_nccl_available():\n    return {cuda is not None!r}\n",
    }


def _metadata(identity: Identity, dist_info: str) -> dict[str, str]:
    return {
        f"{dist_info}/METADATA": "Metadata-Version: 2.1\n"
        "Name: torch\n"
        f"Version: {identity.full_version}\n"
        f"Summary: {MARKER}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\n"
        "Generator: gpuforge gpuforge/artifacts/torchdouble.py\n"
        "Root-Is-Purelib: false\n"
        f"Tag: {TAG}\n",
    }


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def build(directory: Path, identity: Identity | None = None) -> Path:
    """Write the double as `directory`/<its file name> (same bytes every time); its path."""
    identity = identity or pinned()
    directory.mkdir(parents=True, exist_ok=True)
    dist_info = f"torch-{identity.full_version}.dist-info"
    texts = {**_files(identity), **_metadata(identity, dist_info)}
    members = {name: text.encode() for name, text in texts.items()}
    record = f"{dist_info}/RECORD"
    members[record] = ("".join(_record_line(n, d) for n, d in members.items()) + f"{record},,\n").encode()
    path = directory / identity.file_name
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in members.items():
            wheel.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), data)
    return path
