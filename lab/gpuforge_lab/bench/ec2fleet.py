"""A ParallelCluster-shaped EC2 fleet in moto (the test double) for the inventory bench and tests.

Hosts look like real GPU nodes where the inventory's cost lies: a p5.48xlarge describes itself
with 32 network interfaces (its EFA cards), a p4d.24xlarge with 4, head nodes with 1. Compute
nodes are tagged as ParallelCluster tags them (cluster, node type, queue, compute resource) and
spread over several subnets (one VPC each, so 5,000 p5 hosts' 160,000 interfaces find addresses).
Instances are created with RunInstances MaxCount batches: one call per batch, not per host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

# Interfaces per instance type: p5.48xlarge has 32 network cards (one EFA each), p4d.24xlarge 4.
# Source: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html
INTERFACES = {"p5.48xlarge": 32, "p4d.24xlarge": 4}
HEAD_TYPE = "c5.2xlarge"


@dataclass(frozen=True)
class Queue:
    """Compute nodes of one ParallelCluster queue (one compute resource)."""

    cluster: str
    name: str
    compute_resource: str
    instance_type: str
    count: int


def shape(total: int) -> list[Queue]:
    """`total` hosts in two clusters: mostly p5 (32 interfaces), some p4d (4), one head node each."""
    compute = max(total - 2, 0)
    p4d = compute // 5
    p5 = compute - p4d
    train_p5 = (p5 + 1) // 2
    return [
        Queue("train", "gpu", "p5-48xlarge", "p5.48xlarge", train_p5),
        Queue("train", "gpu-small", "p4d-24xlarge", "p4d.24xlarge", p4d),
        Queue("infer", "gpu", "p5-48xlarge", "p5.48xlarge", p5 - train_p5),
    ]


def _subnets(ec2: Any, count: int) -> list[str]:
    zones = [z["ZoneName"] for z in ec2.describe_availability_zones()["AvailabilityZones"]]
    subnets = []
    for i in range(count):
        vpc = ec2.create_vpc(CidrBlock=f"10.{i}.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(
            VpcId=vpc, CidrBlock=f"10.{i}.0.0/16", AvailabilityZone=zones[i % len(zones)]
        )
        subnets.append(subnet["Subnet"]["SubnetId"])
    return subnets


def _tags(queue: Queue | None, cluster: str, lab: bool) -> list[dict[str, Any]]:
    tags = [{"Key": "parallelcluster:cluster-name", "Value": cluster}]
    if queue is None:
        tags += [
            {"Key": "parallelcluster:node-type", "Value": "HeadNode"},
            {"Key": "Name", "Value": "HeadNode"},
        ]
    else:
        tags += [
            {"Key": "parallelcluster:node-type", "Value": "Compute"},
            {"Key": "parallelcluster:queue-name", "Value": queue.name},
            {"Key": "parallelcluster:compute-resource-name", "Value": queue.compute_resource},
            {"Key": "Name", "Value": "Compute"},
        ]
    if lab:
        tags.append({"Key": "gpuforge:lab", "Value": "bench"})
    return tags


def build(ec2: Any, queues: list[Queue], *, subnets: int = 6, batch: int = 250, lab: bool = False) -> float:
    """Create the head nodes and the queues' compute nodes; return the seconds it took.

    Also creates one running instance without ParallelCluster tags and one stopped compute node,
    which an inventory of running fleets must leave out.
    """
    start = time.perf_counter()
    image = ec2.describe_images(Owners=["amazon"], MaxResults=5)["Images"][0]["ImageId"]
    nets = _subnets(ec2, subnets)
    turn = 0

    def run(instance_type: str, count: int, tags: list[dict[str, Any]]) -> list[str]:
        nonlocal turn
        made: list[str] = []
        while len(made) < count:
            n = min(batch, count - len(made))
            subnet = nets[turn % len(nets)]
            turn += 1
            interfaces = [
                {"DeviceIndex": i, "SubnetId": subnet, **({"InterfaceType": "efa"} if i else {})}
                for i in range(INTERFACES.get(instance_type, 1))
            ]
            answer = ec2.run_instances(
                ImageId=image,
                InstanceType=instance_type,
                MinCount=n,
                MaxCount=n,
                NetworkInterfaces=interfaces,
                TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
            )
            made += [i["InstanceId"] for i in answer["Instances"]]
        return made

    for cluster in sorted({q.cluster for q in queues}):
        run(HEAD_TYPE, 1, _tags(None, cluster, lab))
    for queue in queues:
        if queue.count:
            run(queue.instance_type, queue.count, _tags(queue, queue.cluster, lab))
    run(HEAD_TYPE, 1, [{"Key": "Name", "Value": "not-a-cluster-node"}])
    stopped = run("p5.48xlarge", 1, _tags(queues[0], queues[0].cluster, lab))
    ec2.stop_instances(InstanceIds=stopped)
    return time.perf_counter() - start
