"""The decisions gpuforge takes from the instance types an image is for, once (docs/architecture.md#targets).

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

from collections.abc import Iterable, Mapping
from typing import Any

from ansible_collections.gpuforge.gpu.plugins.plugin_utils.policy import compare

Rows = Mapping[str, Mapping[str, Any]]


def mapping(value: Any, what: str, *, required: bool = False) -> Mapping[str, Any]:
    """`value` when it is a mapping ({} for none, unless it is `required`); ValueError naming `what`
    otherwise."""
    if value is None and not required:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a mapping (as its data file loads), not {type(value).__name__}")
    return value


def target_list(value: Any) -> list[str]:
    """The target names of a list (none for None); ValueError for anything else, such as a string,
    which names() splits but a decision must not iterate character by character."""
    if value is None:
        return []
    if isinstance(value, (str, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(
            f"the targets must be a list of instance type names (gpuforge_targets), not {value!r}"
        )
    return [str(name) for name in value]


def count(row: Mapping[str, Any], key: str, name: str) -> int:
    """A whole-number field of instance type `name`'s row (0 when absent); ValueError otherwise."""
    value = row.get(key) or 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"instance type {name}: {key} is {value!r}, not a whole number (data/instance_types.yml)"
        ) from None


def names(value: str | Iterable[Any] | None) -> list[str]:
    """'p5.48xlarge, p5en.48xlarge' or a list -> the names in order, once each, blanks dropped;
    ValueError for anything else (a number, a mapping)."""
    if value is not None and (isinstance(value, Mapping) or not isinstance(value, (str, Iterable))):
        raise ValueError(f"instance types must be a list of names or a comma-separated string, not {value!r}")
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
    own instance type where that is a known one, else none. A given value that names no type (None,
    an empty list, '' or only blanks and commas) is as if none was given: the fallbacks apply."""
    chosen = names(given)
    if chosen:
        return chosen
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
    entry = pins.get(component) or {}
    return str((entry.get("version") if isinstance(entry, Mapping) else "") or "").strip()


def _unpinned(pinned: str, minimum: Any, component: str, name: str) -> str:
    """The refusal of type `name`, which needs `component` `minimum` or later, where versions.yml
    pins no `component` ('' where it pins one or nothing is needed). Refused rather than skipped:
    gpuforge cannot vouch that an image serves the type with a release it does not pin (and a
    missing pin compared as '' would read as older than everything, naming no release)."""
    if not minimum or pinned:
        return ""
    return f"{name}: no {component} pinned; this type needs {minimum} or later (pin it in versions.yml)"


def _older(pinned: str, minimum: Any) -> bool:
    return bool(minimum) and bool(pinned) and compare(pinned, str(minimum)) < 0


def _gpu_problems(name: str, row: Mapping[str, Any], gpu_models: Rows, pins: Mapping[str, Any]) -> list[str]:
    model_name = str(row.get("gpu_model") or "")
    model = gpu_models.get(model_name)
    if model is None:
        return [
            f"{name}: its GPU model {model_name!r} has no row in gpuforge_gpu_models "
            "(data/instance_types.yml), so gpuforge cannot tell which driver supports it"
        ]
    found = []
    for component, key, what in (("nvidia_driver", "min_driver", "driver"), ("cuda", "min_cuda", "CUDA")):
        pinned, minimum = _pinned(pins, component), model.get(key)
        if missing := _unpinned(pinned, minimum, component, name):
            found.append(missing)
        elif _older(pinned, minimum):
            found.append(
                f"{name}: the pinned {what} {pinned} does not support its {model_name} "
                f"({model.get('architecture')}, compute capability {model.get('compute_capability')}); "
                f"it needs {minimum} or later (versions.yml {component})"
            )
    return found


def _plugin_problems(name: str, row: Mapping[str, Any], pins: Mapping[str, Any]) -> list[str]:
    plugin = mapping(row.get("aws_ofi_nccl"), f"instance type {name}: aws_ofi_nccl")
    found = []
    for component, key in (("aws_ofi_nccl", "min_version"), ("nccl", "min_nccl")):
        pinned, minimum = _pinned(pins, component), plugin.get(key)
        if missing := _unpinned(pinned, minimum, component, name):
            found.append(missing)
        elif _older(pinned, minimum):
            found.append(
                f"{name}: the pinned {component} {pinned} is older than the {minimum} the "
                f"aws-ofi-nccl platform settings for this type need (versions.yml {component})"
            )
    return found


def problems(name: str, instance_types: Rows, gpu_models: Rows, pins: Mapping[str, Any]) -> list[str]:
    """Why the pinned driver, CUDA, aws-ofi-nccl or NCCL cannot serve known type `name` (empty when
    they can): a GPU needs its model's minimum driver and CUDA, a type with aws-ofi-nccl platform
    settings the plugin and NCCL releases that have them."""
    row = mapping(instance_types[name], f"instance type {name}'s row")
    found = _gpu_problems(name, row, gpu_models, pins) if count(row, "gpus", name) > 0 else []
    return found + _plugin_problems(name, row, pins)


def refusals(
    targets: Iterable[str],
    instance_types: Rows,
    gpu_models: Rows,
    unsupported: Mapping[str, Any],
    pins: Mapping[str, Any],
) -> list[str]:
    """Every reason to refuse these targets: unknown or unsupported types first (then nothing else
    is checked), else what the pins cannot serve. Empty when the image can be built for them.
    ValueError, saying what to pass, when an input is not of the shape its data file loads."""
    listed = target_list(targets)
    types = mapping(instance_types, "gpuforge_instance_types", required=True)
    models = mapping(gpu_models, "gpuforge_gpu_models")
    refused = unknown(listed, types, mapping(unsupported, "gpuforge_unsupported_instance_types"))
    if refused:
        return refused
    pinned = mapping(pins, "gpuforge_versions", required=True)
    return [why for name in listed for why in problems(name, types, models, pinned)]


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
        if count(instance_types.get(name) or {}, "efa_interfaces", str(name)) > 0
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
