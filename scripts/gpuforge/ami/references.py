"""Every image something in the account still uses, so that pruning never deregisters one.

Sources, each read through gpuforge.aws clients (one boto3 client per service, paginators):
- SSM parameters: every parameter under the project's prefix (GetParametersByPath, recursive), plus any
  parameter named on the command line (GetParameter);
- launch templates: the default and the latest version of each (DescribeLaunchTemplates,
  DescribeLaunchTemplateVersions). ParallelCluster keeps one per queue and compute resource, so a queue
  scaled to zero still uses its AMI although no instance shows it;
- instances in every state but terminated (DescribeInstances);
- cluster configs given as files;
- ParallelCluster clusters, found and read as `pcluster list-clusters` / `describe-cluster` do
  (aws-parallelcluster 3.16.1, pcluster/aws/cfn.py list_pcluster_stacks and models/cluster.py
  config_presigned_url): CloudFormation stacks without a parent that carry the `parallelcluster:version`
  tag and no `parallelcluster:image-id` tag; each one's original config is the S3 object
  `<ResourcesS3Bucket>/<ArtifactS3RootDirectory>/configs/cluster-config.yaml` at version `ConfigVersion`
  (all three are stack parameters).

A source that cannot be listed is an error. A named parameter that does not exist, or a config that cannot
be read, is an error too unless the caller allows missing sources (`gpuforge prune --allow-missing`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from botocore.exceptions import BotoCoreError, ClientError

from gpuforge import aws
from gpuforge.ami import images, publish
from gpuforge.errors import ExternalError, UserError
from gpuforge.pcluster import config as pcluster_config

LOG = logging.getLogger(__name__)

# Every gpuforge parameter lives under this path (publish writes /gpuforge/ami/<flavor>/latest).
PROJECT_PREFIX = "/gpuforge/"
# Any AMI id inside a text (a parameter value, a config field gpuforge does not know yet).
_AMI_IN_TEXT = re.compile(r"\bami-(?:[0-9a-f]{17}|[0-9a-f]{8})\b")
# ParallelCluster's stack tags and parameters (aws-parallelcluster 3.16.1 pcluster/constants.py,
# pcluster/models/cluster_resources.py ClusterStack).
PCLUSTER_VERSION_TAG = "parallelcluster:version"
PCLUSTER_IMAGE_ID_TAG = "parallelcluster:image-id"
PCLUSTER_CONFIG_NAME = "cluster-config.yaml"
# SSM references in launch template ImageIds ("resolve:ssm:/path" or "resolve:ssm:/path:3").
_SSM_IMAGE_PREFIX = "resolve:ssm:"


@dataclass(frozen=True)
class Sources:
    """What to look at besides the account-wide discovery (which always runs)."""

    parameters: Sequence[str] = ()  # added to everything under parameter_prefix
    parameter_prefix: str = PROJECT_PREFIX
    configs: Sequence[Path] = ()
    allow_missing: bool = False


@dataclass
class References:
    """AMI id -> the first thing found using it (for the prune report)."""

    used_by: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def add(self, amis: Iterable[str], why: str) -> None:
        for ami in sorted(amis):
            self.used_by.setdefault(ami, why)


def ami_ids_in(text: str) -> set[str]:
    return set(_AMI_IN_TEXT.findall(text))


def _failed(what: str, exc: Exception) -> ExternalError:
    return ExternalError(f"{what} failed: {exc}")


def _all_pages(paginator: Any, what: str, **params: Any) -> list[dict[str, Any]]:
    """Every page of a paginated call; a failure is an ExternalError naming `what`.

    Callers name the paginator themselves (client.get_paginator("...")): the IAM audit
    (tests/iamaudit.py) reads the operations from those literal calls.
    """
    try:
        return list(paginator.paginate(**params))
    except (ClientError, BotoCoreError) as exc:
        raise _failed(what, exc) from exc


def _missing(refs: References, sources: Sources, message: str) -> None:
    if not sources.allow_missing:
        raise UserError(f"{message}; pruning needs every protection source (--allow-missing to go on)")
    LOG.warning("%s; going on (--allow-missing)", message)
    refs.warnings.append(message)


def _parameters(refs: References, sources: Sources, region: str | None) -> None:
    ssm = aws.client("ssm", region_name=region)
    prefix = sources.parameter_prefix
    found: set[str] = set()
    pages = _all_pages(
        ssm.get_paginator("get_parameters_by_path"),
        f"SSM GetParametersByPath {prefix}",
        Path=prefix.rstrip("/") or "/",
        Recursive=True,
    )
    for page in pages:
        for parameter in page["Parameters"]:
            found.add(parameter["Name"])
            refs.add(ami_ids_in(str(parameter.get("Value", ""))), f"SSM parameter {parameter['Name']}")
    for name in sources.parameters:
        if name in found:
            continue
        value = _parameter_value(ssm, name)
        if value is None:
            _missing(refs, sources, f"SSM parameter {name} does not exist")
        else:
            refs.add(ami_ids_in(value), f"SSM parameter {name}")


def _parameter_value(ssm: Any, name: str) -> str | None:
    if not name:
        raise UserError("an SSM parameter name must not be empty")
    try:
        return publish.parameter_value(ssm, name)
    except BotoCoreError as exc:
        raise ExternalError(f"SSM GetParameter {name} failed: {exc}") from exc


def _launch_templates(refs: References, sources: Sources, region: str | None) -> None:
    ec2 = aws.client("ec2", region_name=region)
    ssm: Any = None
    pages = _all_pages(ec2.get_paginator("describe_launch_templates"), "EC2 DescribeLaunchTemplates")
    for template in (t for page in pages for t in page["LaunchTemplates"]):
        template_id, name = template["LaunchTemplateId"], template.get("LaunchTemplateName", "")
        try:
            versions = ec2.describe_launch_template_versions(
                LaunchTemplateId=template_id, Versions=["$Default", "$Latest"]
            )["LaunchTemplateVersions"]
        except (ClientError, BotoCoreError) as exc:
            raise _failed(f"EC2 DescribeLaunchTemplateVersions {template_id}", exc) from exc
        for version in versions:
            image = str(version.get("LaunchTemplateData", {}).get("ImageId", ""))
            label = "default" if version.get("DefaultVersion") else "latest"
            why = f"launch template {name} ({template_id}) version {version.get('VersionNumber')} ({label})"
            if image.startswith(_SSM_IMAGE_PREFIX):
                # EC2 resolves the parameter at launch: what it holds now is what the next launch uses.
                parameter = image[len(_SSM_IMAGE_PREFIX) :]
                ssm = ssm or aws.client("ssm", region_name=region)
                # SSM names cannot hold ':', so what follows one is a version or label selector.
                value = _parameter_value(ssm, parameter.split(":", 1)[0])
                if value is None:
                    _missing(refs, sources, f"{why} names SSM parameter {parameter}, which does not exist")
                    continue
                image = value
            refs.add(ami_ids_in(image), why)


def _instances(refs: References, region: str | None) -> None:
    refs.add(images.amis_of_live_instances(region), "an instance that is not terminated")


def config_amis(config: Any, source: str) -> set[str]:
    """Every AMI a cluster config references; a config of the wrong shape is a UserError.

    The known places (Image, HeadNode.Image, each queue's and login pool's Image) must have
    ParallelCluster's shape; any other AMI id anywhere in the config protects its image too.
    """
    if not isinstance(config, dict):
        raise UserError(f"{source}: a cluster config must be a mapping")
    problems = pcluster_config.image_shape_errors(config)
    if problems:
        raise UserError(
            f"{source} does not have ParallelCluster's shape, so its images cannot be told: "
            + "; ".join(problems)
        )
    return pcluster_config.custom_amis(config) | ami_ids_in(yaml.safe_dump(config))


def _config_files(refs: References, sources: Sources) -> None:
    for path in sources.configs:
        try:
            config = pcluster_config.load_config(path)
        except UserError as exc:
            if not path.exists():
                _missing(refs, sources, str(exc))
                continue
            raise
        refs.add(config_amis(config, f"cluster config {path}"), f"cluster config {path}")


def _stack_value(items: Sequence[dict[str, Any]], key: str, name: str, value: str) -> str | None:
    for item in items:
        if item.get(key) == name:
            return str(item.get(value, ""))
    return None


def _clusters(refs: References, sources: Sources, region: str | None) -> None:
    cfn = aws.client("cloudformation", region_name=region)
    s3: Any = None
    pages = _all_pages(cfn.get_paginator("describe_stacks"), "CloudFormation DescribeStacks")
    for page in pages:
        for stack in page["Stacks"]:
            tags = stack.get("Tags", [])
            if stack.get("ParentId") or _stack_value(tags, "Key", PCLUSTER_VERSION_TAG, "Value") is None:
                continue
            if _stack_value(tags, "Key", PCLUSTER_IMAGE_ID_TAG, "Value") is not None:
                continue  # a `pcluster build-image` stack, not a cluster
            name = stack["StackName"]
            params = stack.get("Parameters", [])
            bucket = _stack_value(params, "ParameterKey", "ResourcesS3Bucket", "ParameterValue")
            root = _stack_value(params, "ParameterKey", "ArtifactS3RootDirectory", "ParameterValue")
            version = _stack_value(params, "ParameterKey", "ConfigVersion", "ParameterValue")
            if not bucket or not root:
                _missing(refs, sources, f"ParallelCluster cluster {name} names no configuration bucket")
                continue
            key = f"{root}/configs/{PCLUSTER_CONFIG_NAME}"
            s3 = s3 or aws.client("s3", region_name=region)
            request = {"Bucket": bucket, "Key": key} | ({"VersionId": version} if version else {})
            try:
                body = s3.get_object(**request)["Body"].read().decode()
            except (ClientError, BotoCoreError) as exc:
                _missing(
                    refs,
                    sources,
                    f"cannot read ParallelCluster cluster {name}'s config s3://{bucket}/{key}: {exc}",
                )
                continue
            source = f"ParallelCluster cluster {name}"
            try:
                config = yaml.safe_load(body)
            except yaml.YAMLError as exc:
                raise UserError(f"{source}: its config s3://{bucket}/{key} is not YAML: {exc}") from None
            refs.add(config_amis(config, source), source)


def find(sources: Sources, region: str | None = None) -> References:
    """Every image in use in region, with what uses it."""
    refs = References()
    _parameters(refs, sources, region)
    _config_files(refs, sources)
    _launch_templates(refs, sources, region)
    _instances(refs, region)
    _clusters(refs, sources, region)
    return refs
