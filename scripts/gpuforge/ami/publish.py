"""Roll an image out: point the SSM parameter at it and patch ParallelCluster cluster configs."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from gpuforge import aws, fitness
from gpuforge.ami import images
from gpuforge.amiid import check_ami_id
from gpuforge.errors import ExternalError, UserError
from gpuforge.pcluster import config as pcluster_config
from gpuforge.pcluster import rollout, update
from gpuforge.pcluster.rollout import ConfigChange
from gpuforge.pcluster.validate import AmiFacts

LOG = logging.getLogger(__name__)


def default_parameter(flavor: str, os: str = images.DEFAULT_IMAGE_OS) -> str:
    """Where the published golden AMI of a flavor and OS (ubuntu2204 / ubuntu2404) lives: one parameter
    per OS, so that a 24.04 bake never replaces what 22.04 nodes launch from."""
    return f"/gpuforge/ami/{flavor}/{os}/latest"


def legacy_parameter(flavor: str) -> str:
    """The one parameter per flavor of earlier gpuforge releases, which every OS overwrote (deprecated)."""
    return f"/gpuforge/ami/{flavor}/latest"


# Only 22.04 images ever went to the legacy parameter by default (the bake's default base OS).
_LEGACY_OS = images.DEFAULT_IMAGE_OS


def _deprecation(flavor: str) -> str:
    return (
        f"SSM parameter {legacy_parameter(flavor)} is deprecated: gpuforge publishes each OS under "
        f"{default_parameter(flavor, 'OS')} (OS: {', '.join(images.IMAGE_OSES.values())}); point launch "
        f"templates (resolve:ssm:) there and delete the old parameter. Until then gpuforge keeps writing "
        f"{_LEGACY_OS} images to it."
    )


def read_parameter(name: str, region: str | None = None) -> str | None:
    """The AMI id a parameter holds, or None when it does not exist yet."""
    return parameter_value(aws.client("ssm", region_name=region), name)


def parameter_value(ssm: Any, name: str) -> str | None:
    """What parameter `name` holds, read with the SSM client `ssm`; None when it does not exist."""
    try:
        return str(ssm.get_parameter(Name=name)["Parameter"]["Value"])
    except ClientError as exc:
        if exc.response["Error"]["Code"] == "ParameterNotFound":
            return None
        raise ExternalError(f"SSM GetParameter {name} failed: {exc}") from exc


def write_parameter(name: str, ami_id: str, region: str | None = None) -> int:
    """Point the parameter at ami_id; DataType aws:ec2:image makes SSM check it is a real image."""
    ssm = aws.client("ssm", region_name=region)
    try:
        result = ssm.put_parameter(
            Name=name,
            Value=check_ami_id(ami_id),
            Type="String",
            DataType="aws:ec2:image",
            Overwrite=True,
            Description="gpuforge golden AMI (written by gpuforge publish)",
        )
    except ClientError as exc:
        raise ExternalError(f"SSM PutParameter {name} failed: {exc}") from exc
    version = int(result["Version"])
    LOG.info("%s -> %s (version %d)", name, ami_id, version)
    return version


def published_image(
    flavor: str, os: str, region: str | None = None, parameter: str | None = None
) -> tuple[str, images.Image | None]:
    """(parameter, image): what is published for flavor and OS, which `rebuild --if-stale` compares with.

    The parameter is `parameter`, else default_parameter(flavor, os), else (for existing users, with a
    deprecation warning) legacy_parameter(flavor). The image is None when nothing is published there,
    when the image no longer exists, or when it is not of this flavor and OS (an image a --no-publish bake
    or a failed publish left is never what is published).
    """
    ssm = aws.client("ssm", region_name=region)
    name = parameter or default_parameter(flavor, os)
    value = parameter_value(ssm, name)
    if value is None and parameter is None:
        value = parameter_value(ssm, legacy_parameter(flavor))
        if value is not None:
            LOG.warning("%s", _deprecation(flavor))
            name = legacy_parameter(flavor)
    if value is None:
        return name, None
    try:
        image = images.describe(value, region)
    except UserError as exc:
        LOG.warning("SSM parameter %s names %s, which cannot be read: %s", name, value, exc)
        return name, None
    found = (image.tags.get(images.FLAVOR_TAG), image.os)
    if found != (flavor, os):
        LOG.warning(
            "SSM parameter %s names %s, a %s/%s image, not %s/%s",
            name,
            image.id,
            *(part or "untagged" for part in found),
            flavor,
            os,
        )
        return name, None
    return name, image


@dataclass(frozen=True)
class PatchedConfig:
    path: Path
    document: dict[str, Any]
    plan: update.Plan


# A well-formed id that names no image, for checking configs before the real id exists.
_PLACEHOLDER_AMI = "ami-00000000000000000"


def _patch_one(
    path: Path, ami_id: str, facts: AmiFacts | None, change: ConfigChange, region: str
) -> PatchedConfig:
    document = pcluster_config.load_document(path)
    config_region = document.get("Region")
    if config_region is not None and config_region != region:
        raise UserError(
            f"cluster config {path} is for {config_region}, the image is in {region}: "
            "publish with --region of the cluster, or copy the image there (bake --copy-region)"
        )
    result = rollout.patch(document, ami_id, facts, change, f"cluster config {path}")
    return PatchedConfig(path, result.document, result.plan)


def _patched(
    configs: Sequence[Path],
    ami_id: str,
    facts: AmiFacts | None,
    change: ConfigChange,
    region: str | None,
) -> list[PatchedConfig]:
    """Each config with ami_id set, checked against ParallelCluster's schema, the image's OS and size, the
    region the image lives in, and what `pcluster update-cluster` will accept (UserError if one fails)."""
    the_region = region or aws.region()
    return [_patch_one(path, ami_id, facts, change, the_region) for path in configs]


def check_configs(
    configs: Sequence[Path],
    change: ConfigChange | None = None,
    region: str | None = None,
    flavor: str | None = None,
    force: bool = False,
    facts: AmiFacts | None = None,
) -> None:
    """Fail before a bake, not after it, when a config could not take the new image (facts: the OS and
    root volume size the bake will give it)."""
    if configs and flavor is not None and flavor != fitness.PCLUSTER_FLAVOR:
        message = (
            f"ParallelCluster configs take only {fitness.PCLUSTER_FLAVOR}-flavor images; "
            f"this bake makes a {flavor} image (drop --cluster-config or bake --flavor pcluster)"
        )
        if not force:
            raise UserError(message + " (--force to use it anyway)")
        LOG.warning("--force: %s", message)
    _patched(configs, _PLACEHOLDER_AMI, facts, change or ConfigChange(), region)


def _target_parameter(image: images.Image | None, flavor: str | None, force: bool) -> str:
    os = image.os if image is not None else None
    if os is None:
        if not force:
            raise UserError(
                f"image {image.id if image else '?'} has no {images.OS_TAG} or {images.PCLUSTER_OS_TAG} "
                "tag, so the parameter of its OS is unknown: give --parameter, or bake it again"
            )
        os = images.DEFAULT_IMAGE_OS
        LOG.warning("--force: publishing an image of unknown OS as %s", os)
    the_flavor = flavor or (image.tags.get(images.FLAVOR_TAG) if image else None) or "dlami"
    return default_parameter(the_flavor, os)


def _describe_or_none(ami_id: str, region: str | None, force: bool) -> images.Image | None:
    try:
        return images.describe(ami_id, region)
    except (UserError, ExternalError):
        if not force:
            raise
        return None


def publish(
    ami_id: str,
    parameter: str | None,
    configs: Sequence[Path] = (),
    queues: Sequence[str] | None = None,
    region: str | None = None,
    flavor: str | None = None,
    force: bool = False,
    *,
    change: ConfigChange | None = None,
) -> list[PatchedConfig]:
    """Publish an existing image that qualifies (gpuforge.fitness: available, gpuforge's tags, the
    parameter's flavor, and a pcluster image for ParallelCluster configs); return the configs patched.

    parameter None: default_parameter(flavor, the image's OS), and the deprecated legacy parameter too
    where it still exists and the image is of the OS it carried. Configs are patched, validated and their
    update checked (gpuforge.pcluster.update) before the parameter moves, so a config that fails leaves
    both the parameter and every config as they were; rewritten configs keep their comments, order and
    quoting."""
    change = change or ConfigChange(queues=queues)
    where = f"SSM parameter {parameter}" if parameter else "the SSM parameter of its OS"
    fitness.require(
        ami_id,
        region,
        flavor=flavor,
        for_pcluster=bool(configs),
        force=force,
        target=where + (" and ParallelCluster configs" if configs else ""),
    )
    image = _describe_or_none(ami_id, region, force)
    target = parameter or _target_parameter(image, flavor, force)
    facts = AmiFacts(image.os, image.root_volume_gib) if image is not None else None
    patched = _patched(configs, ami_id, facts, change, region)
    write_parameter(target, ami_id, region)
    if parameter is None and image is not None and image.os == _LEGACY_OS:
        legacy = legacy_parameter(flavor or image.tags.get(images.FLAVOR_TAG, "dlami"))
        if read_parameter(legacy, region) is not None:
            LOG.warning("%s", _deprecation(flavor or image.tags.get(images.FLAVOR_TAG, "dlami")))
            write_parameter(legacy, ami_id, region)
    for item in patched:
        pcluster_config.dump_document(item.document, item.path)
        LOG.info("%s now uses %s", item.path, ami_id)
    return patched
