"""A cluster config's backup, made before `gpuforge roll` writes over it."""

from __future__ import annotations

import datetime
from pathlib import Path

from gpuforge.errors import UserError


def backup(path: Path) -> Path:
    """Copy path beside itself, named by the UTC time, never over an earlier backup."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    data = path.read_bytes()
    for n in range(100):
        copy = path.with_name(f"{path.name}.{stamp}{f'.{n}' if n else ''}.bak")
        try:
            with copy.open("xb") as handle:
                handle.write(data)
        except FileExistsError:
            continue
        return copy
    raise UserError(f"cannot name a backup of {path}: too many backups this second")
