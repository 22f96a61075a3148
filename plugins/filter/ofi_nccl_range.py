"""Ansible filters gpuforge.gpu.ofi_nccl_range (the NCCL range an aws-ofi-nccl release is tested with)
and gpuforge.gpu.ofi_nccl_release_in_use (which release that is).

The rules are plugins/plugin_utils/ofi_nccl.py (the CLI imports it too); documented in
ofi_nccl_range.yml and ofi_nccl_release_in_use.yml beside this file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.gpuforge.gpu.plugins.plugin_utils import ofi_nccl


def ofi_nccl_range(release: Any, releases: Any, nccl: Any = "") -> dict[str, str]:
    """plugin, row, nccl_min, nccl_tested_max, note, and outside (why `nccl` is outside the range)."""
    try:
        rows = ofi_nccl.rows_of({ofi_nccl.TABLE_KEY: releases})
    except ValueError as exc:
        raise AnsibleFilterError(f"ofi_nccl_range: {exc}") from None
    return ofi_nccl.nccl_range(str(release or ""), rows).describe(str(nccl or "").strip())


def _mapping(value: Any) -> Mapping[str, Any] | None:
    """A play's empty value ('' or None, as `default` gives it) as no mapping; anything else as given."""
    return None if value is None or value == "" else value


def ofi_nccl_release_in_use(pin: Any, chosen: Any = "", decision: Any = None, record: Any = None) -> str:
    """The aws-ofi-nccl release in use (see ofi_nccl.release_in_use)."""
    try:
        return ofi_nccl.release_in_use(
            str(pin or ""),
            chosen=str(chosen or ""),
            decision=_mapping(decision),
            record=_mapping(record),
        )
    except ValueError as exc:
        raise AnsibleFilterError(
            f"ofi_nccl_release_in_use: {exc}; pass gpuforge_reality.aws_ofi_nccl and the parsed "
            "/etc/gpuforge/aws_ofi_nccl.json (rerun the aws_ofi_nccl role to rewrite a damaged one)"
        ) from None


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict[str, Any]:
        return {"ofi_nccl_range": ofi_nccl_range, "ofi_nccl_release_in_use": ofi_nccl_release_in_use}
