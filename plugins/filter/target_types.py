"""Ansible filter gpuforge.gpu.efa_targets: which of an image's target instance types have EFA.

A decision that several roles need from data/instance_types.yml (aws_ofi_nccl refuses to leave an
image for such a type without the plugin: NCCL would fall back to TCP sockets there).
"""

from __future__ import annotations

from typing import Any


def efa_targets(targets: Any, instance_types: dict[str, Any]) -> list[str]:
    """The names in `targets` whose row in gpuforge_instance_types promises one or more EFA interfaces."""
    return [
        str(name)
        for name in targets or []
        if int((instance_types.get(name) or {}).get("efa_interfaces") or 0) > 0
    ]


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict[str, Any]:
        return {"efa_targets": efa_targets}
