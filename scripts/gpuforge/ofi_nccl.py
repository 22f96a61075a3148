"""Which NCCL releases may run beside an aws-ofi-nccl release, for the CLI.

The rule is the collection's plugins/module_utils/ofi_nccl.py (the roles call it through the
gpuforge.gpu.ofi_nccl_range filter); this module reads data/aws_ofi_nccl.yml for it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import yaml
from ansible_collections.gpuforge.gpu.plugins.module_utils.ofi_nccl import TABLE_KEY, NcclRange, rows_of
from ansible_collections.gpuforge.gpu.plugins.module_utils.ofi_nccl import nccl_range as _nccl_range

from gpuforge import paths
from gpuforge.errors import UserError

__all__ = ["TABLE_KEY", "NcclRange", "nccl_range", "table"]


@cache
def table(path: Path | None = None) -> dict[str, dict[str, str]]:
    """Release -> {nccl_min, nccl_tested_max}, from data/aws_ofi_nccl.yml."""
    source = path or paths.aws_ofi_nccl_file()
    try:
        return rows_of(yaml.safe_load(source.read_text()) or {})
    except ValueError as exc:
        raise UserError(f"{source}: {exc}") from None


def nccl_range(plugin: str, rows: dict[str, dict[str, str]] | None = None) -> NcclRange:
    """The NCCL range for plugin release `plugin` (data/aws_ofi_nccl.yml unless `rows` is given)."""
    return _nccl_range(plugin, table() if rows is None else rows)
