"""Hardware facts per instance type from data/instance_types.yml."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

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
def catalog(path: Path | None = None) -> Catalog:
    data = yaml.safe_load((path or paths.instance_types_file()).read_text())
    return Catalog(
        types={name: _instance_type(name, dict(f)) for name, f in data["gpuforge_instance_types"].items()},
        gpu_models={
            name: GpuModel(name=name, **f) for name, f in data.get("gpuforge_gpu_models", {}).items()
        },
        unsupported={str(k): str(v) for k, v in data.get("gpuforge_unsupported_instance_types", {}).items()},
    )


def all_types(path: Path | None = None) -> dict[str, InstanceType]:
    return catalog(path).types


def get(name: str, path: Path | None = None) -> InstanceType:
    """Facts for one type; an unsupported or unknown type is a user error saying why."""
    cat = catalog(path)
    try:
        return cat.types[name]
    except KeyError:
        if name in cat.unsupported:
            raise UserError(f"instance type {name!r} is not supported: {cat.unsupported[name]}") from None
        known = ", ".join(sorted(cat.types))
        raise UserError(f"unknown instance type {name!r}; known types: {known}") from None
