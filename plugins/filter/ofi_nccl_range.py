"""Ansible filter gpuforge.gpu.ofi_nccl_range: the NCCL range an aws-ofi-nccl release is tested with.

The rule is plugins/module_utils/ofi_nccl.py (the CLI imports it too); documented in ofi_nccl_range.yml
beside this file.
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.gpuforge.gpu.plugins.module_utils import ofi_nccl


def ofi_nccl_range(release: Any, releases: Any, nccl: Any = "") -> dict[str, str]:
    """plugin, row, nccl_min, nccl_tested_max, note, and outside (why `nccl` is outside the range)."""
    try:
        rows = ofi_nccl.rows_of({ofi_nccl.TABLE_KEY: releases})
    except ValueError as exc:
        raise AnsibleFilterError(f"ofi_nccl_range: gpuforge_aws_ofi_nccl_releases {exc}") from None
    return ofi_nccl.nccl_range(str(release or ""), rows).describe(str(nccl or "").strip())


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict[str, Any]:
        return {"ofi_nccl_range": ofi_nccl_range}
