"""Hardware facts per instance type from data/instance_types.yml.

Which types gpuforge builds for, and the words of a refusal, are the collection's
plugins/plugin_utils/targets.py (the roles use the same through filters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from ansible_collections.gpuforge.gpu.plugins.plugin_utils import targets as target_rules

from gpuforge import paths
from gpuforge.errors import UserError


@dataclass(frozen=True)
class PluginFacts:
    """What the aws-ofi-nccl plugin needs and sets on a type (data/instance_types.yml aws_ofi_nccl)."""

    # The plugin and NCCL releases an image for the type needs ('' where the type needs none).
    min_version: str = ""
    min_nccl: str = ""
    # What the plugin sets itself on the type; gpuforge leaves these to it.
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpus: int
    efa_interfaces: int
    network_gbps: int
    nvswitch: bool
    gpu_model: str | None = None
    gpu_memory_gib: int | None = None
    # Expected multi-node all_reduce_perf bus bandwidth, GB/s (see data/instance_types.yml).
    nccl_allreduce_busbw_gb_s: float | None = None
    # Fourth-generation NVSwitch (HGX B200): NVIDIA's NVLink Subnet Manager runs next to the fabric manager.
    nvlink_subnet_manager: bool = False
    aws_ofi_nccl: PluginFacts | None = None


@dataclass(frozen=True)
class GpuModel:
    name: str
    architecture: str
    compute_capability: str
    # Oldest driver release / CUDA release that support the GPU, where NVIDIA publishes one.
    min_driver: str | None = None
    min_cuda: str | None = None
    # The only kernel module flavor NVIDIA supports for the GPU ("open" for Blackwell), if any.
    kernel_module: str | None = None


@dataclass(frozen=True)
class Catalog:
    types: dict[str, InstanceType]
    gpu_models: dict[str, GpuModel]
    # Known types gpuforge does not build images for -> why.
    unsupported: dict[str, str]


def _instance_type(name: str, facts: dict[str, Any]) -> InstanceType:
    plugin = facts.pop("aws_ofi_nccl", None)
    return InstanceType(
        name=name,
        aws_ofi_nccl=PluginFacts(**plugin) if plugin else None,
        **facts,
    )


@cache
def data(path: Path | None = None) -> dict[str, Any]:
    """data/instance_types.yml as the roles load it (gpuforge_instance_types, gpuforge_gpu_models,
    gpuforge_unsupported_instance_types), for the collection's target rules."""
    loaded = yaml.safe_load((path or paths.instance_types_file()).read_text()) or {}
    return {
        "gpuforge_instance_types": loaded.get("gpuforge_instance_types") or {},
        "gpuforge_gpu_models": loaded.get("gpuforge_gpu_models") or {},
        "gpuforge_unsupported_instance_types": loaded.get("gpuforge_unsupported_instance_types") or {},
    }


@cache
def catalog(path: Path | None = None) -> Catalog:
    rows = data(path)
    return Catalog(
        types={name: _instance_type(name, dict(f)) for name, f in rows["gpuforge_instance_types"].items()},
        gpu_models={name: GpuModel(name=name, **f) for name, f in rows["gpuforge_gpu_models"].items()},
        unsupported={str(k): str(v) for k, v in rows["gpuforge_unsupported_instance_types"].items()},
    )


def all_types(path: Path | None = None) -> dict[str, InstanceType]:
    return catalog(path).types


def get(name: str, path: Path | None = None) -> InstanceType:
    """Facts for one type; an unsupported or unknown type is a user error saying why."""
    rows = data(path)
    refused = target_rules.refusal(
        name, rows["gpuforge_instance_types"], rows["gpuforge_unsupported_instance_types"]
    )
    if refused:
        raise UserError(refused)
    return catalog(path).types[name]
