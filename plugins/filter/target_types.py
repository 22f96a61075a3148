"""Ansible filters for the decisions taken from an image's target instance types.

The rules are in plugins/plugin_utils/targets.py (which the CLI imports too); these are its entry
points for the roles, each documented in the .yml of its name beside this file:

- target_names: the types a node's software is for (given, else recorded, else its own);
- target_refusals: why those types cannot be served (unknown, unsupported, or beyond the pins);
- targets_nvswitch / targets_nvlink_subnet_manager: whether the image needs the fabric manager
  (and libnvidia-nscq) / NVIDIA's NVLink subnet manager;
- efa_targets: the types that have EFA (the aws-ofi-nccl plugin is required for them);
- targets_needing_open_modules: the types whose GPU runs only on NVIDIA's open kernel modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ansible.errors import AnsibleFilterError
from ansible_collections.gpuforge.gpu.plugins.plugin_utils import targets

T = TypeVar("T")


def _checked(filter_name: str, decide: Callable[[], T]) -> T:
    """`decide()`, its ValueError (plugin_utils.targets says what to pass) as the filter's error."""
    try:
        return decide()
    except ValueError as error:
        raise AnsibleFilterError(f"{filter_name}: {error}") from error


def target_names(
    given: Any, recorded: Any = None, own_type: Any = None, instance_types: Any = None
) -> list[str]:
    """gpuforge.gpu.target_names: see plugin_utils.targets.choose."""
    return _checked(
        "target_names",
        lambda: targets.choose(
            given, recorded, own_type, targets.mapping(instance_types, "gpuforge_instance_types")
        ),
    )


def target_refusals(
    names: Any, instance_types: Any, gpu_models: Any, unsupported: Any, versions: Any
) -> list[str]:
    """gpuforge.gpu.target_refusals: see plugin_utils.targets.refusals."""
    return _checked(
        "target_refusals", lambda: targets.refusals(names, instance_types, gpu_models, unsupported, versions)
    )


def _types(instance_types: Any) -> targets.Rows:
    return targets.mapping(instance_types, "gpuforge_instance_types")


def targets_nvswitch(names: Any, instance_types: Any) -> bool:
    """gpuforge.gpu.targets_nvswitch: see plugin_utils.targets.nvswitch."""
    return _checked(
        "targets_nvswitch", lambda: targets.nvswitch(targets.target_list(names), _types(instance_types))
    )


def targets_nvlink_subnet_manager(names: Any, instance_types: Any) -> bool:
    """gpuforge.gpu.targets_nvlink_subnet_manager: see plugin_utils.targets.nvlink_subnet_manager."""
    return _checked(
        "targets_nvlink_subnet_manager",
        lambda: targets.nvlink_subnet_manager(targets.target_list(names), _types(instance_types)),
    )


def efa_targets(names: Any, instance_types: Any) -> list[str]:
    """gpuforge.gpu.efa_targets: see plugin_utils.targets.efa."""
    return _checked("efa_targets", lambda: targets.efa(targets.target_list(names), _types(instance_types)))


def targets_needing_open_modules(names: Any, instance_types: Any, gpu_models: Any) -> list[str]:
    """gpuforge.gpu.targets_needing_open_modules: see plugin_utils.targets.open_modules."""
    return _checked(
        "targets_needing_open_modules",
        lambda: targets.open_modules(
            targets.target_list(names),
            _types(instance_types),
            targets.mapping(gpu_models, "gpuforge_gpu_models"),
        ),
    )


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict[str, Any]:
        return {
            "target_names": target_names,
            "target_refusals": target_refusals,
            "targets_nvswitch": targets_nvswitch,
            "targets_nvlink_subnet_manager": targets_nvlink_subnet_manager,
            "efa_targets": efa_targets,
            "targets_needing_open_modules": targets_needing_open_modules,
        }
