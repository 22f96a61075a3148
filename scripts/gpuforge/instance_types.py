"""Hardware facts per instance type from data/instance_types.yml."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from gpuforge import paths
from gpuforge.errors import UserError


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


@cache
def _load(path: Path) -> dict[str, InstanceType]:
    data = yaml.safe_load(path.read_text())["gpuforge_instance_types"]
    return {name: InstanceType(name=name, **facts) for name, facts in data.items()}


def all_types(path: Path | None = None) -> dict[str, InstanceType]:
    return _load(path or paths.instance_types_file())


def get(name: str, path: Path | None = None) -> InstanceType:
    """Facts for one type; an unknown type is a user error listing the known ones."""
    types = all_types(path)
    try:
        return types[name]
    except KeyError:
        known = ", ".join(sorted(types))
        raise UserError(f"unknown instance type {name!r}; known types: {known}") from None
