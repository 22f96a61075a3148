"""Whether an image may be rolled out: `publish` and `cluster-config set-ami` ask before pointing at it.

An image qualifies when it is available, carries the tags a gpuforge bake puts on it, is of the flavor the
target expects, and, for a ParallelCluster config, is a pcluster-flavor image with the tags ParallelCluster's
CustomAmiTagValidator checks (aws-parallelcluster 3.16.1, pcluster/validators/cluster_validators.py):
`parallelcluster:version` equal to the installed release (an ERROR there when it differs; cluster creation
fails on an AMI ParallelCluster did not prepare) and `parallelcluster:build_status`.
`--force` turns every finding into a warning.

Below both gpuforge.ami and gpuforge.pcluster (it reads images through gpuforge.image), which both ask it.
"""

from __future__ import annotations

import importlib.metadata
import logging

from ansible_collections.gpuforge.gpu.plugins.plugin_utils.versions import VERSIONS_HASH_TAG
from botocore.exceptions import BotoCoreError, ClientError

from gpuforge import image as images
from gpuforge.errors import ExternalError, UserError

LOG = logging.getLogger(__name__)

# What every gpuforge bake tags (packer/gpuforge.pkr.hcl local.image_tags and versions.Manifest.image_tags).
REQUIRED_TAGS = (images.FLAVOR_TAG, images.BUILD_ID_TAG, images.SOURCE_AMI_TAG, VERSIONS_HASH_TAG)
PCLUSTER_FLAVOR = "pcluster"
PCLUSTER_VERSION_TAG = "parallelcluster:version"
PCLUSTER_BUILD_STATUS_TAG = "parallelcluster:build_status"


def _pcluster_version() -> str | None:
    try:
        return importlib.metadata.version("aws-parallelcluster")
    except importlib.metadata.PackageNotFoundError:
        return None


def problems(image: images.Image, flavor: str | None, for_pcluster: bool) -> list[str]:
    """Each reason the image must not be rolled out to this target (empty when it may)."""
    found: list[str] = []
    if image.state != "available":
        found.append(f"it is {image.state or 'in an unknown state'}, not available")
    missing = [tag for tag in REQUIRED_TAGS if tag not in image.tags]
    if missing:
        found.append(f"it lacks the gpuforge tags {', '.join(missing)} (was it baked by gpuforge?)")
    actual = image.tags.get(images.FLAVOR_TAG)
    if flavor is not None and actual is not None and actual != flavor:
        found.append(f"it is a {actual}-flavor image, not {flavor}")
    if for_pcluster:
        if actual is not None and actual != PCLUSTER_FLAVOR:
            found.append(
                f"ParallelCluster configs take only {PCLUSTER_FLAVOR}-flavor images, this is {actual}"
            )
        version = image.tags.get(PCLUSTER_VERSION_TAG)
        installed = _pcluster_version()
        if version is None:
            found.append(
                f"it has no {PCLUSTER_VERSION_TAG} tag, so ParallelCluster cannot create a cluster with it"
            )
        elif installed is not None and version != installed:
            found.append(f"it was made for ParallelCluster {version}, this checkout uses {installed}")
        if PCLUSTER_BUILD_STATUS_TAG not in image.tags:
            found.append(f"it has no {PCLUSTER_BUILD_STATUS_TAG} tag (ParallelCluster refuses it)")
    return found


def require(
    ami_id: str,
    region: str | None,
    *,
    flavor: str | None,
    for_pcluster: bool,
    force: bool = False,
    target: str = "",
) -> None:
    """Refuse (UserError) an image that does not qualify; with force, warn and go on."""
    try:
        image = images.describe(ami_id, region)
    except (UserError, ExternalError, BotoCoreError, ClientError) as exc:
        if not force:
            raise
        LOG.warning("--force: using %s unchecked: %s", ami_id, exc)
        return
    found = problems(image, flavor, for_pcluster)
    if not found:
        return
    where = f" for {target}" if target else ""
    if force:
        for problem in found:
            LOG.warning("--force: using %s%s although %s", ami_id, where, problem)
        return
    raise UserError(f"image {ami_id} cannot be used{where}: {'; '.join(found)} (--force to use it anyway)")
