"""The decisions gpuforge takes from the instance types an image is for (DESIGN.md: targets), once.

Every hardware-dependent install of a bake (fabric manager and libnvidia-nscq, the NVLink subnet
manager, NVIDIA's open kernel modules, the aws-ofi-nccl plugin where EFA exists) follows the image's
target instance types, never the builder the bake runs on. The rules live here only: the roles call
them through the filters in plugins/filter/target_types.py, the CLI imports them (gpuforge.targets,
gpuforge.instance_types) from the collection the wheel installs.

Pure functions over the data as data/instance_types.yml and versions.yml load: `instance_types` is
gpuforge_instance_types (name -> row), `gpu_models` gpuforge_gpu_models, `unsupported`
gpuforge_unsupported_instance_types (name -> why), `pins` gpuforge_versions (component -> its fields,
'version' among them). Nothing here imports Ansible or YAML, so the CLI needs neither.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

Rows = Mapping[str, Mapping[str, Any]]

_NUMBER = re.compile(r"\d+")


def version_key(version: str) -> tuple[int, ...]:
    """Numeric fields of a release ('570.133.20' -> (570, 133, 20)); a packaging suffix is ignored."""
    return tuple(int(part) for part in _NUMBER.findall(str(version).split("-")[0]))


def names(value: str | Iterable[Any] | None) -> list[str]:
    """'p5.48xlarge, p5en.48xlarge' or a list -> the names in order, once each, blanks dropped."""
    items = str(value).split(",") if isinstance(value, str) else list(value or [])
    found: list[str] = []
    for item in items:
        name = str(item).strip()
        if name and name not in found:
            found.append(name)
    return found


def choose(
    given: str | Iterable[Any] | None,
    recorded: Iterable[Any] | None,
    own_type: str | None,
    instance_types: Rows,
) -> list[str]:
    """The types a node's software is for: those given (a bake passes the image's), else those its
    manifest recorded (the image it booted from, so a converge keeps the image's decisions), else its
    own instance type where that is a known one, else none. A value given is used as given (a blank
    one names none), never replaced by a fallback."""
    if given:
        return names(given)
    if recorded:
        return names(recorded)
    own = str(own_type or "").strip()
    return [own] if own in instance_types else []


def refusal(name: str, instance_types: Rows, unsupported: Mapping[str, Any]) -> str:
    """Why `name` is not a type gpuforge builds for ('' when it is one)."""
    if name in instance_types:
        return ""
    if name in unsupported:
        return f"instance type {name!r} is not supported: {unsupported[name]}"
    return f"unknown instance type {name!r}; known types: {', '.join(sorted(instance_types))}"


def unknown(targets: Iterable[str], instance_types: Rows, unsupported: Mapping[str, Any]) -> list[str]:
    """The refusals of every target that is unknown or unsupported, in order."""
    return [why for name in targets if (why := refusal(name, instance_types, unsupported))]


def _pinned(pins: Mapping[str, Any], component: str) -> str:
    return str((pins.get(component) or {}).get("version") or "")


def _below(pinned: str, minimum: Any) -> bool:
    return bool(minimum) and version_key(pinned) < version_key(str(minimum))


def _gpu_problems(name: str, row: Mapping[str, Any], gpu_models: Rows, pins: Mapping[str, Any]) -> list[str]:
    model_name = row.get("gpu_model") or ""
    model = gpu_models.get(model_name)
    if model is None:
        return [
            f"{name}: its GPU model {model_name!r} has no row in gpuforge_gpu_models "
            "(data/instance_types.yml), so gpuforge cannot tell which driver supports it"
        ]
    found = []
    for component, key, what in (("nvidia_driver", "min_driver", "driver"), ("cuda", "min_cuda", "CUDA")):
        pinned, minimum = _pinned(pins, component), model.get(key)
        if _below(pinned, minimum):
            found.append(
                f"{name}: the pinned {what} {pinned} does not support its {model_name} "
                f"({model.get('architecture')}, compute capability {model.get('compute_capability')}); "
                f"it needs {minimum} or later (versions.yml {component})"
            )
    return found


def _plugin_problems(name: str, row: Mapping[str, Any], pins: Mapping[str, Any]) -> list[str]:
    plugin = row.get("aws_ofi_nccl") or {}
    found = []
    for component, key in (("aws_ofi_nccl", "min_version"), ("nccl", "min_nccl")):
        pinned, minimum = _pinned(pins, component), plugin.get(key)
        if _below(pinned, minimum):
            found.append(
                f"{name}: the pinned {component} {pinned} is older than the {minimum} the "
                f"aws-ofi-nccl platform settings for this type need (versions.yml {component})"
            )
    return found


def problems(name: str, instance_types: Rows, gpu_models: Rows, pins: Mapping[str, Any]) -> list[str]:
    """Why the pinned driver, CUDA, aws-ofi-nccl or NCCL cannot serve known type `name` (empty when
    they can): a GPU needs its model's minimum driver and CUDA, a type with aws-ofi-nccl platform
    settings the plugin and NCCL releases that have them."""
    row = instance_types[name]
    found = _gpu_problems(name, row, gpu_models, pins) if int(row.get("gpus") or 0) > 0 else []
    return found + _plugin_problems(name, row, pins)


def refusals(
    targets: Iterable[str],
    instance_types: Rows,
    gpu_models: Rows,
    unsupported: Mapping[str, Any],
    pins: Mapping[str, Any],
) -> list[str]:
    """Every reason to refuse these targets: unknown or unsupported types first (then nothing else
    is checked), else what the pins cannot serve. Empty when the image can be built for them."""
    listed = list(targets)
    refused = unknown(listed, instance_types, unsupported)
    if refused:
        return refused
    return [why for name in listed for why in problems(name, instance_types, gpu_models, pins)]


def _rows(targets: Iterable[str], instance_types: Rows) -> list[Mapping[str, Any]]:
    return [instance_types.get(name) or {} for name in targets or []]


def nvswitch(targets: Iterable[str], instance_types: Rows) -> bool:
    """Some target has NVSwitch: the image needs the fabric manager and libnvidia-nscq."""
    return any(bool(row.get("nvswitch")) for row in _rows(targets, instance_types))


def nvlink_subnet_manager(targets: Iterable[str], instance_types: Rows) -> bool:
    """Some target has fourth-generation NVSwitch (HGX B200): the image needs nvlsm too."""
    return any(bool(row.get("nvlink_subnet_manager")) for row in _rows(targets, instance_types))


def efa(targets: Iterable[str], instance_types: Rows) -> list[str]:
    """The targets, in order, whose row promises one or more EFA interfaces (the aws_ofi_nccl role
    refuses to leave an image for them without the plugin: NCCL would fall back to TCP sockets)."""
    return [
        str(name)
        for name in targets or []
        if int((instance_types.get(name) or {}).get("efa_interfaces") or 0) > 0
    ]


def open_modules(targets: Iterable[str], instance_types: Rows, gpu_models: Rows) -> list[str]:
    """The targets whose GPU model runs only on NVIDIA's open kernel modules (`kernel_module: open`
    in its gpuforge_gpu_models row: Blackwell)."""
    found = []
    for name in targets or []:
        model = (instance_types.get(name) or {}).get("gpu_model") or ""
        if (gpu_models.get(model) or {}).get("kernel_module") == "open":
            found.append(str(name))
    return found
