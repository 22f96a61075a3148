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
from pcluster.validators.cluster_validators import ComputeResourceSizeValidator, NameValidator
from pcluster.validators.common import FailureLevel, ValidationResult, Validator
from pcluster.validators.ec2_validators import PlacementGroupCapacityTypeValidator
from pcluster.validators.fsx_validators import (
    FsxPersistentOptionsValidator,
    FsxStorageCapacityValidator,
    FsxStorageTypeOptionsValidator,
)

from gpuforge import instance_types
from gpuforge.amiid import check_ami_id
from gpuforge.errors import UserError
from gpuforge.pcluster.config import DEFAULT_QUEUE_UPDATE_STRATEGY
from gpuforge.pcluster.validate import AmiFacts, image_errors, supported_regions, validate

# Image.Os must be the OS of the image (its parallelcluster:os tag): ParallelCluster's
# AmiOsCompatibleValidator refuses anything else at create time (aws-parallelcluster 3.16.1,
# pcluster/validators/ec2_validators.py), so it comes from the spec's `os` or from the image itself
# (`generate --check-image`), never from a constant. The values ParallelCluster takes for gpuforge's bases.
IMAGE_OSES = ("ubuntu2204", "ubuntu2404")
FSX_DEFAULT_NAME = "fsx"
FSX_DEFAULT_MOUNT_DIR = "/fsx"

_SUBNET_RE = re.compile(ALLOWED_VALUES["subnet_id"])
_INSTANCE_TYPE_RE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9-]+$")
_CAPACITY_RESERVATION_RE = re.compile(r"^cr-[0-9a-f]{17}$")
_PLACEMENT_GROUP_RE = re.compile(r"^[\w.-]{1,255}$")
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

    def bool(self) -> bool:
        if not isinstance(self.value, bool):
            raise self.fail(f"must be true or false, got {self.value!r}")
        return self.value

    def checked(self, check: Callable[[Any], Any]) -> Any:
        """Run one of gpuforge's own checks (which raise UserError) and prefix its message with the path."""
        try:
            return check(self.value)
        except UserError as exc:
            raise self.fail(str(exc)) from None


def _errors(results: list[ValidationResult]) -> list[str]:
    return [r.message for r in results if r.level == FailureLevel.ERROR]


def _all_messages(results: list[ValidationResult]) -> list[str]:
    return [r.message for r in results]


def _name(node: _Node) -> str:
    """Queue and compute resource names follow ParallelCluster's NameValidator (lowercase, <= 25 chars)."""
    name = node.str()
    problems = _errors(NameValidator().execute(name))
    if problems:
        raise node.fail(" ".join(problems))
    return name


# Actions that may run gpuforge-node (scripts/pcluster/on_node_configured.sh): after the node is
# configured, or after a head node update; OnNodeStart runs before ParallelCluster's own setup.
_NODE_SIDE_ACTIONS = ("on_node_configured", "on_node_updated")
_REVISION_RE = re.compile(r"^[0-9a-f]{40}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def _node_side_args(node: _Node, part: list[str]) -> list[str]:
    """Args of the offline gpuforge-node action (docs/node-side.md): this node's part, which ParallelCluster
    tells apart by giving the head node and each queue their own CustomActions (custom-bootstrap-actions-v3),
    and, when set, the newer revision to fetch from S3 by exact commit and sha256."""
    if node.value is True:
        return list(part)
    fields = node.mapping({"revision", "sha256", "bucket"}, {"prefix"})
    args = [
        *part,
        "--revision",
        fields["revision"].str(_REVISION_RE, "an exact git commit (40 lowercase hex digits)"),
        "--sha256",
        fields["sha256"].str(_SHA256_RE, "a sha256 (64 lowercase hex digits)"),
        "--bucket",
        fields["bucket"].str(_BUCKET_RE, "an S3 bucket name"),
    ]
    if "prefix" in fields:
        args += ["--prefix", fields["prefix"].str(re.compile(r"^\S+/$"), "a key prefix ending with /")]
    return args


def _action(node: _Node, key: str = "", part: list[str] | None = None) -> dict[str, Any]:
    fields = node.mapping({"script"}, {"args", "gpuforge_node"})
    action: dict[str, Any] = {
        "Script": fields["script"].str(_SCRIPT_URL_RE, "an s3:// or https:// URL of a script")
    }
    args: list[str] = []
    if "gpuforge_node" in fields:
        if key not in _NODE_SIDE_ACTIONS or part is None:
            raise fields["gpuforge_node"].fail(
                "only on_node_configured and on_node_updated run gpuforge-node"
            )
        if fields["gpuforge_node"].value is not True and not isinstance(fields["gpuforge_node"].value, dict):
            raise fields["gpuforge_node"].fail("must be true or a mapping of revision, sha256, bucket")
        args += _node_side_args(fields["gpuforge_node"], part)
    if "args" in fields:
        extra = [arg.str() for arg in fields["args"].items(min_len=0)]
        # After gpuforge-node's own options, anything else goes to ansible-playbook.
        args += ["--", *extra] if args and extra else extra
    if args or "args" in fields:
        action["Args"] = args
    return action


# Spec key -> ParallelCluster's CustomActions key. OnNodeUpdated runs on the head node only.
_ACTIONS = {
    "on_node_start": "OnNodeStart",
    "on_node_configured": "OnNodeConfigured",
    "on_node_updated": "OnNodeUpdated",
}


def _custom_actions(
    fields: dict[str, _Node], allowed: tuple[str, ...], part: list[str] | None = None
) -> dict[str, Any]:
    """part: the node's gpuforge-node arguments (--node-type, --queue) for actions that run it."""
    return {_ACTIONS[key]: _action(fields[key], key, part) for key in allowed if key in fields}


def _script_buckets(actions: dict[str, Any]) -> list[str]:
    """Buckets of s3:// custom action scripts: the nodes running them need read access (Iam.S3Access)."""
    buckets = []
    for action in actions.values():
        script = str(action["Script"])
        if script.startswith("s3://"):
            buckets.append(script[len("s3://") :].split("/", 1)[0])
        # gpuforge-node's newer revision comes from this bucket (read with the node's role too).
        args = [str(a) for a in action.get("Args", [])]
        end = args.index("--") if "--" in args else len(args)
        buckets += [args[i + 1] for i in range(end - 1) if args[i] == "--bucket"]
    return sorted(set(buckets))


_SG_RE = re.compile(r"^sg-[0-9a-z]{8}$|^sg-[0-9a-z]{17}$")


def _security_groups(fields: dict[str, _Node], networking: dict[str, Any]) -> None:
    """security_groups replace ParallelCluster's own groups, additional_security_groups add to them."""
    for key, target in (
        ("security_groups", "SecurityGroups"),
        ("additional_security_groups", "AdditionalSecurityGroups"),
    ):
        if key in fields:
            networking[target] = [g.str(_SG_RE, "a security group id (sg-...)") for g in fields[key].items()]


def _root_volume(fields: dict[str, _Node]) -> dict[str, Any]:
    volume: dict[str, Any] = dict(ENCRYPTED_ROOT_VOLUME["RootVolume"])
    if "root_volume_size" in fields:
        # GiB; at least the image's root snapshot (ParallelCluster's RootVolumeSizeValidator): checked
        # here with `generate --check-image`, and by publish / set-ami before an image moves in.
        volume["Size"] = fields["root_volume_size"].int(minimum=35)
    return {"RootVolume": volume}


def _iam(s3_buckets: list[str], spec_iam: dict[str, Any]) -> dict[str, Any]:
    """Read access to the custom actions' buckets (ParallelCluster downloads the scripts with the node's
    role) plus the spec's own grants; a bucket the spec names keeps the spec's settings."""
    explicit = copy.deepcopy(spec_iam.get("S3Access", []))
    named = {a["BucketName"] for a in explicit}
    access = [{"BucketName": bucket} for bucket in s3_buckets if bucket not in named] + explicit
    iam: dict[str, Any] = {}
    if access:
        iam["S3Access"] = access
    if spec_iam.get("AdditionalIamPolicies"):
        iam["AdditionalIamPolicies"] = copy.deepcopy(spec_iam["AdditionalIamPolicies"])
    return iam


def _spec_iam(node: _Node) -> dict[str, Any]:
    fields = node.mapping(set(), {"s3_access", "additional_policies"})
    iam: dict[str, Any] = {}
    if "s3_access" in fields:
        access = []
        for entry in fields["s3_access"].items():
            e = entry.mapping({"bucket"}, {"key", "write"})
            item: dict[str, Any] = {
                "BucketName": e["bucket"].str(
                    re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"), "an S3 bucket name"
                )
            }
            if "key" in e:
                item["KeyName"] = e["key"].str()
            if "write" in e:
                item["EnableWriteAccess"] = e["write"].bool()
            access.append(item)
        iam["S3Access"] = access
    if "additional_policies" in fields:
        iam["AdditionalIamPolicies"] = [
            {
                "Policy": p.str(
                    re.compile(r"^arn:aws[a-z-]*:iam::(\d{12}|aws):policy/\S+$"), "an IAM policy ARN"
                )
            }
            for p in fields["additional_policies"].items()
        ]
    return iam


def _subnets(node: _Node) -> list[str]:
    subnets = [s.str(_SUBNET_RE, "a subnet id (subnet-<8 or 17 hex digits>)") for s in node.items()]
    if len(set(subnets)) != len(subnets):
        raise node.fail("lists a subnet more than once")
    return subnets


def _head_node(node: _Node, spec_iam: dict[str, Any]) -> dict[str, Any]:
    fields = node.mapping(
        {"instance_type", "subnet_id", "ssh_key"},
        {
            "root_volume_size",
            "security_groups",
            "additional_security_groups",
            "disable_simultaneous_multithreading",
            *_ACTIONS,
        },
    )
    networking: dict[str, Any] = {
        "SubnetId": fields["subnet_id"].str(_SUBNET_RE, "a subnet id (subnet-<8 or 17 hex digits>)")
    }
    _security_groups(fields, networking)
    head: dict[str, Any] = {
        "InstanceType": fields["instance_type"].str(_INSTANCE_TYPE_RE, "an EC2 instance type (family.size)"),
        "Networking": networking,
        "Ssh": {"KeyName": fields["ssh_key"].str()},
        "LocalStorage": _root_volume(fields),
    }
    if "disable_simultaneous_multithreading" in fields:
        head["DisableSimultaneousMultithreading"] = fields["disable_simultaneous_multithreading"].bool()
    actions = _custom_actions(fields, tuple(_ACTIONS), ["--node-type", "HeadNode"])
    if actions:
        head["CustomActions"] = actions
    iam = _iam(_script_buckets(actions), spec_iam)
    if iam:
        head["Iam"] = iam
    head["Imds"] = dict(HEAD_NODE_IMDS)
    return head


def _compute_resource(node: _Node, capacity_type: str | None) -> dict[str, Any]:
    fields = node.mapping(
        {"max_count"},
        {
            "instance_type",
            "instance_types",
            "name",
            "min_count",
            "disable_simultaneous_multithreading",
            "capacity_reservation_id",
            "spot_price",
        },
    )
    if ("instance_type" in fields) == ("instance_types" in fields):
        raise node.fail("give instance_type (one) or instance_types (several, same vCPUs and GPUs)")
    if "instance_type" in fields:
        fields["instance_type"].str()
        types = [fields["instance_type"].checked(instance_types.get)]
    else:
        types = [t.checked(instance_types.get) for t in fields["instance_types"].items()]
        if len({t.name for t in types}) != len(types):
            raise fields["instance_types"].fail("lists an instance type more than once")
    default_name = types[0].name.replace(".", "-")
    name = _name(fields["name"]) if "name" in fields else _name(_Node(default_name, node.path))
    max_count = fields["max_count"].int(minimum=1)
    min_count = fields["min_count"].int(minimum=0) if "min_count" in fields else 0
    if min_count > max_count:
        raise fields["min_count"].fail(f"{min_count} is greater than max_count {max_count}")
    problems = _errors(
        ComputeResourceSizeValidator().execute(
            min_count=min_count, max_count=max_count, capacity_type=CapacityType(capacity_type or "ONDEMAND")
        )
    )
    if problems:
        raise (fields.get("min_count") or fields["max_count"]).fail(" ".join(problems))
    resource: dict[str, Any] = {"Name": name}
    if len(types) == 1 and "instance_type" in fields:
        resource["InstanceType"] = types[0].name
    else:
        # Several types in one compute resource (EC2 Fleet picks among them; ParallelCluster requires the
        # same vCPU count and GPU count, checked at create time).
        resource["Instances"] = [{"InstanceType": t.name} for t in types]
    resource["MinCount"] = min_count
    resource["MaxCount"] = max_count
    if "disable_simultaneous_multithreading" in fields:
        resource["DisableSimultaneousMultithreading"] = fields["disable_simultaneous_multithreading"].bool()
    if "spot_price" in fields:
        if capacity_type != "SPOT":
            raise fields["spot_price"].fail("only a SPOT queue takes a spot_price")
        price = fields["spot_price"].value
        if isinstance(price, bool) or not isinstance(price, int | float) or price <= 0:
            raise fields["spot_price"].fail(f"must be a positive number (USD per hour), got {price!r}")
        resource["SpotPrice"] = float(price)
    if "capacity_reservation_id" in fields:
        resource["CapacityReservationTarget"] = {
            "CapacityReservationId": fields["capacity_reservation_id"].str(
                _CAPACITY_RESERVATION_RE, "a capacity reservation id (cr-<17 hex digits>)"
            )
        }
    elif capacity_type == "CAPACITY_BLOCK":
        raise node.fail(
            "a CAPACITY_BLOCK queue needs capacity_reservation_id (the Capacity Block's cr-...) on each "
            "compute resource"
        )
    if capacity_type == "CAPACITY_BLOCK" and len(types) > 1:
        raise fields["instance_types"].fail("a Capacity Block reserves one instance type")
    # EFA and GPU health checks only where every type has them (a fleet may get any of the types).
    if all(t.efa_interfaces > 0 for t in types):
        resource["Efa"] = {"Enabled": True}
    if all(t.gpus > 0 for t in types):
        resource["HealthChecks"] = {"Gpu": {"Enabled": True}}
    return resource


def _queue(node: _Node, managed_fsx: bool, spec_iam: dict[str, Any]) -> dict[str, Any]:
    fields = node.mapping(
        {"name", "subnet_ids", "compute_resources"},
        {
            "capacity_type",
            "capacity_reservation",
            "placement_group",
            "allocation_strategy",
            "requeue",
            "ami",
            "job_exclusive_allocation",
            "root_volume_size",
            "scratch_dir",
            "security_groups",
            "additional_security_groups",
            "on_node_start",
            "on_node_configured",
        },
    )
    name = _name(fields["name"])
    queue: dict[str, Any] = {"Name": name}
    capacity_type = None
    if "capacity_type" in fields:
        choices = [c.value for c in CapacityType]
        capacity_type = fields["capacity_type"].str(
            re.compile(f"^({'|'.join(choices)})$"), f"one of {', '.join(choices)}"
        )
        queue["CapacityType"] = capacity_type
    if "allocation_strategy" in fields:
        if capacity_type == "CAPACITY_BLOCK":
            raise fields["allocation_strategy"].fail("a CAPACITY_BLOCK queue takes no allocation strategy")
        queue["AllocationStrategy"] = fields["allocation_strategy"].str()
    if "requeue" in fields and capacity_type != "SPOT":
        raise fields["requeue"].fail("only a SPOT queue takes requeue (jobs on reclaimed Spot nodes)")
    if "ami" in fields:
        queue["Image"] = {"CustomAmi": fields["ami"].checked(check_ami_id)}
    if "job_exclusive_allocation" in fields:
        # Whole nodes per job: a training job never shares GPUs, EFA or NVMe with another.
        queue["JobExclusiveAllocation"] = fields["job_exclusive_allocation"].bool()
    local_storage: dict[str, Any] = _root_volume(fields)
    if "scratch_dir" in fields:
        # ParallelCluster stripes the instance-store NVMe drives (p4d: 8 x 1 TB, p5: 8 x 3.84 TB) as RAID 0
        # and mounts them here on each boot: fast scratch that is lost when the node stops.
        local_storage["EphemeralVolume"] = {
            "MountDir": fields["scratch_dir"].str(re.compile(r"^/\S+$"), "an absolute path")
        }
    queue["ComputeSettings"] = {"LocalStorage": local_storage}
    resources = [
        _compute_resource(cr, capacity_type)
        for cr in fields["compute_resources"].items(max_len=MAX_COMPUTE_RESOURCES_PER_QUEUE)
    ]
    names = [r["Name"] for r in resources]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise fields["compute_resources"].fail(
            f"compute resource name(s) {', '.join(dupes)} repeat; give each a distinct name"
        )
    queue["ComputeResources"] = resources
    if "capacity_reservation" in fields:
        target = fields["capacity_reservation"].mapping(set(), {"id", "resource_group_arn"})
        if len(target) != 1:
            raise fields["capacity_reservation"].fail("give exactly one of id, resource_group_arn")
        if "id" in target:
            queue["CapacityReservationTarget"] = {
                "CapacityReservationId": target["id"].str(
                    _CAPACITY_RESERVATION_RE, "a capacity reservation id"
                )
            }
        else:
            queue["CapacityReservationTarget"] = {
                "CapacityReservationResourceGroupArn": target["resource_group_arn"].str(
                    re.compile(r"^arn:aws[a-z-]*:resource-groups:[a-z0-9-]+:\d{12}:group/\S+$"),
                    "a resource group ARN",
                )
            }
    reserved = "CapacityReservationTarget" in queue or any(
        "CapacityReservationTarget" in r for r in resources
    )
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
    _security_groups(fields, networking)
    if "placement_group" in fields:
        # An ODCR made in a cluster placement group must be launched into that very group
        # (ParallelCluster's PlacementGroupCapacityReservationValidator).
        networking["PlacementGroup"] = {
            "Enabled": True,
            "Name": fields["placement_group"].str(_PLACEMENT_GROUP_RE, "a placement group name"),
        }
    elif capacity_type == "CAPACITY_BLOCK" or (efa and reserved):
        # A Capacity Block (and a reservation) already places its instances; a placement group of
        # ParallelCluster's on top makes launches fail with insufficient capacity.
        networking["PlacementGroup"] = {"Enabled": False}
    elif efa:
        # EFA traffic needs the instances close together: a cluster placement group.
        networking["PlacementGroup"] = {"Enabled": True}
    # ParallelCluster only warns here; gpuforge refuses, since such launches fail with insufficient capacity.
    problems = _all_messages(
        PlacementGroupCapacityTypeValidator().execute(
            capacity_type=CapacityType(capacity_type or "ONDEMAND"),
            placement_group_enabled=bool(networking.get("PlacementGroup", {}).get("Enabled")),
        )
    )
    if problems:
        raise (fields.get("placement_group") or node).fail(" ".join(problems))
    queue["Networking"] = networking
    actions = _custom_actions(
        fields, ("on_node_start", "on_node_configured"), ["--node-type", "Compute", "--queue", name]
    )
    if actions:
        queue["CustomActions"] = actions
    iam = _iam(_script_buckets(actions), spec_iam)
    if iam:
        queue["Iam"] = iam
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
            "deletion_policy",
            "data_repository_associations",
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
    if "deletion_policy" in fields:
        if "FileSystemId" in settings:
            raise fields["deletion_policy"].fail("an existing file system is never deleted with the cluster")
        # Retain keeps the data when the cluster is deleted; ParallelCluster's default deletes it.
        settings["DeletionPolicy"] = fields["deletion_policy"].str(_DELETION_POLICY_RE, "Delete or Retain")
    if "data_repository_associations" in fields:
        if settings.get("DeploymentType") != "PERSISTENT_2":
            raise fields["data_repository_associations"].fail(
                "data repository associations need a new PERSISTENT_2 file system"
            )
        settings["DataRepositoryAssociations"] = [
            _data_repository_association(dra)
            for dra in fields["data_repository_associations"].items(max_len=8)
        ]
    return {"Name": name, "StorageType": "FsxLustre", "MountDir": mount_dir, "FsxLustreSettings": settings}


_DELETION_POLICY_RE = re.compile(r"^(Delete|Retain)$")
_EVENTS_RE = re.compile(r"^(NEW|CHANGED|DELETED)$")


def _data_repository_association(node: _Node) -> dict[str, Any]:
    """An S3 prefix linked to a directory of the file system: lazy-loaded on first read, optionally
    kept in sync both ways (datasets in, checkpoints out)."""
    fields = node.mapping(
        {"name", "s3_path", "file_system_path"}, {"import_metadata", "auto_import", "auto_export"}
    )
    dra: dict[str, Any] = {
        "Name": fields["name"].str(),
        "DataRepositoryPath": fields["s3_path"].str(
            re.compile(r"^s3://[a-z0-9][a-z0-9.-]+[a-z0-9](/\S*)?$"), "an s3:// path"
        ),
        "FileSystemPath": fields["file_system_path"].str(re.compile(r"^/\S*$"), "an absolute path"),
    }
    if "import_metadata" in fields:
        dra["BatchImportMetaDataOnCreate"] = fields["import_metadata"].bool()
    for key, target in (("auto_import", "AutoImportPolicy"), ("auto_export", "AutoExportPolicy")):
        if key in fields:
            dra[target] = [e.str(_EVENTS_RE, "NEW, CHANGED or DELETED") for e in fields[key].items()]
    return dra


def _home(node: _Node) -> dict[str, Any]:
    """Shared /home on EFS (elastic, multi-AZ) or one EBS volume exported by the head node."""
    fields = node.mapping({"type"}, {"size", "deletion_policy", "file_system_id", "volume_id"})
    kind = fields["type"].str(re.compile(r"^(efs|ebs)$"), "efs or ebs")
    storage: dict[str, Any] = {"MountDir": "/home", "Name": "home"}
    settings: dict[str, Any] = {}
    if kind == "efs":
        storage["StorageType"] = "Efs"
        if "size" in fields or "volume_id" in fields:
            raise node.fail("an EFS home takes no size or volume_id")
        if "file_system_id" in fields:
            settings["FileSystemId"] = fields["file_system_id"].str(
                re.compile(r"^fs-[0-9a-f]{8,40}$"), "an EFS id"
            )
        else:
            settings["Encrypted"] = True
    else:
        storage["StorageType"] = "Ebs"
        if "file_system_id" in fields:
            raise node.fail("an EBS home takes volume_id, not file_system_id")
        if "volume_id" in fields:
            settings["VolumeId"] = fields["volume_id"].str(
                re.compile(r"^vol-[0-9a-f]{8,17}$"), "an EBS volume id"
            )
        else:
            settings["Size"] = fields["size"].int(minimum=1) if "size" in fields else 100
            settings["Encrypted"] = True
    if "deletion_policy" in fields:
        settings["DeletionPolicy"] = fields["deletion_policy"].str(
            re.compile(r"^(Delete|Retain|Snapshot)$"), "Delete, Retain or Snapshot"
        )
    storage["EfsSettings" if kind == "efs" else "EbsSettings"] = settings
    return storage


def _slurm_settings(node: _Node) -> dict[str, Any]:
    fields = node.mapping(
        set(), {"custom_settings", "scaledown_idletime", "queue_update_strategy", "database"}
    )
    settings: dict[str, Any] = {}
    if "scaledown_idletime" in fields:
        # Minutes an idle dynamic node waits before ParallelCluster terminates it.
        settings["ScaledownIdletime"] = fields["scaledown_idletime"].int(minimum=1)
    # Stated always, DRAIN unless the spec says otherwise: ParallelCluster's own default
    # (COMPUTE_FLEET_STOP) makes `pcluster update-cluster` refuse a new queue image while jobs run.
    settings["QueueUpdateStrategy"] = DEFAULT_QUEUE_UPDATE_STRATEGY
    if "queue_update_strategy" in fields:
        settings["QueueUpdateStrategy"] = fields["queue_update_strategy"].str(
            re.compile(r"^(COMPUTE_FLEET_STOP|DRAIN|TERMINATE)$"), "COMPUTE_FLEET_STOP, DRAIN or TERMINATE"
        )
    if "database" in fields:
        # Slurm accounting (slurmdbd) in an external MySQL-compatible database; the password stays in
        # Secrets Manager and only its ARN is in the config.
        db = fields["database"].mapping({"uri", "user_name", "password_secret_arn"}, {"database_name"})
        database: dict[str, Any] = {
            "Uri": db["uri"].str(re.compile(r"^[\w.-]+(:\d{1,5})?$"), "host or host:port"),
            "UserName": db["user_name"].str(),
            "PasswordSecretArn": db["password_secret_arn"].str(
                re.compile(r"^arn:aws[a-z-]*:secretsmanager:[a-z0-9-]+:\d{12}:secret:\S+$"),
                "a Secrets Manager ARN",
            ),
        }
        if "database_name" in db:
            database["DatabaseName"] = db["database_name"].str()
        settings["Database"] = database
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


def _login_pool(node: _Node) -> dict[str, Any]:
    """Login nodes: users' shells and job submission off the head node (slurmctld stays undisturbed)."""
    # No Ssh.KeyName: ParallelCluster 3.15+ refuses it on login nodes (users log in with the head node's key).
    fields = node.mapping({"instance_type", "subnet_ids"}, {"name", "count"})
    return {
        "Name": _name(fields["name"]) if "name" in fields else "login",
        "InstanceType": fields["instance_type"].str(_INSTANCE_TYPE_RE, "an EC2 instance type (family.size)"),
        "Count": fields["count"].int(minimum=1) if "count" in fields else 1,
        "Networking": {"SubnetIds": _subnets(fields["subnet_ids"])},
    }


def _monitoring(node: _Node) -> dict[str, Any]:
    fields = node.mapping(set(), {"detailed_monitoring", "dashboards", "logs", "log_retention_days"})
    monitoring: dict[str, Any] = {}
    if "detailed_monitoring" in fields:
        monitoring["DetailedMonitoring"] = fields["detailed_monitoring"].bool()
    if "logs" in fields or "log_retention_days" in fields:
        logs: dict[str, Any] = {"Enabled": fields["logs"].bool() if "logs" in fields else True}
        if "log_retention_days" in fields:
            logs["RetentionInDays"] = fields["log_retention_days"].int(minimum=1)
        monitoring["Logs"] = {"CloudWatch": logs}
    if "dashboards" in fields:
        monitoring["Dashboards"] = {"CloudWatch": {"Enabled": fields["dashboards"].bool()}}
    return monitoring


def _image_os(fields: dict[str, _Node], image: AmiFacts | None) -> str:
    """Image.Os: the spec's `os`, which must match the image's tag when the image was read."""
    tagged = image.os if image is not None else None
    if "os" not in fields:
        if tagged is None:
            raise UserError(
                f"cluster spec: os: missing: give {' or '.join(IMAGE_OSES)} (the image's parallelcluster:os "
                "tag), or let `cluster-config generate --check-image` read it from the image"
            )
        if tagged not in IMAGE_OSES:
            raise fields["ami"].fail(f"the image's OS {tagged!r} is none of {', '.join(IMAGE_OSES)}")
        return tagged
    os = fields["os"].str(re.compile(f"^({'|'.join(IMAGE_OSES)})$"), f"one of {', '.join(IMAGE_OSES)}")
    if tagged is not None and tagged != os:
        raise fields["os"].fail(f"{os} is not the image's OS: its parallelcluster:os tag says {tagged}")
    return os


def generate(spec: dict[str, Any], image: AmiFacts | None = None) -> dict[str, Any]:
    """Build and validate a ParallelCluster 3 config; a malformed spec is a UserError naming the field.

    image: what the spec's AMI is (its OS tag and root snapshot size), when the caller read it; the
    config is then checked against it as ParallelCluster will check it at create time."""
    fields = _Node(spec, "").mapping(
        {"region", "ami", "head_node", "queues"},
        {"os", "slurm", "storage", "iam", "tags", "monitoring", "login_nodes"},
    )
    region = fields["region"].str()
    if region not in supported_regions():
        raise fields["region"].fail(f"{region!r} is not a region ParallelCluster supports")
    storage = fields["storage"].mapping(set(), {"fsx_lustre", "home"}) if "storage" in fields else {}
    fsx = _fsx_lustre(storage["fsx_lustre"]) if "fsx_lustre" in storage else None
    managed_fsx = fsx is not None and "FileSystemId" not in fsx["FsxLustreSettings"]
    spec_iam = _spec_iam(fields["iam"]) if "iam" in fields else {}

    queues = [_queue(q, managed_fsx, spec_iam) for q in fields["queues"].items(max_len=MAX_NUMBER_OF_QUEUES)]
    names = [q["Name"] for q in queues]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise fields["queues"].fail(f"queue name(s) {', '.join(dupes)} repeat; give each a distinct name")

    scheduling: dict[str, Any] = {"Scheduler": "slurm"}
    slurm = _slurm_settings(fields["slurm"] if "slurm" in fields else _Node({}, "slurm"))
    requeue = [q for q in fields["queues"].items(max_len=MAX_NUMBER_OF_QUEUES) if q.value.get("requeue")]
    if requeue:
        # A job on a reclaimed Spot node goes back to the queue and restarts from its last checkpoint,
        # instead of failing (slurm.conf JobRequeue; jobs opt out with --no-requeue).
        custom = slurm.setdefault("CustomSlurmSettings", [])
        if not any("JobRequeue" in entry for entry in custom):
            custom.append({"JobRequeue": 1})
    scheduling["SlurmSettings"] = slurm
    scheduling["SlurmQueues"] = queues

    ami = fields["ami"].checked(check_ami_id)
    config: dict[str, Any] = {
        "Region": region,
        "Image": {"Os": _image_os(fields, image), "CustomAmi": ami},
        "HeadNode": _head_node(fields["head_node"], spec_iam),
        "Scheduling": scheduling,
    }
    if "login_nodes" in fields:
        config["LoginNodes"] = {"Pools": [_login_pool(fields["login_nodes"])]}
    shared = ([_home(storage["home"])] if "home" in storage else []) + ([fsx] if fsx is not None else [])
    if shared:
        config["SharedStorage"] = shared
    if "monitoring" in fields:
        config["Monitoring"] = _monitoring(fields["monitoring"])
    if "tags" in fields:
        tags = fields["tags"].mapping(set(), frozenset(str(k) for k in fields["tags"].value or {}))
        config["Tags"] = [{"Key": key, "Value": str(value.value)} for key, value in tags.items()]
    # Last, so the first keys stay the ones a reader looks for (Region, Image, HeadNode, Scheduling).
    config["Imds"] = dict(IMDS)
    validate(config)
    problems = image_errors(config, {ami: image}) if image is not None else []
    if problems:
        raise UserError("cluster spec: the image does not suit the cluster:\n  " + "\n  ".join(problems))
    return config
