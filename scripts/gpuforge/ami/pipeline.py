"""The golden AMI pipeline's steps that span modules, with typed values: a bake and where its image goes,
whether a scheduled rebuild is needed, and the candidate a canary checks (docs/ami-pipeline.md)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuforge import versions
from gpuforge.ami import bake, canary, images, inputs, promote, publish, references
from gpuforge.errors import UserError
from gpuforge.pcluster import config as pcluster_config
from gpuforge.pcluster.rollout import ConfigChange
from gpuforge.pcluster.validate import AmiFacts

LOG = logging.getLogger(__name__)


def check_config_files(paths: Sequence[Path], allow_missing: bool = False) -> None:
    """Read every cluster config before any AWS call: a malformed file, or a cluster spec given for a
    config, is refused at once (pcluster_config.load_config says which and what to do)."""
    for path in paths:
        if not path.exists() and allow_missing:
            continue  # prune --allow-missing: references.py warns and goes on.
        if not path.exists():
            raise UserError(
                f"cluster config {path} does not exist (prune: --allow-missing to go on without it)"
            )
        pcluster_config.load_config(path)


@dataclass(frozen=True)
class Destination:
    """Where a new image goes: the candidate parameter (the default), or a parameter and cluster configs
    the operator names."""

    parameter: str | None = None
    cluster_configs: Sequence[Path] = ()
    change: ConfigChange = field(default_factory=ConfigChange)
    force: bool = False
    candidate: bool = False
    no_publish: bool = False


@dataclass(frozen=True)
class Baked:
    image_id: str
    candidate_parameter: str | None = None  # set when the image went to .../candidate
    patched: list[publish.PatchedConfig] = field(default_factory=list)  # one per cluster config


def publish_to(ami: str, to: Destination, region: str | None, flavor: str) -> list[publish.PatchedConfig]:
    """Point the parameter and the cluster configs at ami; per config, what pcluster update-cluster does."""
    return publish.publish(
        ami, to.parameter, to.cluster_configs, region=region, flavor=flavor, force=to.force, change=to.change
    )


def bake_and_publish(options: bake.BakeOptions, to: Destination) -> Baked:
    # A new image is a candidate: nothing launches from latest before its canary passed on the
    # target hardware (`gpuforge canary`, `gpuforge promote`). Only a parameter or cluster config the
    # operator names moves at bake time, and never the flavor's latest.
    if to.candidate or not (to.parameter or to.cluster_configs):
        return _bake_candidate(options, to)
    if (
        to.parameter
        and to.parameter.rstrip("/").endswith("/latest")
        and to.parameter.startswith(references.PROJECT_PREFIX)
    ):
        raise UserError(
            f"--parameter {to.parameter}: latest moves only through `gpuforge promote` after a passed "
            "canary; bake to the candidate (the default) and run `gpuforge canary` and `gpuforge promote`"
        )
    LOG.warning(
        "publishing the new image to %s before any canary ran on its target hardware (as asked)",
        ", ".join([*([to.parameter] if to.parameter else []), *map(str, to.cluster_configs)]),
    )
    if not to.no_publish:
        # What the image will be: its OS, and its root volume (every node's minimum RootVolume.Size).
        # 0 bakes at the base's own root snapshot size, read from the base image when a config needs it.
        root = bake.image_root_volume_gib(options) if to.cluster_configs else None
        facts = AmiFacts(images.IMAGE_OSES[options.base_os], root)
        publish.check_configs(to.cluster_configs, to.change, options.region, options.flavor, to.force, facts)
    image = bake.bake_aws(options)
    if to.no_publish:
        return Baked(image.id)
    return Baked(image.id, patched=publish_to(image.id, to, options.region, options.flavor))


def _bake_candidate(options: bake.BakeOptions, to: Destination) -> Baked:
    """--candidate: the new image goes to .../candidate only; configs move at promote."""
    if to.parameter or to.cluster_configs:
        raise UserError(
            "--candidate publishes only to /gpuforge/ami/FLAVOR/OS/candidate: drop --parameter and "
            "--cluster-config (give configs to `gpuforge promote`)"
        )
    image = bake.bake_aws(options)
    if to.no_publish:
        return Baked(image.id)
    return Baked(image.id, promote.publish_candidate(image.id, options.flavor, options.region))


def no_rebuild(options: bake.BakeOptions, parameter: str | None) -> list[str] | None:
    """`rebuild --if-stale`: what to print instead of rebuilding (the image id last), or None to rebuild."""
    # Judged by what is published (what nodes launch), never by the newest image: an image a
    # --no-publish bake or a failed publish left behind must not make the schedule say "current".
    base = bake.resolve_base(options)
    os = images.IMAGE_OSES[options.base_os]
    name, published = publish.published_image(options.flavor, os, options.region, parameter)
    digests = (versions.load().digest, inputs.digest())
    reason = (
        images.stale_reason(published, base, *digests)
        if published is not None
        else f"nothing of {options.flavor}/{os} is published at {name}"
    )
    if reason is None:
        assert published is not None
        return [
            f"{published.id} (published at {name}) is current (base {base.id}, same versions "
            "manifest and bake inputs); not rebuilding"
        ]
    # A current candidate waits for its canary and promote: baking it again changes nothing. One whose
    # canary failed is rebuilt (a new try, on the next schedule).
    # Its id is the last line, as a new image's would be: the scheduled workflow then runs the canary and
    # promote on it. A candidate whose canary never ran (no capacity, a cancelled job) or whose promote
    # failed would otherwise wait forever, every later schedule saying "current" and latest frozen.
    if parameter is None:
        waiting = _current_candidate(options.flavor, os, options.region, base, digests)
        if waiting is not None:
            return list(waiting)
    LOG.info("rebuilding %s/%s: %s", options.flavor, os, reason)
    return None


def _current_candidate(
    flavor: str, os: str, region: str | None, base: images.Image, digests: tuple[str, str]
) -> tuple[str, str] | None:
    """A message and the id of a current candidate (today's base and inputs, canary not failed), else None."""
    name = promote.candidate_parameter(flavor, os)
    value = publish.read_parameter(name, region)
    if value is None:
        return None
    try:
        candidate = images.describe(value, region)
    except UserError:
        return None
    if (candidate.tags.get(images.FLAVOR_TAG), candidate.os) != (flavor, os):
        return None
    if images.stale_reason(candidate, base, *digests) is not None:
        return None
    verdict = candidate.tags.get(canary.CANARY_TAG)
    if verdict == canary.FAILED:
        LOG.info("candidate %s failed its canary: rebuilding", candidate.id)
        return None
    state = (
        "passed its canary: run `gpuforge promote`"
        if verdict == canary.PASSED
        else "waits for `gpuforge canary`"
    )
    return (
        f"{candidate.id} (candidate at {name}) is current (base {base.id}, same versions manifest and bake "
        f"inputs) and {state}; not rebuilding",
        candidate.id,
    )


def candidate_image(flavor: str, os: str, region: str | None) -> str:
    """The image the candidate parameter names, for a canary given no --ami."""
    name = promote.candidate_parameter(flavor, os)
    ami = publish.read_parameter(name, region)
    if ami is None:
        raise UserError(f"no candidate: {name} does not exist (rebuild --candidate first, or pass --ami)")
    return ami
