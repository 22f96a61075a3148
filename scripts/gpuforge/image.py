"""One EC2 image as gpuforge reads it: the Image record, DescribeImages, and the tags both the AMI pipeline
(gpuforge.ami) and the cluster-config commands (gpuforge.pcluster) read from it.

Below both packages (it imports neither), so that `cluster-config set-ami` and `roll` can read and judge an
image (gpuforge.fitness) without importing the AMI pipeline, and the pipeline without importing them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from gpuforge import aws
from gpuforge.amiid import check_ami_id
from gpuforge.errors import ExternalError, UserError

FLAVOR_TAG = "gpuforge:flavor"
BUILD_ID_TAG = "gpuforge:build-id"
SOURCE_AMI_TAG = "gpuforge:source-ami-id"
# The image's OS in ParallelCluster's spelling, on every gpuforge image (both flavors), so that the
# Ubuntu 22.04 and 24.04 images of one flavor are told apart: listed, published and judged stale
# separately. pcluster-flavor images also carry ParallelCluster's own tag, which its
# AmiOsCompatibleValidator compares with the cluster's Image.Os (aws-parallelcluster 3.16.1,
# pcluster/validators/ec2_validators.py AmiOsCompatibleValidator; pcluster/constants.py
# PCLUSTER_IMAGE_OS_TAG = "parallelcluster:os").
OS_TAG = "gpuforge:os"
PCLUSTER_OS_TAG = "parallelcluster:os"


@dataclass(frozen=True)
class Image:
    id: str
    name: str
    creation_date: str  # ISO 8601 as EC2 returns it; sorts chronologically
    state: str
    tags: dict[str, str]
    snapshot_ids: tuple[str, ...]
    # GiB of the root volume's snapshot: every node's RootVolume.Size must be at least this. Read as
    # ParallelCluster reads it, from the first block device mapping (aws-parallelcluster 3.16.1,
    # pcluster/aws/aws_resources.py ImageInfo.volume_size); None when EC2 did not say.
    root_volume_gib: int | None = None
    description: str = ""

    @classmethod
    def from_api(cls, data: dict[str, Any]) -> Image:
        mappings = data.get("BlockDeviceMappings", [])
        snapshots = tuple(
            bdm["Ebs"]["SnapshotId"] for bdm in mappings if bdm.get("Ebs", {}).get("SnapshotId")
        )
        size = mappings[0].get("Ebs", {}).get("VolumeSize") if mappings else None
        return cls(
            id=data["ImageId"],
            name=data.get("Name", ""),
            creation_date=data.get("CreationDate", ""),
            state=data.get("State", ""),
            tags={t["Key"]: t["Value"] for t in data.get("Tags", [])},
            snapshot_ids=snapshots,
            root_volume_gib=int(size) if size is not None else None,
            description=data.get("Description", ""),
        )

    @property
    def os(self) -> str | None:
        """ubuntu2204 / ubuntu2404 from ParallelCluster's tag, else gpuforge's; None when untagged."""
        return self.tags.get(PCLUSTER_OS_TAG) or self.tags.get(OS_TAG)


def ec2_client(region: str | None) -> Any:
    return aws.client("ec2", region_name=region)


def describe_images(ec2: Any, **kwargs: Any) -> list[Image]:
    """Every image DescribeImages returns for these arguments (all pages)."""
    try:
        pages = ec2.get_paginator("describe_images").paginate(**kwargs)
        return [Image.from_api(item) for page in pages for item in page["Images"]]
    except ClientError as exc:
        if exc.response["Error"]["Code"] == "InvalidAMIID.NotFound":
            raise UserError(f"image {', '.join(kwargs.get('ImageIds', []))} does not exist: {exc}") from None
        raise ExternalError(f"EC2 DescribeImages failed: {exc}") from exc


def describe(ami_id: str, region: str | None = None) -> Image:
    images = describe_images(ec2_client(region), ImageIds=[check_ami_id(ami_id)])
    if not images:
        raise UserError(f"image {ami_id} does not exist in {region or aws.region()}")
    return images[0]
