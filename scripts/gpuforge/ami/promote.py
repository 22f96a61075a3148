"""`gpuforge promote` and `gpuforge rollback`: move `latest` between a flavor and OS's images.

Beside /gpuforge/ami/<flavor>/<os>/latest (gpuforge.ami.publish.default_parameter) live:
- `candidate`: what the last bake made (written by bake/rebuild), not yet launched by anything;
- `previous`: what `latest` held before the last promote, so that it stays addressable, and
  `rollback` restores it.
promote moves `latest` to the candidate only when the canary (gpuforge.ami.canary) recorded a pass on
it for its flavor and OS; previous is written before latest, so a failure in between leaves latest
as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuforge import aws, fitness
from gpuforge.ami import canary, images, publish
from gpuforge.errors import UserError
from gpuforge.pcluster.rollout import ConfigChange

LOG = logging.getLogger(__name__)


def _parameter(flavor: str, os: str, name: str) -> str:
    return publish.default_parameter(flavor, os).rsplit("/", 1)[0] + f"/{name}"


def candidate_parameter(flavor: str, os: str) -> str:
    return _parameter(flavor, os, "candidate")


def previous_parameter(flavor: str, os: str) -> str:
    return _parameter(flavor, os, "previous")


def publish_candidate(ami: str, flavor: str, region: str | None = None) -> str:
    """Point the candidate parameter of the image's flavor and OS at a fresh bake; return its name.
    Nothing launches from it: `gpuforge canary` checks it, `gpuforge promote` makes it latest."""
    image = images.describe(ami, region)
    if image.os is None:
        raise UserError(f"image {ami} has no {images.OS_TAG} tag, so its candidate parameter is unknown")
    name = candidate_parameter(flavor, image.os)
    fitness.require(ami, region, flavor=flavor, for_pcluster=False, target=f"SSM parameter {name}")
    publish.write_parameter(name, ami, region)
    return name


@dataclass(frozen=True)
class Move:
    parameter: str
    old: str | None
    new: str
    previous: str | None

    def lines(self) -> list[str]:
        if self.old == self.new:
            return [f"{self.parameter} already names {self.new}; nothing moved"]
        out = [f"{self.parameter}: {self.old or '(unset)'} -> {self.new}"]
        if self.previous:
            out.append(f"{self.previous} -> {self.old} (`gpuforge rollback` restores it)")
        return out


def _value(name: str, region: str | None) -> str | None:
    return publish.parameter_value(aws.client("ssm", region_name=region), name)


def require_pass(image: images.Image, flavor: str, os: str, force: bool) -> None:
    """UserError unless the image is of flavor/os and its canary passed (--force: a loud warning)."""
    problems = []
    found = (image.tags.get(images.FLAVOR_TAG), image.os)
    if found != (flavor, os):
        problems.append(f"it is a {found[0] or 'untagged'}/{found[1] or 'untagged'} image, not {flavor}/{os}")
    verdict = image.tags.get(canary.CANARY_TAG)
    if verdict != canary.PASSED:
        problems.append(
            f"its canary {'recorded ' + verdict if verdict else 'never ran'} ({canary.CANARY_TAG}="
            f"{verdict or 'absent'}); run `gpuforge canary --ami {image.id} --instance-type TYPE ...` first"
        )
    else:
        LOG.info(
            "%s passed its canary on %s at %s (run %s)",
            image.id,
            image.tags.get(canary.CANARY_TYPE_TAG, "?"),
            image.tags.get(canary.CANARY_AT_TAG, "?"),
            image.tags.get(canary.CANARY_RUN_TAG, "?"),
        )
    if not problems:
        return
    message = f"refusing to promote {image.id}: " + "; ".join(problems)
    if not force:
        raise UserError(message + " (--force promotes it anyway)")
    LOG.warning(
        "!!! --force: %s. Every node launched from latest will get an image nobody checked !!!", message
    )


def _move(
    flavor: str,
    os: str,
    ami: str,
    region: str | None,
    configs: Sequence[Path],
    change: ConfigChange | None,
    force: bool,
    keep_previous: bool,
) -> Move:
    latest = publish.default_parameter(flavor, os)
    old = _value(latest, region)
    if old == ami:
        return Move(latest, old, ami, None)
    previous = None
    if keep_previous and old is not None:
        # Before latest moves: a failure in between leaves latest as it was and previous at it.
        previous = previous_parameter(flavor, os)
        publish.write_parameter(previous, old, region)
    publish.publish(ami, latest, configs, region=region, flavor=flavor, force=force, change=change)
    return Move(latest, old, ami, previous)


def promote(
    flavor: str,
    os: str,
    ami: str | None = None,
    region: str | None = None,
    configs: Sequence[Path] = (),
    change: ConfigChange | None = None,
    force: bool = False,
) -> Move:
    """Point latest at ami (default: the candidate parameter's image) after checking its canary pass."""
    if ami is None:
        ami = _value(candidate_parameter(flavor, os), region)
        if ami is None:
            raise UserError(
                f"nothing to promote: {candidate_parameter(flavor, os)} does not exist (bake or rebuild "
                "first,"
                " or pass --ami)"
            )
    image = images.describe(ami, region)
    require_pass(image, flavor, os, force)
    return _move(flavor, os, image.id, region, configs, change, force, keep_previous=True)


def rollback(
    flavor: str,
    os: str,
    region: str | None = None,
    configs: Sequence[Path] = (),
    change: ConfigChange | None = None,
) -> Move:
    """Point latest back at what previous holds. previous is left as is: a second rollback changes
    nothing, and the image rolled back from stays the candidate's business, never latest again by
    accident."""
    name = previous_parameter(flavor, os)
    ami = _value(name, region)
    if ami is None:
        raise UserError(
            f"nothing to roll back to: {name} does not exist (no promote has replaced an image yet)"
        )
    return _move(flavor, os, ami, region, configs, change, force=False, keep_previous=False)
