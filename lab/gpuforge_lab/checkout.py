"""The gpuforge checkout the lab belongs to (its test fixtures live under tests/).

The lab is installed only from a checkout (`pip install -e ./lab`), so it finds the checkout from its
own place (lab/gpuforge_lab/ in it); $GPUFORGE_ROOT overrides that, as it does for gpuforge.paths.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpuforge.errors import UserError


def root() -> Path:
    """The checkout: the directory with versions.yml, roles/ and tests/."""
    env = os.environ.get("GPUFORGE_ROOT")
    found = Path(env) if env else Path(__file__).resolve().parents[2]
    if not (found / "versions.yml").is_file() or not (found / "tests").is_dir():
        raise UserError(f"{found} is not a gpuforge checkout (the lab's fixtures live in its tests/)")
    return found


def fixtures_dir() -> Path:
    """tests/fixtures/artifacts: the sources the artifact server's fixtures are built from."""
    return root() / "tests" / "fixtures" / "artifacts"
