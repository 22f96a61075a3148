"""Roll an image out: point the SSM parameter at it and patch ParallelCluster cluster configs."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from gpuforge import aws
from gpuforge.ami import fitness
from gpuforge.errors import ExternalError, UserError
from gpuforge.pcluster import config as pcluster_config
from gpuforge.pcluster.validate import validate

LOG = logging.getLogger(__name__)


def default_parameter(flavor: str) -> str:
    """Where the newest golden AMI id of a flavor is published."""
    return f"/gpuforge/ami/{flavor}/latest"


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
            Value=pcluster_config.check_ami_id(ami_id),
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


# A well-formed id that names no image, for checking configs before the real id exists.
_PLACEHOLDER_AMI = "ami-00000000000000000"


def _patched(
    configs: Sequence[Path], ami_id: str, queues: Sequence[str] | None, region: str | None
) -> list[tuple[Path, dict[str, Any]]]:
    """Each config (a round-trip document) with ami_id set, checked against ParallelCluster's schema and
    against the region the image lives in (UserError if one fails)."""
    patched = []
    the_region = region or aws.region()
    for path in configs:
        document = pcluster_config.load_document(path)
        config_region = document.get("Region")
        if config_region is not None and config_region != the_region:
            raise UserError(
                f"cluster config {path} is for {config_region}, the image is in {the_region}: "
                "publish with --region of the cluster, or copy the image there (ami_regions)"
            )
        document = pcluster_config.set_custom_ami(document, ami_id, queues)
        validate(pcluster_config.plain(document))
        patched.append((path, document))
    return patched


def check_configs(
    configs: Sequence[Path],
    queues: Sequence[str] | None = None,
    region: str | None = None,
    flavor: str | None = None,
    force: bool = False,
) -> None:
    """Fail before a bake, not after it, when a config could not take the new image."""
    if configs and flavor is not None and flavor != fitness.PCLUSTER_FLAVOR:
        message = (
            f"ParallelCluster configs take only {fitness.PCLUSTER_FLAVOR}-flavor images; "
            f"this bake makes a {flavor} image (drop --cluster-config or bake --flavor pcluster)"
        )
        if not force:
            raise UserError(message + " (--force to use it anyway)")
        LOG.warning("--force: %s", message)
    _patched(configs, _PLACEHOLDER_AMI, queues, region)


def publish(
    ami_id: str,
    parameter: str,
    configs: Sequence[Path] = (),
    queues: Sequence[str] | None = None,
    region: str | None = None,
    flavor: str | None = None,
    force: bool = False,
) -> None:
    """Publish an existing image that qualifies (gpuforge.ami.fitness: available, gpuforge's tags, the
    parameter's flavor, and a pcluster image for ParallelCluster configs). Configs are patched and
    validated before the parameter moves, so a config the schema rejects leaves both the parameter and
    every config as they were; rewritten configs keep their comments, order and quoting."""
    fitness.require(
        ami_id,
        region,
        flavor=flavor,
        for_pcluster=bool(configs),
        force=force,
        target=f"SSM parameter {parameter}" + (" and ParallelCluster configs" if configs else ""),
    )
    patched = _patched(configs, ami_id, queues, region)
    write_parameter(parameter, ami_id, region)
    for path, document in patched:
        pcluster_config.dump_document(document, path)
        LOG.info("%s now uses %s", path, ami_id)
