"""The instance types an image is baked for: parsed, checked against the pins, carried to Ansible and tags.

Every hardware-dependent install decision of a bake (fabric manager and libnvidia-nscq, the NVLink
subnet manager, which GPUs the driver branch and CUDA must support, the aws-ofi-nccl/NCCL releases a
type needs) is taken from these targets, never from the builder the bake happens to run on. The rules
are the collection's plugins/plugin_utils/targets.py, which the roles call through filters; this
module adds what only the CLI needs (the option's parsing, the image tag, the UserError).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ansible_collections.gpuforge.gpu.plugins.plugin_utils import targets as rules

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


def parse(text: str) -> tuple[str, ...]:
    """'p5.48xlarge, p5en.48xlarge' -> the names in order, once each; empty is a user error."""
    names = rules.names(text)
    if not names:
        raise UserError("--target-instance-types needs at least one instance type, such as p5.48xlarge")
    return tuple(names)


def problems(itype: InstanceType, manifest: versions.Manifest, path: Path | None = None) -> list[str]:
    """Why the pinned stack cannot serve itype (empty when it can)."""
    data = instance_types.data(path)
    return rules.problems(
        itype.name, data["gpuforge_instance_types"], data["gpuforge_gpu_models"], manifest.components
    )


@dataclass(frozen=True)
class Targets:
    types: tuple[InstanceType, ...]
    # The data/instance_types.yml the types come from (None: the collection's).
    path: Path | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.types)

    def _rows(self) -> dict[str, Any]:
        return dict(instance_types.data(self.path)["gpuforge_instance_types"])

    @property
    def nvswitch(self) -> bool:
        """Some target has NVSwitch: the image needs the fabric manager and libnvidia-nscq."""
        return rules.nvswitch(self.names, self._rows())

    @property
    def nvlink_subnet_manager(self) -> bool:
        """Some target has fourth-generation NVSwitch: the image needs nvlsm too."""
        return rules.nvlink_subnet_manager(self.names, self._rows())

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
    wanted = list(names)
    if not wanted:
        raise UserError("an image needs at least one target instance type")
    data = instance_types.data(path)
    known, unsupported = data["gpuforge_instance_types"], data["gpuforge_unsupported_instance_types"]
    refused = rules.unknown(wanted, known, unsupported)
    if refused:
        raise UserError("; ".join(refused))
    found = rules.refusals(wanted, known, data["gpuforge_gpu_models"], unsupported, manifest.components)
    if found:
        raise UserError(
            "the pinned versions cannot serve these target instance types:\n  " + "\n  ".join(found)
        )
    targets = Targets(tuple(instance_types.get(name, path) for name in wanted), path)
    if len(targets.tag_value) > _TAG_VALUE_MAX:
        raise UserError(
            f"{len(wanted)} target instance types do not fit one image tag ({_TAG_VALUE_MAX} characters); "
            "bake separate images for fewer types each"
        )
    return targets


def from_tags(tags: dict[str, str]) -> tuple[str, ...]:
    """The target instance types an image was baked for (empty for images from before targets)."""
    value = tags.get(TARGETS_TAG, "")
    return tuple(n for n in value.split(",") if n)
