"""Turn a small cluster spec (docs/cluster-spec.md) into a full ParallelCluster 3 cluster config.

Hardware facts (EFA, GPUs) come from data/instance_types.yml via gpuforge.instance_types, and naming and
FSx rules from aws-parallelcluster's own validators, so neither is restated here. The result is checked
with ParallelCluster's schema (gpuforge.pcluster.validate) before it is returned.

Every config states its security settings (IMDSv2 only, a secured head node IMDS, encrypted root
volumes) even where they equal ParallelCluster's current defaults: a default can change between
releases, and an explicit value is what a reviewer and `gpuforge cluster-config validate` can check.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pcluster.config.common import CapacityType
from pcluster.constants import MAX_COMPUTE_RESOURCES_PER_QUEUE, MAX_NUMBER_OF_QUEUES
from pcluster.schemas.cluster_schema import FsxLustreSettingsSchema
from pcluster.schemas.common_schema import ALLOWED_VALUES
from pcluster.validators.cluster_validators import NameValidator
from pcluster.validators.common import FailureLevel, ValidationResult, Validator
from pcluster.validators.fsx_validators import (
    FsxPersistentOptionsValidator,
    FsxStorageCapacityValidator,
    FsxStorageTypeOptionsValidator,
)

from gpuforge import instance_types
from gpuforge.errors import UserError
from gpuforge.pcluster.config import check_ami_id
from gpuforge.pcluster.validate import supported_regions, validate

# The project's images are built on the Ubuntu 22.04 Deep Learning AMI.
IMAGE_OS = "ubuntu2204"
FSX_DEFAULT_NAME = "fsx"
FSX_DEFAULT_MOUNT_DIR = "/fsx"

_SUBNET_RE = re.compile(ALLOWED_VALUES["subnet_id"])
_INSTANCE_TYPE_RE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9-]+$")
# ParallelCluster downloads custom action scripts from S3 or over HTTPS.
_SCRIPT_URL_RE = re.compile(r"^(s3|https)://[^\s/]+/\S+$")
# A KMS key as FSx takes it: a key id, a multi-Region key id, or either as a key ARN.
_KMS_KEY_RE = re.compile(
    r"^(arn:aws[a-z-]*:kms:[a-z0-9-]+:\d{12}:key/)?"
    r"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|mrk-[0-9a-f]{32})$"
)

# Instances accept only IMDSv2 (session tokens), which blocks the SSRF-style credential theft that
# IMDSv1's plain GET allows. This is the cluster-wide setting; HeadNode.Imds.Secured is separate.
IMDS = {"ImdsSupport": "v2.0"}
# On the head node, only root and ParallelCluster's admin user may reach IMDS (and so the instance
# profile's credentials); other users on the head node cannot.
HEAD_NODE_IMDS = {"Secured": True}
# ParallelCluster's schema puts the root volume under HeadNode.LocalStorage and, for compute nodes,
# under each queue's ComputeSettings.LocalStorage (compute resources have no storage settings).
ENCRYPTED_ROOT_VOLUME = {"RootVolume": {"Encrypted": True}}


@dataclass(frozen=True)
class _Node:
    """One value of the spec and its dotted path, so every error names the field to fix."""

    value: Any
    path: str

    def fail(self, message: str) -> UserError:
        return UserError(f"cluster spec: {self.path or '(top level)'}: {message}")

    def mapping(
        self, required: set[str], optional: frozenset[str] | set[str] = frozenset()
    ) -> dict[str, _Node]:
        if not isinstance(self.value, dict):
            raise self.fail("must be a mapping")
        allowed = required | optional
        unknown = sorted(str(k) for k in self.value if k not in allowed)
        if unknown:
            raise self.fail(f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
        missing = sorted(k for k in required if self.value.get(k) is None)
        if missing:
            needed = ", ".join(sorted(required))
            raise UserError(f"cluster spec: {self._child_path(missing[0])}: missing (required: {needed})")
        return {k: _Node(v, self._child_path(k)) for k, v in self.value.items() if v is not None}

    def _child_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def items(self, min_len: int = 1, max_len: int | None = None) -> Iterator[_Node]:
        if not isinstance(self.value, list):
            raise self.fail("must be a list")
        if len(self.value) < min_len:
            raise self.fail(f"needs at least {min_len} item(s)")
        if max_len is not None and len(self.value) > max_len:
            raise self.fail(f"has {len(self.value)} items; ParallelCluster allows at most {max_len}")
        for i, item in enumerate(self.value):
            yield _Node(item, f"{self.path}[{i}]")

    def str(self, pattern: re.Pattern[str] | None = None, what: str = "") -> str:
        if not isinstance(self.value, str) or not self.value:
            raise self.fail("must be a non-empty string")
        if pattern is not None and not pattern.match(self.value):
            raise self.fail(f"{self.value!r} is not {what}")
        return self.value

    def int(self, minimum: int) -> int:
        # YAML's true/false are ints to Python; a count given as a boolean is a mistake.
        if isinstance(self.value, bool) or not isinstance(self.value, int):
            raise self.fail(f"must be an integer, got {self.value!r}")
        if self.value < minimum:
            raise self.fail(f"must be at least {minimum}, got {self.value}")
        return self.value

    def checked(self, check: Callable[[Any], Any]) -> Any:
        """Run one of gpuforge's own checks (which raise UserError) and prefix its message with the path."""
        try:
            return check(self.value)
        except UserError as exc:
            raise self.fail(str(exc)) from None


def _errors(results: list[ValidationResult]) -> list[str]:
    return [r.message for r in results if r.level == FailureLevel.ERROR]


def _name(node: _Node) -> str:
    """Queue and compute resource names follow ParallelCluster's NameValidator (lowercase, <= 25 chars)."""
    name = node.str()
    problems = _errors(NameValidator().execute(name))
    if problems:
        raise node.fail(" ".join(problems))
    return name


def _custom_action(node: _Node) -> dict[str, Any]:
    fields = node.mapping({"script"}, {"args"})
    action: dict[str, Any] = {
        "Script": fields["script"].str(_SCRIPT_URL_RE, "an s3:// or https:// URL of a script")
    }
    if "args" in fields:
        action["Args"] = [arg.str() for arg in fields["args"].items(min_len=0)]
    return {"OnNodeConfigured": action}


def _subnets(node: _Node) -> list[str]:
    subnets = [s.str(_SUBNET_RE, "a subnet id (subnet-<8 or 17 hex digits>)") for s in node.items()]
    if len(set(subnets)) != len(subnets):
        raise node.fail("lists a subnet more than once")
    return subnets


def _head_node(node: _Node) -> dict[str, Any]:
    fields = node.mapping({"instance_type", "subnet_id", "ssh_key"}, {"on_node_configured"})
    head: dict[str, Any] = {
        "InstanceType": fields["instance_type"].str(_INSTANCE_TYPE_RE, "an EC2 instance type (family.size)"),
        "Networking": {
            "SubnetId": fields["subnet_id"].str(_SUBNET_RE, "a subnet id (subnet-<8 or 17 hex digits>)")
        },
        "Ssh": {"KeyName": fields["ssh_key"].str()},
        "LocalStorage": copy.deepcopy(ENCRYPTED_ROOT_VOLUME),
    }
    if "on_node_configured" in fields:
        head["CustomActions"] = _custom_action(fields["on_node_configured"])
    head["Imds"] = dict(HEAD_NODE_IMDS)
    return head


def _compute_resource(node: _Node) -> dict[str, Any]:
    fields = node.mapping({"instance_type", "max_count"}, {"name", "min_count"})
    fields["instance_type"].str()
    itype = fields["instance_type"].checked(instance_types.get)
    name = (
        _name(fields["name"]) if "name" in fields else _name(_Node(itype.name.replace(".", "-"), node.path))
    )
    max_count = fields["max_count"].int(minimum=1)
    min_count = fields["min_count"].int(minimum=0) if "min_count" in fields else 0
    if min_count > max_count:
        raise fields["min_count"].fail(f"{min_count} is greater than max_count {max_count}")
    resource: dict[str, Any] = {
        "Name": name,
        "InstanceType": itype.name,
        "MinCount": min_count,
        "MaxCount": max_count,
    }
    if itype.efa_interfaces > 0:
        resource["Efa"] = {"Enabled": True}
    if itype.gpus > 0:
        resource["HealthChecks"] = {"Gpu": {"Enabled": True}}
    return resource


def _queue(node: _Node, managed_fsx: bool) -> dict[str, Any]:
    fields = node.mapping(
        {"name", "subnet_ids", "compute_resources"}, {"capacity_type", "ami", "on_node_configured"}
    )
    name = _name(fields["name"])
    queue: dict[str, Any] = {"Name": name}
    if "capacity_type" in fields:
        choices = [c.value for c in CapacityType]
        queue["CapacityType"] = fields["capacity_type"].str(
            re.compile(f"^({'|'.join(choices)})$"), f"one of {', '.join(choices)}"
        )
    if "ami" in fields:
        queue["Image"] = {"CustomAmi": fields["ami"].checked(check_ami_id)}
    queue["ComputeSettings"] = {"LocalStorage": copy.deepcopy(ENCRYPTED_ROOT_VOLUME)}
    resources = [
        _compute_resource(cr)
        for cr in fields["compute_resources"].items(max_len=MAX_COMPUTE_RESOURCES_PER_QUEUE)
    ]
    names = [r["Name"] for r in resources]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise fields["compute_resources"].fail(
            f"compute resource name(s) {', '.join(dupes)} repeat; give each a distinct name"
        )
    queue["ComputeResources"] = resources
    subnets = _subnets(fields["subnet_ids"])
    efa = any("Efa" in r for r in resources)
    # ParallelCluster rejects EFA across availability zones (EfaMultiAzValidator) and managed FSx with
    # multi-subnet queues (ManagedFsxMultiAzValidator); subnets' zones are unknown offline, so allow one.
    if len(subnets) > 1 and efa:
        raise fields["subnet_ids"].fail("an EFA queue must have exactly one subnet (EFA does not span AZs)")
    if len(subnets) > 1 and managed_fsx:
        raise fields["subnet_ids"].fail(
            "a new FSx file system needs single-subnet queues; use storage.fsx_lustre.file_system_id instead"
        )
    networking: dict[str, Any] = {"SubnetIds": subnets}
    if efa:
        # EFA traffic needs the instances close together: a cluster placement group.
        networking["PlacementGroup"] = {"Enabled": True}
    queue["Networking"] = networking
    if "on_node_configured" in fields:
        queue["CustomActions"] = _custom_action(fields["on_node_configured"])
    return queue


def _deployment_types() -> list[str]:
    field = FsxLustreSettingsSchema().fields["deployment_type"]
    return list(field.validate.choices)


def _check_new_fsx(
    node: _Node, capacity: int, deployment: str, throughput: int | None, kms_key_id: str | None
) -> None:
    """Apply ParallelCluster's own offline FSx rules (they need no AWS call), in its order."""
    persistent_options = {"deployment_type": deployment, "per_unit_storage_throughput": throughput}
    checks: list[tuple[str, Validator, dict[str, Any]]] = [
        (
            "per_unit_storage_throughput",
            FsxPersistentOptionsValidator(),
            persistent_options | {"kms_key_id": None},
        ),
        # The same validator again, now with the key: the throughput rules passed above, so any error
        # left is the KMS key's (ParallelCluster takes a key only on PERSISTENT_* file systems).
        ("kms_key_id", FsxPersistentOptionsValidator(), persistent_options | {"kms_key_id": kms_key_id}),
        (
            "per_unit_storage_throughput",
            FsxStorageTypeOptionsValidator(),
            {
                "fsx_storage_type": None,
                "deployment_type": deployment,
                "per_unit_storage_throughput": throughput,
                "drive_cache_type": None,
            },
        ),
        (
            "storage_capacity",
            FsxStorageCapacityValidator(),
            {
                "storage_capacity": capacity,
                "deployment_type": deployment,
                "fsx_storage_type": None,
                "per_unit_storage_throughput": throughput,
                "file_system_id": None,
                "backup_id": None,
            },
        ),
    ]
    for key, validator, kwargs in checks:
        problems = _errors(validator.execute(**kwargs))
        if problems:
            raise _Node(None, f"{node.path}.{key}").fail(" ".join(problems))


def _fsx_lustre(node: _Node) -> dict[str, Any]:
    fields = node.mapping(
        set(),
        {
            "name",
            "mount_dir",
            "file_system_id",
            "storage_capacity",
            "deployment_type",
            "per_unit_storage_throughput",
            "kms_key_id",
        },
    )
    name = fields["name"].str() if "name" in fields else FSX_DEFAULT_NAME
    mount_dir = (
        fields["mount_dir"].str(re.compile(r"^/\S+$"), "an absolute path")
        if "mount_dir" in fields
        else FSX_DEFAULT_MOUNT_DIR
    )
    settings: dict[str, Any] = {}
    new_fs_keys = {
        "storage_capacity",
        "deployment_type",
        "per_unit_storage_throughput",
        "kms_key_id",
    } & fields.keys()
    if "file_system_id" in fields:
        if new_fs_keys:
            raise fields["file_system_id"].fail(
                f"an existing file system takes no {', '.join(sorted(new_fs_keys))}; drop them or the id"
            )
        settings["FileSystemId"] = fields["file_system_id"].str(
            re.compile(r"^fs-[0-9a-f]{17}$"), "an FSx file system id (fs-<17 hex digits>)"
        )
    else:
        if "storage_capacity" not in fields or "deployment_type" not in fields:
            raise node.fail("give file_system_id (existing), or storage_capacity and deployment_type (new)")
        capacity = fields["storage_capacity"].int(minimum=1)
        types = _deployment_types()
        deployment = fields["deployment_type"].str(
            re.compile(f"^({'|'.join(types)})$"), f"one of {', '.join(types)}"
        )
        throughput = (
            fields["per_unit_storage_throughput"].int(minimum=1)
            if "per_unit_storage_throughput" in fields
            else None
        )
        # FSx for Lustre always encrypts at rest (with an AWS-managed key unless one is given), so no
        # setting can weaken it; a customer-managed key is the only choice left, and an optional one.
        kms_key_id = (
            fields["kms_key_id"].str(_KMS_KEY_RE, "a KMS key id or key ARN")
            if "kms_key_id" in fields
            else None
        )
        _check_new_fsx(node, capacity, deployment, throughput, kms_key_id)
        settings.update(StorageCapacity=capacity, DeploymentType=deployment)
        if throughput is not None:
            settings["PerUnitStorageThroughput"] = throughput
        if kms_key_id is not None:
            settings["KmsKeyId"] = kms_key_id
    return {"Name": name, "StorageType": "FsxLustre", "MountDir": mount_dir, "FsxLustreSettings": settings}


def _slurm_settings(node: _Node) -> dict[str, Any]:
    fields = node.mapping(set(), {"custom_settings"})
    settings: dict[str, Any] = {}
    if "custom_settings" in fields:
        entries = []
        for entry in fields["custom_settings"].items():
            if not isinstance(entry.value, dict) or not entry.value:
                raise entry.fail(
                    "must be a mapping of slurm.conf parameter to value, e.g. {PrivateData: cloud}"
                )
            entries.append(dict(entry.value))
        settings["CustomSlurmSettings"] = entries
    return settings


def generate(spec: dict[str, Any]) -> dict[str, Any]:
    """Build and validate a ParallelCluster 3 config; a malformed spec is a UserError naming the field."""
    fields = _Node(spec, "").mapping({"region", "ami", "head_node", "queues"}, {"slurm", "storage"})
    region = fields["region"].str()
    if region not in supported_regions():
        raise fields["region"].fail(f"{region!r} is not a region ParallelCluster supports")
    storage = fields["storage"].mapping(set(), {"fsx_lustre"}) if "storage" in fields else {}
    fsx = _fsx_lustre(storage["fsx_lustre"]) if "fsx_lustre" in storage else None
    managed_fsx = fsx is not None and "FileSystemId" not in fsx["FsxLustreSettings"]

    queues = [_queue(q, managed_fsx) for q in fields["queues"].items(max_len=MAX_NUMBER_OF_QUEUES)]
    names = [q["Name"] for q in queues]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise fields["queues"].fail(f"queue name(s) {', '.join(dupes)} repeat; give each a distinct name")

    scheduling: dict[str, Any] = {"Scheduler": "slurm"}
    if "slurm" in fields:
        slurm = _slurm_settings(fields["slurm"])
        if slurm:
            scheduling["SlurmSettings"] = slurm
    scheduling["SlurmQueues"] = queues

    config: dict[str, Any] = {
        "Region": region,
        "Image": {"Os": IMAGE_OS, "CustomAmi": fields["ami"].checked(check_ami_id)},
        "HeadNode": _head_node(fields["head_node"]),
        "Scheduling": scheduling,
    }
    if fsx is not None:
        config["SharedStorage"] = [fsx]
    # Last, so the first keys stay the ones a reader looks for (Region, Image, HeadNode, Scheduling).
    config["Imds"] = dict(IMDS)
    validate(config)
    return config
