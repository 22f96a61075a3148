"""Offline validation of a cluster config with aws-parallelcluster's own marshmallow schema.

How ParallelCluster validates (aws-parallelcluster 3.16.1, pcluster.models.cluster.Cluster):
`pcluster create-cluster --dryrun true` / `validate_create_request` first checks that no CloudFormation
stack of that name exists, then `_validate_and_parse_config` does two steps:

1. syntactic: `ClusterSchema(cluster_name=...).load(config)` (marshmallow): required sections, unknown
   keys, types, enums and regexes (subnet, AMI, FSx ids). It makes no AWS calls, but the objects it builds
   read the region from boto3's session (`get_region()`), which ParallelCluster sets beforehand from the
   config's Region (`configure_aws_region_from_config`).
2. semantic: `config.validate()` runs some hundred validators, most of which call EC2, FSx, IAM, S3 or
   CloudFormation (instance type info, subnets' AZs, AMI lookups, quotas).

This module runs step 1 only, so it works offline and in CI. Step 2 needs a real account: run
`pcluster create-cluster --dryrun true` before a launch. The region check uses the supported-regions list
shipped inside the package: `pcluster.utils.retrieve_supported_regions()` would fetch it from S3 first.

On top of the schema, gpuforge refuses configs that switch off what its generated configs state
explicitly: IMDSv2-only instances and encrypted root volumes (see `security_errors`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from gpuforge.errors import UserError

# The name only feeds objects the schema builds; no config field depends on it.
_SCHEMA_CLUSTER_NAME = "gpuforge-validate"


@cache
def supported_regions() -> frozenset[str]:
    """The regions this aws-parallelcluster release supports, from the list it ships."""
    text = (resources.files("pcluster") / "resources" / "supported-regions").read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.strip())


@contextmanager
def region_env(region: str) -> Iterator[None]:
    """Set AWS_DEFAULT_REGION for the schema load, as ParallelCluster itself does, and restore it."""
    saved = os.environ.get("AWS_DEFAULT_REGION")
    os.environ["AWS_DEFAULT_REGION"] = region
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("AWS_DEFAULT_REGION", None)
        else:
            os.environ["AWS_DEFAULT_REGION"] = saved


@contextmanager
def _no_capacity_reservation_lookup() -> Iterator[None]:
    """Keep the schema load offline for configs with a CapacityReservationTarget.

    aws-parallelcluster 3.16.1's SlurmClusterConfig.__init__ (pcluster/config/cluster_config.py) warms a
    cache with `Ec2Client.describe_capacity_reservations` for the semantic validators of step 2, which
    this module does not run; the call is replaced by an empty answer while the schema loads.
    """
    from pcluster.aws.ec2 import Ec2Client

    original = Ec2Client.describe_capacity_reservations
    Ec2Client.describe_capacity_reservations = lambda self, *args, **kwargs: []
    try:
        yield
    finally:
        Ec2Client.describe_capacity_reservations = original


def error_lines(messages: Any, path: str = "") -> list[str]:
    """Flatten marshmallow's nested error messages to "Path.To[0].Key: message" lines."""
    if isinstance(messages, dict):
        lines: list[str] = []
        for key, value in messages.items():
            if isinstance(key, int):
                sub = f"{path}[{key}]"
            elif key == "_schema":
                sub = path
            else:
                sub = f"{path}.{key}" if path else str(key)
            lines.extend(error_lines(value, sub))
        return lines
    if isinstance(messages, list) and all(isinstance(m, str) for m in messages):
        return [f"{path or '(top level)'}: {m}" for m in messages]
    if isinstance(messages, list):
        return [line for m in messages for line in error_lines(m, path)]
    return [f"{path or '(top level)'}: {messages}"]


def config_region(config: dict[str, Any]) -> str:
    region = config.get("Region") or os.environ.get("AWS_DEFAULT_REGION")
    if not region:
        raise UserError(
            "the cluster config has no Region (and AWS_DEFAULT_REGION is unset): add Region: <region>"
        )
    if not isinstance(region, str) or region not in supported_regions():
        raise UserError(f"Region: {region!r} is not a region ParallelCluster supports")
    return region


def _get(value: Any, *keys: str) -> Any:
    """value[k1][k2]...; None where a level is missing or not a mapping (the schema has vetted shapes)."""
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def security_errors(config: dict[str, Any]) -> list[str]:
    """Each setting that turns off IMDSv2-only access or root volume encryption, with what to change.

    Only explicit settings are refused: left out, ParallelCluster 3 defaults to ImdsSupport v2.0 and
    encrypted root volumes, which is what gpuforge wants.
    """
    errors: list[str] = []
    if _get(config, "Imds", "ImdsSupport") == "v1.0":
        errors.append(
            "Imds.ImdsSupport: v1.0 lets every node answer IMDSv1 requests, whose instance credentials an "
            "SSRF can read; set ImdsSupport: v2.0"
        )
    volumes = [("HeadNode.LocalStorage.RootVolume", _get(config, "HeadNode", "LocalStorage", "RootVolume"))]
    queues = _get(config, "Scheduling", "SlurmQueues")
    for i, queue in enumerate(queues if isinstance(queues, list) else []):
        volumes.append(
            (
                f"Scheduling.SlurmQueues[{i}].ComputeSettings.LocalStorage.RootVolume",
                _get(queue, "ComputeSettings", "LocalStorage", "RootVolume"),
            )
        )
    for path, volume in volumes:
        if _get(volume, "Encrypted") is False:
            errors.append(
                f"{path}.Encrypted: false leaves the root volume unencrypted; set Encrypted: true "
                "(or remove the key: ParallelCluster encrypts by default)"
            )
    return errors


@dataclass(frozen=True)
class AmiFacts:
    """What a config check needs to know of an image: its OS tag and its root snapshot's size."""

    os: str | None
    root_volume_gib: int | None


def _node_groups(config: dict[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    """(name, AMI, RootVolume.Size) of each node group, with the AMI ParallelCluster launches it from:
    the group's own Image.CustomAmi, else the cluster's (aws-parallelcluster 3.16.1,
    pcluster/config/cluster_config.py head_node_ami, SlurmQueue.queue_ami, login_nodes_ami)."""
    cluster_ami = _get(config, "Image", "CustomAmi")
    head = _get(config, "HeadNode")
    yield (
        "HeadNode",
        _get(head, "Image", "CustomAmi") or cluster_ami,
        _get(head, "LocalStorage", "RootVolume", "Size"),
    )
    queues = _get(config, "Scheduling", "SlurmQueues")
    for queue in queues if isinstance(queues, list) else []:
        yield (
            f"Scheduling.SlurmQueues[{_get(queue, 'Name')}]",
            _get(queue, "Image", "CustomAmi") or cluster_ami,
            _get(queue, "ComputeSettings", "LocalStorage", "RootVolume", "Size"),
        )
    pools = _get(config, "LoginNodes", "Pools")
    for pool in pools if isinstance(pools, list) else []:
        yield f"LoginNodes.Pools[{_get(pool, 'Name')}]", _get(pool, "Image", "CustomAmi") or cluster_ami, None


def image_errors(config: dict[str, Any], facts: Mapping[str, AmiFacts]) -> list[str]:
    """What ParallelCluster's create/update validators will refuse about the images in facts, checked
    before anything moves: a node group whose image is of another OS than the cluster's Image.Os
    (AmiOsCompatibleValidator, pcluster/validators/ec2_validators.py, an ERROR) or whose RootVolume.Size
    is smaller than the image's snapshot (RootVolumeSizeValidator, run here itself)."""
    from pcluster.validators.cluster_validators import RootVolumeSizeValidator
    from pcluster.validators.common import FailureLevel

    errors: list[str] = []
    cluster_os = _get(config, "Image", "Os")
    for group, ami, size in _node_groups(config):
        fact = facts.get(ami) if isinstance(ami, str) else None
        if fact is None:
            continue
        if fact.os and cluster_os and fact.os != cluster_os:
            errors.append(
                f"{group}: image {ami} is {fact.os} (its parallelcluster:os tag), the cluster's Image.Os is "
                f"{cluster_os}; ParallelCluster refuses that, and Image.Os cannot change on an existing "
                f"cluster: use a {cluster_os} image, or create a new {fact.os} cluster"
            )
        if isinstance(size, int) and fact.root_volume_gib is not None:
            results = RootVolumeSizeValidator().execute(
                root_volume_size=size, ami_volume_size=fact.root_volume_gib
            )
            errors.extend(
                f"{group}: {r.message} (raise LocalStorage.RootVolume.Size, or bake with a smaller "
                "--root-volume-size)"
                for r in results
                if r.level == FailureLevel.ERROR
            )
    return errors


def validate(config: dict[str, Any]) -> None:
    """Check config against ParallelCluster's ClusterSchema and gpuforge's security rules.

    A UserError lists each error with its path: schema errors first, since the security rules read
    values the schema has checked.
    """
    if not isinstance(config, dict):
        raise UserError("a cluster config must be a mapping (Region, Image, HeadNode, Scheduling, ...)")
    # Imported here: pcluster pulls in its whole config model, which commands that never validate don't need.
    from marshmallow import ValidationError
    from pcluster.schemas.cluster_schema import ClusterSchema

    region = config_region(config)
    try:
        with region_env(region), _no_capacity_reservation_lookup():
            # load() may fill defaults into what it is given; the caller's dict stays untouched.
            ClusterSchema(cluster_name=_SCHEMA_CLUSTER_NAME).load(copy.deepcopy(config))
    except ValidationError as exc:
        lines = sorted(error_lines(exc.messages))
        raise UserError(
            "the cluster config fails ParallelCluster's schema:\n  " + "\n  ".join(lines)
        ) from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        # ParallelCluster's post-load constructors raise these on shapes the schema let through.
        raise UserError(f"ParallelCluster cannot load the cluster config: {exc}") from None
    weakened = security_errors(config)
    if weakened:
        raise UserError("the cluster config turns off a security default:\n  " + "\n  ".join(weakened))


def image_facts(ami: str, region: str | None, force: bool = False) -> AmiFacts | None:
    """The image's OS tag and root snapshot size, read from EC2 (None with force when it cannot be)."""
    # Imported here: reading the image needs boto3, which offline actions do not.
    from gpuforge import image as images
    from gpuforge.errors import ExternalError, UserError

    try:
        image = images.describe(ami, region)
    except (UserError, ExternalError):
        if not force:
            raise
        return None
    return AmiFacts(image.os, image.root_volume_gib)


def named_region(config: dict[str, Any]) -> str | None:
    """A cluster config's Region, when it names one (config_region also falls back to the environment)."""
    region = config.get("Region")
    return region if isinstance(region, str) else None
