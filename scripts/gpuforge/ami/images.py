"""EC2 image operations of the AMI pipeline: find the base image, list gpuforge images, retire them."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from ansible_collections.gpuforge.gpu.plugins.plugin_utils.versions import VERSIONS_HASH_TAG
from botocore.exceptions import BotoCoreError, ClientError, WaiterError

from gpuforge import aws
from gpuforge.amiid import check_ami_id
from gpuforge.errors import ExternalError, UserError

# What the pipeline and the cluster-config commands both read from an image lives below both, in
# gpuforge.image; these names stay here for the pipeline's modules.
from gpuforge.image import BUILD_ID_TAG as BUILD_ID_TAG
from gpuforge.image import FLAVOR_TAG as FLAVOR_TAG
from gpuforge.image import OS_TAG as OS_TAG
from gpuforge.image import PCLUSTER_OS_TAG as PCLUSTER_OS_TAG
from gpuforge.image import SOURCE_AMI_TAG as SOURCE_AMI_TAG
from gpuforge.image import Image as Image
from gpuforge.image import describe as describe
from gpuforge.image import describe_images as _describe
from gpuforge.image import ec2_client as _ec2

LOG = logging.getLogger(__name__)

# Hash of everything a bake runs (gpuforge.ami.inputs.digest), written at bake time, read by
# `rebuild --if-stale`.
INPUTS_HASH_TAG = "gpuforge:inputs-hash"
FLAVORS = ("dlami", "pcluster")
SOURCE_AMI_NAME_TAG = "gpuforge:source-ami-name"
GIT_REVISION_TAG = "gpuforge:git-revision"
BUILD_TIME_TAG = "gpuforge:build-time"
# Comma-separated regions a bake copied the image to (Packer's ami_regions); every copy carries it too.
COPY_REGIONS_TAG = "gpuforge:copy-regions"

# The supported bases: the Deep Learning Base OSS Nvidia Driver GPU AMI on Ubuntu 22.04 (default)
# and 24.04. AWS keeps a public SSM parameter pointed at the newest of each (DLAMI release notes).
BASE_OSES = ("ubuntu22.04", "ubuntu24.04")
# Base OS -> ParallelCluster's Image.Os value (aws-parallelcluster 3.16.1, pcluster/constants.py
# SUPPORTED_OSES lists "ubuntu2204" and "ubuntu2404").
IMAGE_OSES = {"ubuntu22.04": "ubuntu2204", "ubuntu24.04": "ubuntu2404"}
DEFAULT_IMAGE_OS = IMAGE_OSES["ubuntu22.04"]
_DLAMI_PARAMETER_PREFIX = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-"
DLAMI_PARAMETERS = {
    "ubuntu22.04": _DLAMI_PARAMETER_PREFIX + "ubuntu-22.04/latest/ami-id",
    "ubuntu24.04": _DLAMI_PARAMETER_PREFIX + "ubuntu-24.04/latest/ami-id",
}
DLAMI_PARAMETER = DLAMI_PARAMETERS["ubuntu22.04"]
# The packer fallback filters for the same images (local.dlami_name_filters in packer/gpuforge.pkr.hcl).
DLAMI_NAME_FILTERS = {
    base_os: f"Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu {base_os[6:]}) *" for base_os in BASE_OSES
}
DLAMI_NAME_FILTER = DLAMI_NAME_FILTERS["ubuntu22.04"]
AMAZON_OWNER = "amazon"
# Instances in these states keep their AMI in use (a stopped instance can be started again).
_LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]


def _delete_snapshot(ec2: Any, snapshot_id: str) -> None:
    """Delete a snapshot; one already gone is what was wanted."""
    try:
        ec2.delete_snapshot(SnapshotId=snapshot_id)
    except ClientError as exc:
        if exc.response["Error"]["Code"] != "InvalidSnapshot.NotFound":
            raise


def pcluster_name_filter(pcluster_version: str, base_os: str = "ubuntu22.04") -> str:
    """Name pattern of the official ParallelCluster Ubuntu x86_64 AMIs of one release."""
    return f"aws-parallelcluster-{pcluster_version}-ubuntu-{base_os[6:].replace('.', '')}-lts-hvm-x86_64*"


def _age(image: Image) -> tuple[str, str]:
    """Sort key: EC2 creation dates have one-second resolution, so the id breaks ties deterministically."""
    return image.creation_date, image.id


def newest(images: Iterable[Image]) -> Image | None:
    return max(images, key=_age, default=None)


def resolve_base(
    flavor: str,
    region: str | None = None,
    *,
    pcluster_version: str,
    parameter: str = DLAMI_PARAMETER,
    owner: str = AMAZON_OWNER,
    base_os: str = "ubuntu22.04",
) -> Image:
    """The base AMI to bake on: the DLAMI from its public SSM parameter, or the newest official
    ParallelCluster AMI of pcluster_version by name with an explicit owner."""
    if flavor == "dlami":
        ami_id = _ssm_value(parameter, region)
        image = describe(ami_id, region)
    elif flavor == "pcluster":
        pattern = pcluster_name_filter(pcluster_version, base_os)
        found = newest(
            _describe(
                _ec2(region),
                Owners=[owner],
                Filters=[
                    {"Name": "name", "Values": [pattern]},
                    {"Name": "state", "Values": ["available"]},
                    {"Name": "architecture", "Values": ["x86_64"]},
                ],
            )
        )
        if found is None:
            raise UserError(
                f"no available image named {pattern} owned by {owner} in {region or aws.region()}; "
                "check --pcluster-version (ParallelCluster publishes AMIs per release)"
            )
        image = found
    else:
        raise UserError(f"unknown flavor {flavor!r}; choose one of {', '.join(FLAVORS)}")
    LOG.info("base image for %s: %s (%s)", flavor, image.id, image.name)
    return image


def _ssm_value(name: str, region: str | None) -> str:
    ssm = aws.client("ssm", region_name=region)
    try:
        value = str(ssm.get_parameter(Name=name)["Parameter"]["Value"])
    except ClientError as exc:
        if exc.response["Error"]["Code"] == "ParameterNotFound":
            raise UserError(f"SSM parameter {name} does not exist in {region or aws.region()}") from None
        raise ExternalError(f"SSM GetParameter {name} failed: {exc}") from exc
    return check_ami_id(value)


def gpuforge_images(
    flavor: str | None = None, region: str | None = None, os: str | None = None
) -> list[Image]:
    """Images this account baked with gpuforge (tagged gpuforge:flavor), oldest first; with os, only those
    of that OS (ubuntu2204 / ubuntu2404, see Image.os)."""
    filters = [
        {"Name": f"tag:{FLAVOR_TAG}", "Values": [flavor]}
        if flavor
        else {"Name": "tag-key", "Values": [FLAVOR_TAG]}
    ]
    images = _describe(_ec2(region), Owners=["self"], Filters=filters)
    return sorted((i for i in images if os is None or i.os == os), key=_age)


def images_with_build_id(build_id: str, region: str | None = None) -> list[Image]:
    filters = [{"Name": f"tag:{BUILD_ID_TAG}", "Values": [build_id]}]
    return _describe(_ec2(region), Owners=["self"], Filters=filters)


def wait_available(ami_id: str, region: str | None = None, timeout_s: int = 3600) -> None:
    delay = 15
    waiter = _ec2(region).get_waiter("image_available")
    try:
        waiter.wait(
            ImageIds=[ami_id], WaiterConfig={"Delay": delay, "MaxAttempts": max(1, timeout_s // delay)}
        )
    except WaiterError as exc:
        raise ExternalError(f"image {ami_id} did not become available: {exc}") from exc


def require_imdsv2(ami_id: str, region: str | None = None) -> None:
    """Mark the image IMDSv2-only (instances launched from it get HttpTokens=required).

    Packer 1.6 knows neither imds_support nor metadata_options, so the pipeline sets the image
    attribute itself for both Packer generations; EC2 does not allow undoing it.
    """
    try:
        _ec2(region).modify_image_attribute(ImageId=ami_id, ImdsSupport={"Value": "v2.0"})
    except ClientError as exc:
        raise ExternalError(f"cannot set ImdsSupport=v2.0 on {ami_id}: {exc}") from exc


def require_instance_imdsv2(instance_id: str, region: str | None = None) -> None:
    """Make a running instance IMDSv2-only (HttpTokens=required, the endpoint left enabled).

    For the Packer builder, which Packer 1.6 launches with the account's IMDS defaults: from here on,
    a process on it (a provisioner, a package's install script) gets the instance profile's
    credentials only with a session token, never with a plain GET that an SSRF could forge.
    """
    try:
        reply = _ec2(region).modify_instance_metadata_options(
            InstanceId=instance_id, HttpTokens="required", HttpEndpoint="enabled"
        )
    except (ClientError, BotoCoreError) as exc:
        raise ExternalError(f"cannot require IMDSv2 on builder instance {instance_id}: {exc}") from exc
    options = reply.get("InstanceMetadataOptions", {})
    # EC2 answers with the options it will apply; anything else means the request did not take.
    if options.get("HttpTokens") != "required" or options.get("HttpEndpoint", "enabled") != "enabled":
        raise ExternalError(
            f"builder instance {instance_id} reports metadata options {options}, not HttpTokens=required"
        )


def amis_of_live_instances(region: str | None = None) -> set[str]:
    """AMI ids that any not-terminated instance was launched from."""
    ec2 = _ec2(region)
    try:
        pages = ec2.get_paginator("describe_instances").paginate(
            Filters=[{"Name": "instance-state-name", "Values": _LIVE_STATES}]
        )
        return {
            instance["ImageId"]
            for page in pages
            for reservation in page["Reservations"]
            for instance in reservation["Instances"]
        }
    except ClientError as exc:
        raise ExternalError(f"EC2 DescribeInstances failed: {exc}") from exc


def deregister(image: Image, region: str | None = None) -> None:
    """Deregister the image, then delete its snapshots (EC2 refuses while the image holds them)."""
    ec2 = _ec2(region)
    try:
        ec2.deregister_image(ImageId=image.id)
        for snapshot in image.snapshot_ids:
            _delete_snapshot(ec2, snapshot)
    except ClientError as exc:
        raise ExternalError(f"cannot retire image {image.id}: {exc}") from exc
    LOG.info("deregistered %s (%s) and %d snapshot(s)", image.id, image.name, len(image.snapshot_ids))


def enabled_regions(region: str | None = None) -> set[str]:
    """The regions this account can use (EC2 DescribeRegions without AllRegions: the regions enabled for
    it, opt-in ones only once opted in), asked in region."""
    try:
        reply = _ec2(region).describe_regions(AllRegions=False)
    except (ClientError, BotoCoreError) as exc:
        raise ExternalError(f"EC2 DescribeRegions in {region or aws.region()} failed: {exc}") from exc
    return {r["RegionName"] for r in reply.get("Regions", [])}


def check_copy_regions(regions: Iterable[str], region: str | None = None) -> None:
    """Refuse, before anything is launched, copy regions this account cannot copy to (a typo, or an opt-in
    region not enabled): the copy would fail only after the whole bake. packer-plugin-amazon v1.8.2 made
    the same check of ami_regions before launching (builder/common/step_pre_validate.go:70-80,
    builder/common/regions.go:29-50)."""
    wanted = list(regions)
    if not wanted:
        return
    known = enabled_regions(region)
    bad = [r for r in wanted if r not in known]
    if bad:
        raise UserError(
            f"--copy-region {', '.join(bad)}: not a region enabled for this account "
            f"(EC2 DescribeRegions in {region or aws.region()} lists {', '.join(sorted(known))}); "
            "fix the name, or enable the opt-in region first"
        )


def copy_client_token(build_id: str, target_region: str) -> str:
    """CopyImage's idempotency token for one bake's copy to one region: EC2 takes up to 64 ASCII
    characters (Amazon EC2 API Reference, "Ensuring idempotency"), so a longer one is hashed."""
    token = f"{build_id}-{target_region}"
    if len(token) <= 64 and token.isascii():
        return token
    return hashlib.sha256(token.encode()).hexdigest()


def copy_image(image: Image, source_region: str, target_region: str, kms_key_id: str = "") -> str:
    """Copy image into target_region; return the copy's id. The copy and its new snapshots get the
    image's tags in the CopyImage call itself (TagSpecifications), so the copy's snapshots carry the build
    id from their first moment and a failed bake can find and delete them.

    Packer's region copy cannot be used: packer-plugin-amazon v1.8.2 copies with CopyImageTags and no
    TagSpecifications (builder/common/step_ami_region_copy.go:215-222), which copies only the AMI's own
    tags, and then tags the copy and its untagged snapshots in one standalone CreateTags
    (builder/common/step_create_tags.go:116-120), which a policy scoped to gpuforge-tagged snapshots
    denies. Tags given at creation are authorized as ec2:CreateTags with ec2:CreateAction=CopyImage and
    the request's tags (Amazon EC2 User Guide, "Grant permission to tag Amazon EC2 resources during
    creation"; CopyImage TagSpecifications, Amazon EC2 API Reference), which the pipeline policy scopes
    to requests that carry gpuforge:build-id.

    The copy is encrypted (the image always is: the template's launch volume), with kms_key_id, a key
    of target_region, or else that region's default EBS key.
    """
    tags = [{"Key": k, "Value": v} for k, v in sorted(image.tags.items()) if not k.startswith("aws:")]
    if BUILD_ID_TAG not in image.tags:
        raise ExternalError(f"image {image.id} has no {BUILD_ID_TAG} tag: gpuforge copies only its own bakes")
    request: dict[str, object] = {
        # boto3 retries a call whose reply was lost; the token makes EC2 answer a retry with the copy it
        # already started instead of a second one (CopyImage ClientToken, Amazon EC2 API Reference).
        "ClientToken": copy_client_token(image.tags[BUILD_ID_TAG], target_region),
        "SourceImageId": image.id,
        "SourceRegion": source_region,
        "Name": image.name,
        "Encrypted": True,
        "TagSpecifications": [
            {"ResourceType": "image", "Tags": tags},
            {"ResourceType": "snapshot", "Tags": tags},
        ],
    }
    if image.description:
        # Packer gave every image it made, copies too, the template's ami_description (packer-plugin-amazon
        # v1.8.2 builder/common/step_modify_ami_attributes.go:78-82, 205-213): the copy gets the same.
        request["Description"] = image.description
    if kms_key_id:
        request["KmsKeyId"] = kms_key_id
    try:
        copy_id = str(_ec2(target_region).copy_image(**request)["ImageId"])
    except ClientError as exc:
        raise ExternalError(f"cannot copy image {image.id} to {target_region}: {exc}") from exc
    LOG.info("copying %s (%s) to %s as %s", image.id, image.name, target_region, copy_id)
    return copy_id


def manual_discard(build_id: str, region: str) -> str:
    """The AWS CLI commands that list what a bake left in region, for an operator to retire by hand."""
    tag = f"Name=tag:{BUILD_ID_TAG},Values={build_id}"
    return (
        f"aws ec2 describe-images --region {region} --owners self --filters {tag} "
        "--query 'Images[].ImageId' --output text (then aws ec2 deregister-image "
        f"--region {region} --image-id ID for each), then aws ec2 describe-snapshots --region {region} "
        f"--owner-ids self --filters {tag} --query 'Snapshots[].SnapshotId' --output text (then aws ec2 "
        f"delete-snapshot --region {region} --snapshot-id ID for each)"
    )


def discard_build(
    build_id: str, region: str | None = None, *, settle_s: float = 600.0, poll_s: float = 10.0
) -> None:
    """Retire everything a bake left in region: its images (whatever their state: a failed copy is an image
    in state failed) with their snapshots, then any snapshot that still carries the build id (one whose
    image is gone: a copy EC2 gave up on, or a snapshot Packer's cleanup could not delete).

    An image deregistered before it was available (a copy whose wait timed out or was interrupted) may get
    its snapshot only afterwards, and a pending snapshot cannot be deleted yet: then DescribeSnapshots is
    asked again, every poll_s doubling up to a minute, for at most settle_s seconds, until a snapshot has
    turned up and none is pending; what is still pending then is logged with the command to delete it.
    """
    the_region = region or aws.region()
    unfinished = 0
    for image in images_with_build_id(build_id, region):
        LOG.warning("discarding %s from failed bake %s", image.id, build_id)
        deregister(image, region)
        unfinished += image.state != "available"
    deadline = time.monotonic() + (settle_s if unfinished else 0.0)
    if unfinished:
        LOG.warning(
            "waiting up to %d s for the snapshots of %d unfinished image(s) of bake %s in %s",
            settle_s,
            unfinished,
            build_id,
            the_region,
        )
    # Whether a tagged snapshot has turned up since the images went: the ones an unfinished image named
    # are not enough (a copy of several volumes may not have made them all yet).
    seen = False
    delay = poll_s
    while True:
        pending = _delete_build_snapshots(build_id, region)
        seen = seen or pending is not None
        pending = pending or []
        if (not pending and (seen or not unfinished)) or time.monotonic() >= deadline:
            break
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 60.0)
    for snapshot in pending:
        LOG.error(
            "snapshot %s of failed bake %s is still pending in %s; delete it once it completes: "
            "aws ec2 delete-snapshot --region %s --snapshot-id %s",
            snapshot,
            build_id,
            the_region,
            the_region,
            snapshot,
        )


def _delete_build_snapshots(build_id: str, region: str | None) -> list[str] | None:
    """Delete the snapshots tagged with build_id that are no longer pending; return the pending ones'
    ids, or None when no snapshot carries the tag."""
    ec2 = _ec2(region)
    filters = [{"Name": f"tag:{BUILD_ID_TAG}", "Values": [build_id]}]
    try:
        pages = ec2.get_paginator("describe_snapshots").paginate(OwnerIds=["self"], Filters=filters)
        found = sorted(
            ((s["SnapshotId"], s.get("State", "")) for page in pages for s in page.get("Snapshots", [])),
        )
        for snapshot, state in found:
            if state == "pending":
                continue
            LOG.warning("deleting snapshot %s of failed bake %s", snapshot, build_id)
            _delete_snapshot(ec2, snapshot)
    except ClientError as exc:
        raise ExternalError(f"cannot delete the snapshots of bake {build_id}: {exc}") from exc
    if not found:
        return None
    return [snapshot for snapshot, state in found if state == "pending"]


def add_tags(ami_id: str, tags: dict[str, str], region: str | None = None) -> None:
    """Add tags to a registered image (what it really carries, known only after the build)."""
    if not tags:
        return
    try:
        _ec2(region).create_tags(
            Resources=[ami_id], Tags=[{"Key": k, "Value": v} for k, v in sorted(tags.items())]
        )
    except ClientError as exc:
        raise ExternalError(f"cannot tag image {ami_id}: {exc}") from exc


def stale_reason(
    image: Image | None, base: Image, versions_hash: str, inputs_hash: str | None = None
) -> str | None:
    """Why a rebuild is due, or None when image (the published one: `rebuild --if-stale`) was baked on
    this base with these pins and, given inputs_hash (gpuforge.ami.inputs.digest), these bake inputs."""
    if image is None:
        return "no gpuforge image of this flavor exists yet"
    tags = image.tags
    if tags.get(SOURCE_AMI_TAG) != base.id:
        return f"base image changed: {tags.get(SOURCE_AMI_TAG, 'untagged')} -> {base.id} ({base.name})"
    if tags.get(VERSIONS_HASH_TAG) != versions_hash:
        old = tags.get(VERSIONS_HASH_TAG, "untagged")
        return f"versions manifest changed: {old[:12]} -> {versions_hash[:12]}"
    if inputs_hash is not None and tags.get(INPUTS_HASH_TAG) != inputs_hash:
        return (
            "bake inputs changed (roles, playbooks, plugins, packer templates or data): "
            f"{tags.get(INPUTS_HASH_TAG, 'untagged')[:12]} -> {inputs_hash[:12]}"
        )
    return None
