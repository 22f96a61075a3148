"""Where the repository's shared files live, so every module reads the same copy."""

from __future__ import annotations

import os
from pathlib import Path

from gpuforge.errors import UserError

_MARKER = "versions.yml"


def repo_root() -> Path:
    """Return the gpuforge checkout: $GPUFORGE_ROOT, else the one this package sits in."""
    env = os.environ.get("GPUFORGE_ROOT")
    if env:
        root = Path(env)
        if not (root / _MARKER).is_file():
            raise UserError(f"GPUFORGE_ROOT={env} has no {_MARKER}; point it at a gpuforge checkout")
        return root
    for parent in Path(__file__).resolve().parents:
        if (parent / _MARKER).is_file() and (parent / "roles").is_dir():
            return parent
    raise UserError("cannot find the gpuforge checkout; set GPUFORGE_ROOT to it")


def versions_file() -> Path:
    return repo_root() / "versions.yml"


def instance_types_file() -> Path:
    return repo_root() / "data" / "instance_types.yml"
