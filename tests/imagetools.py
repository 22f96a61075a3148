"""Images in moto (the test double for EC2) as a gpuforge bake leaves them, for publish and set-ami tests."""

from __future__ import annotations

import boto3

from gpuforge import versions
from gpuforge.ami import bake

# One of moto's built-in public images, standing in for the base image.
SOURCE = "ami-785db401"


def baked_image(flavor: str, name: str = "", *, tags: dict[str, str] | None = None) -> str:
    """Register an image tagged as `gpuforge bake --flavor FLAVOR` tags it (or with tags, exactly those)."""
    ec2 = boto3.client("ec2")
    instance = ec2.run_instances(ImageId=SOURCE, MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    ami = str(ec2.create_image(InstanceId=instance, Name=name or f"gpuforge-{flavor}-test")["ImageId"])
    ec2.terminate_instances(InstanceIds=[instance])
    if tags is None:
        tags = bake.flavor_tags(versions.load(), flavor, bake.installed_pcluster_version()) | {
            "gpuforge:flavor": flavor,
            "gpuforge:build-id": "0123456789ab",
            "gpuforge:source-ami-id": SOURCE,
        }
    if tags:
        ec2.create_tags(Resources=[ami], Tags=[{"Key": k, "Value": v} for k, v in tags.items()])
    return ami
