"""Keep the newest K gpuforge images of a flavor; retire older ones that nothing references."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuforge.ami import images
from gpuforge.ami.publish import read_parameter
from gpuforge.errors import UserError
from gpuforge.pcluster import config as pcluster_config

LOG = logging.getLogger(__name__)


@dataclass
class PrunePlan:
    keep: list[images.Image] = field(default_factory=list)
    protected: dict[str, str] = field(default_factory=dict)  # AMI id -> why it must stay
    delete: list[images.Image] = field(default_factory=list)


def references(
    parameters: Sequence[str], configs: Sequence[Path], region: str | None = None
) -> dict[str, str]:
    """Every AMI something still points at: SSM parameters, cluster configs, live instances."""
    found: dict[str, str] = {}
    for name in parameters:
        value = read_parameter(name, region)
        if value:
            found.setdefault(value, f"SSM parameter {name}")
    for path in configs:
        for ami in sorted(pcluster_config.custom_amis(pcluster_config.load_config(path))):
            found.setdefault(ami, f"cluster config {path}")
    for ami in sorted(images.amis_of_live_instances(region)):
        found.setdefault(ami, "a running (or stopped) instance")
    return found


def plan(
    flavor: str,
    keep: int,
    parameters: Sequence[str],
    configs: Sequence[Path] = (),
    region: str | None = None,
) -> PrunePlan:
    if keep < 1:
        raise UserError("--keep must be at least 1: pruning never removes the newest image")
    newest_first = images.gpuforge_images(flavor, region)[::-1]
    in_use = references(parameters, configs, region)
    result = PrunePlan(keep=newest_first[:keep])
    for image in newest_first[keep:]:
        if image.id in in_use:
            result.protected[image.id] = in_use[image.id]
        else:
            result.delete.append(image)
    return result


def execute(prune_plan: PrunePlan, region: str | None = None) -> None:
    for image in prune_plan.delete:
        images.deregister(image, region)
