"""Which NCCL releases may run beside an aws-ofi-nccl release (data/aws_ofi_nccl.yml).

roles/gpuforge_common/tasks/ofi_nccl_range.yml answers the same question on hosts (the nccl role
asks it about the plugin the aws_ofi_nccl role adopted or built); tests/test_ofi_nccl_range.py runs
both over the same cases.

The range of a plugin release is its own row of the table; a release without a row gets the row of
the newest release older than it, with a note asking for its row (a newer plugin is assumed to work
with at least the NCCL its predecessor was tested with, never with more); a release older than every
row has no range, so no NCCL counts as compatible with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from gpuforge import paths
from gpuforge.errors import UserError
from gpuforge.policy import compare, version_key

TABLE_KEY = "gpuforge_aws_ofi_nccl_releases"


@dataclass(frozen=True)
class NcclRange:
    """The NCCL range that applies to one plugin release."""

    plugin: str  # the release asked about
    row: str  # the table row used ('' when none applies)
    nccl_min: str
    nccl_tested_max: str

    @property
    def note(self) -> str:
        """Why the range is not the release's own ('' when it is)."""
        if not self.row:
            return (
                f"aws-ofi-nccl {self.plugin} is older than every release in data/aws_ofi_nccl.yml: "
                "no NCCL range is known for it"
            )
        if compare(self.row, self.plugin) != 0:
            return (
                f"aws-ofi-nccl {self.plugin} has no row in data/aws_ofi_nccl.yml: using the range of "
                f"{self.row} (NCCL {self.nccl_min} to {self.nccl_tested_max}); "
                "add its row from its RELEASENOTES.md"
            )
        return ""

    def check(self, nccl: str) -> str:
        """Why `nccl` is outside the range ('' when it is inside, or when no NCCL is given)."""
        if not nccl.strip():
            return ""
        if not self.row:
            return f"no tested NCCL range is known for aws-ofi-nccl {self.plugin}"
        if compare(nccl, self.nccl_min) < 0:
            return f"older than {self.nccl_min}, the oldest NCCL aws-ofi-nccl {self.plugin} supports"
        if compare(nccl, self.nccl_tested_max) > 0:
            return (
                f"newer than {self.nccl_tested_max}, "
                f"the newest NCCL aws-ofi-nccl {self.plugin} is tested with"
            )
        return ""


@cache
def table(path: Path | None = None) -> dict[str, dict[str, str]]:
    """Release -> {nccl_min, nccl_tested_max}, from data/aws_ofi_nccl.yml."""
    source = path or paths.aws_ofi_nccl_file()
    rows = (yaml.safe_load(source.read_text()) or {}).get(TABLE_KEY)
    if not isinstance(rows, dict) or not rows:
        raise UserError(f"{source}: needs a non-empty {TABLE_KEY} mapping")
    return {str(release): {k: str(v) for k, v in row.items()} for release, row in rows.items()}


def nccl_range(plugin: str, rows: dict[str, dict[str, str]] | None = None) -> NcclRange:
    """The NCCL range for plugin release `plugin` (see the module docstring)."""
    rows = table() if rows is None else rows
    older = [release for release in rows if compare(release, plugin) <= 0]
    if not plugin.strip() or not older:
        return NcclRange(plugin=plugin, row="", nccl_min="", nccl_tested_max="")
    row = max(older, key=version_key)
    return NcclRange(
        plugin=plugin, row=row, nccl_min=rows[row]["nccl_min"], nccl_tested_max=rows[row]["nccl_tested_max"]
    )
