"""Keep the newest K gpuforge images of a flavor; retire older ones that nothing references."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from gpuforge.ami import images, references
from gpuforge.errors import UserError

LOG = logging.getLogger(__name__)


@dataclass
class PrunePlan:
    keep: list[images.Image] = field(default_factory=list)
    protected: dict[str, str] = field(default_factory=dict)  # AMI id -> why it must stay
    delete: list[images.Image] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def plan(
    flavor: str,
    keep: int,
    sources: references.Sources,
    region: str | None = None,
) -> PrunePlan:
    """Which images to keep, protect and delete. The references are read only when there is a candidate,
    so an account with nothing to prune needs none of the protection sources."""
    if keep < 1:
        raise UserError("--keep must be at least 1: pruning never removes the newest image")
    newest_first = images.gpuforge_images(flavor, region)[::-1]
    result = PrunePlan(keep=newest_first[:keep])
    candidates = newest_first[keep:]
    if not candidates:
        return result
    in_use = references.find(sources, region)
    result.warnings = in_use.warnings
    for image in candidates:
        if image.id in in_use.used_by:
            result.protected[image.id] = in_use.used_by[image.id]
        else:
            result.delete.append(image)
    return result


def execute(prune_plan: PrunePlan, region: str | None = None) -> None:
    for image in prune_plan.delete:
        images.deregister(image, region)
