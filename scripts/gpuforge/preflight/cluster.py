"""Find a ParallelCluster cluster's EC2 instances by the tags ParallelCluster puts on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CLUSTER_TAG = "parallelcluster:cluster-name"
NODE_TYPE_TAG = "parallelcluster:node-type"
QUEUE_TAG = "parallelcluster:queue-name"
# Node types that carry no GPU/EFA workload; everything else (Compute, or untagged) is a compute node.
_SERVICE_NODE_TYPES = {"HeadNode", "LoginNode"}
# Instances that hold or will hold capacity; stopped/terminated ones are not part of the running fleet.
LIVE_STATES = ("pending", "running")


@dataclass(frozen=True)
class Instance:
    """The fields of an EC2 DescribeInstances entry that preflight uses."""

    instance_id: str
    instance_type: str
    availability_zone: str
    placement_group: str | None
    node_type: str | None
    queue: str | None
    efa_interfaces: int
    security_group_ids: tuple[str, ...]

    @property
    def is_compute(self) -> bool:
        return self.node_type not in _SERVICE_NODE_TYPES

    @classmethod
    def from_api(cls, raw: dict[str, Any]) -> Instance:
        tags = {t["Key"]: t["Value"] for t in raw.get("Tags", [])}
        placement = raw.get("Placement", {})
        nics = raw.get("NetworkInterfaces", [])
        groups: set[str] = {g["GroupId"] for g in raw.get("SecurityGroups", [])}
        for nic in nics:
            groups.update(g["GroupId"] for g in nic.get("Groups", []))
        return cls(
            instance_id=raw["InstanceId"],
            instance_type=raw["InstanceType"],
            availability_zone=placement.get("AvailabilityZone", ""),
            placement_group=placement.get("GroupName") or None,
            node_type=tags.get(NODE_TYPE_TAG),
            queue=tags.get(QUEUE_TAG),
            # "efa-only" interfaces (p5 and later) carry EFA traffic just as "efa" ones do.
            efa_interfaces=sum(1 for n in nics if n.get("InterfaceType") in ("efa", "efa-only")),
            security_group_ids=tuple(sorted(groups)),
        )


def instances(ec2: Any, cluster_name: str) -> list[Instance]:
    """Live instances tagged with the cluster's name (every node type), sorted by id."""
    paginator = ec2.get_paginator("describe_instances")
    pages = paginator.paginate(
        Filters=[
            {"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster_name]},
            {"Name": "instance-state-name", "Values": list(LIVE_STATES)},
        ]
    )
    found = [Instance.from_api(i) for page in pages for r in page["Reservations"] for i in r["Instances"]]
    return sorted(found, key=lambda i: i.instance_id)
