"""The instance types an image is baked for: parsed, checked against the pins, carried to Ansible and tags.

Every hardware-dependent install decision of a bake (fabric manager and libnvidia-nscq, the NVLink
subnet manager, which GPUs the driver branch and CUDA must support, the aws-ofi-nccl/NCCL releases a
type needs) is taken from these targets, never from the builder the bake happens to run on.
roles/gpuforge_common/tasks/targets.yml is the Ansible reader of the same facts; a test runs both on
the same cases.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpuforge import instance_types, versions
from gpuforge.errors import UserError
from gpuforge.instance_types import InstanceType

TARGETS_TAG = "gpuforge:target-instance-types"
# The Ansible variable every role reads the targets from (gpuforge_common publishes their facts).
ANSIBLE_VAR = "gpuforge_target_instance_types"
# What `gpuforge bake` targets when --target-instance-types is not given (docs/ami-pipeline.md):
# the NVSwitch H100/H200 types, so the default image carries the fabric manager.
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "dlami": ("p5.48xlarge", "p5en.48xlarge"),
    "pcluster": ("p5.48xlarge", "p5en.48xlarge"),
}
# EC2 allows 256 characters in a tag value.
_TAG_VALUE_MAX = 256


def version_key(version: str) -> tuple[int, ...]:
    """Numeric fields of a release ('570.133.20' -> (570, 133, 20)); a packaging suffix is ignored."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("-")[0]))


def parse(text: str) -> tuple[str, ...]:
    """'p5.48xlarge, p5en.48xlarge' -> the names in order, once each; empty is a user error."""
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        if name and name not in names:
            names.append(name)
    if not names:
        raise UserError("--target-instance-types needs at least one instance type, such as p5.48xlarge")
    return tuple(names)


def problems(itype: InstanceType, manifest: versions.Manifest, path: Path | None = None) -> list[str]:
    """Why the pinned stack cannot serve itype (empty when it can)."""
    found: list[str] = []
    cat = instance_types.catalog(path)
    if itype.gpus > 0:
        model = cat.gpu_models.get(itype.gpu_model or "")
        if model is None:
            found.append(
                f"{itype.name}: its GPU model {itype.gpu_model!r} has no row in gpuforge_gpu_models "
                "(data/instance_types.yml), so gpuforge cannot tell which driver supports it"
            )
        else:
            pins = (
                ("nvidia_driver", model.min_driver, "driver"),
                ("cuda", model.min_cuda, "CUDA"),
            )
            for component, minimum, what in pins:
                pinned = manifest.version(component)
                if minimum and version_key(pinned) < version_key(minimum):
                    found.append(
                        f"{itype.name}: the pinned {what} {pinned} does not support its {model.name} "
                        f"({model.architecture}, compute capability {model.compute_capability}); "
                        f"it needs {minimum} or later (versions.yml {component})"
                    )
    plugin = itype.aws_ofi_nccl
    if plugin is not None:
        for component, minimum in (("aws_ofi_nccl", plugin.min_version), ("nccl", plugin.min_nccl)):
            pinned = manifest.version(component)
            if minimum and version_key(pinned) < version_key(minimum):
                found.append(
                    f"{itype.name}: the pinned {component} {pinned} is older than the {minimum} the "
                    f"aws-ofi-nccl platform settings for this type need (versions.yml {component})"
                )
    return found


@dataclass(frozen=True)
class Targets:
    types: tuple[InstanceType, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.types)

    @property
    def nvswitch(self) -> bool:
        """Some target has NVSwitch: the image needs the fabric manager and libnvidia-nscq."""
        return any(t.nvswitch for t in self.types)

    @property
    def nvlink_subnet_manager(self) -> bool:
        """Some target has fourth-generation NVSwitch: the image needs nvlsm too."""
        return any(t.nvlink_subnet_manager for t in self.types)

    @property
    def tag_value(self) -> str:
        return ",".join(self.names)

    def tags(self) -> dict[str, str]:
        return {TARGETS_TAG: self.tag_value}

    def ansible_vars(self) -> dict[str, list[str]]:
        return {ANSIBLE_VAR: list(self.names)}


def resolve(names: Iterable[str], manifest: versions.Manifest, path: Path | None = None) -> Targets:
    """Facts for each named type, refused (UserError naming the type) when unknown, unsupported, or
    not served by the pinned driver/CUDA/aws-ofi-nccl/NCCL."""
    types = tuple(instance_types.get(name, path) for name in names)
    if not types:
        raise UserError("an image needs at least one target instance type")
    found = [p for t in types for p in problems(t, manifest, path)]
    if found:
        raise UserError(
            "the pinned versions cannot serve these target instance types:\n  " + "\n  ".join(found)
        )
    targets = Targets(types)
    if len(targets.tag_value) > _TAG_VALUE_MAX:
        raise UserError(
            f"{len(types)} target instance types do not fit one image tag ({_TAG_VALUE_MAX} characters); "
            "bake separate images for fewer types each"
        )
    return targets


def from_tags(tags: dict[str, str]) -> tuple[str, ...]:
    """The target instance types an image was baked for (empty for images from before targets)."""
    value = tags.get(TARGETS_TAG, "")
    return tuple(n for n in value.split(",") if n)
