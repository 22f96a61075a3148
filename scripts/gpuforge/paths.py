"""Where gpuforge's shared files live (versions.yml, data/, packer/, playbooks and roles).

One copy of each file, at the repository root. A checkout reads them there; the wheel carries them
as the Ansible collection gpuforge.gpu (pyproject maps the repository root to
site-packages/ansible_collections/gpuforge/gpu), so an installed `gpuforge` reads them there.
$GPUFORGE_ROOT overrides both.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpuforge.errors import UserError

_MARKER = "versions.yml"
_PACKAGE = Path(__file__).resolve().parent
# Where the wheel installs the shared files, beside this package.
_INSTALLED = _PACKAGE.parent / "ansible_collections" / "gpuforge" / "gpu"


def _checkout() -> Path | None:
    """The checkout this package sits in (scripts/gpuforge), if it does."""
    root = _PACKAGE.parents[1]
    if (root / _MARKER).is_file() and (root / "roles").is_dir() and (root / "scripts").is_dir():
        return root
    return None


def share_root() -> Path:
    """The directory with versions.yml, data/, packer/, playbooks/ and roles/."""
    env = os.environ.get("GPUFORGE_ROOT")
    if env:
        root = Path(env)
        if not (root / _MARKER).is_file():
            raise UserError(f"GPUFORGE_ROOT={env} has no {_MARKER}; point it at a gpuforge checkout")
        return root
    checkout = _checkout()
    if checkout is not None:
        return checkout
    if (_INSTALLED / _MARKER).is_file():
        return _INSTALLED
    raise UserError(f"gpuforge's data files are missing (no {_INSTALLED / _MARKER}); reinstall gpuforge")


# The older name: in a checkout, share_root() is the checkout.
repo_root = share_root


def versions_file() -> Path:
    return share_root() / "versions.yml"


def instance_types_file() -> Path:
    return share_root() / "data" / "instance_types.yml"


def packer_dir() -> Path:
    return share_root() / "packer"


def build_dir() -> Path:
    """Where commands keep their work files: build/ in the checkout, else in the current directory
    (never inside site-packages)."""
    root = os.environ.get("GPUFORGE_ROOT") or _checkout()
    return (Path(root) if root else Path.cwd()) / "build"
