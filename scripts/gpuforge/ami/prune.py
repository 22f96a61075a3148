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
    # Copies of deleted images in other regions (gpuforge bake --copy-region), deleted with them.
    delete_copies: list[tuple[str, images.Image]] = field(default_factory=list)
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
    _plan_copies(result, sources)
    return result


def _plan_copies(result: PrunePlan, sources: references.Sources) -> None:
    """A copy goes with its original, unless something in the copy's region uses it.

    In a copy's region the discovery sources are those that exist there: parameters under the prefix,
    launch templates, instances, ParallelCluster clusters (named parameters and config files are the
    build region's)."""
    regional = references.Sources(
        parameter_prefix=sources.parameter_prefix, allow_missing=sources.allow_missing
    )
    in_use: dict[str, references.References] = {}
    for image in result.delete:
        build_id = image.tags.get(images.BUILD_ID_TAG)
        copy_regions = [r for r in image.tags.get(images.COPY_REGIONS_TAG, "").split(",") if r]
        if not build_id:
            continue
        for region in copy_regions:
            copies = images.images_with_build_id(build_id, region)
            if not copies:
                continue
            if region not in in_use:
                in_use[region] = references.find(regional, region)
                result.warnings.extend(in_use[region].warnings)
            for copy in copies:
                why = in_use[region].used_by.get(copy.id)
                if why is not None:
                    result.protected[copy.id] = f"{why} in {region}"
                else:
                    result.delete_copies.append((region, copy))


def execute(prune_plan: PrunePlan, region: str | None = None) -> None:
    for image in prune_plan.delete:
        images.deregister(image, region)
    for copy_region, copy in prune_plan.delete_copies:
        images.deregister(copy, copy_region)
