"""Register lab hosts as EC2 instances in moto, tagged exactly as ParallelCluster tags its nodes.

Each instance's primary private IP is the lab host's IP, so the real amazon.aws.aws_ec2
inventory (compose: ansible_host: private_ip_address) lands on the real lab host.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

import yaml

from gpuforge import aws, instance_types, paths
from gpuforge_lab import rootfs
from gpuforge_lab.state import HostState, LabState

PCLUSTER_VERSION = "3.16.1"  # The aws-parallelcluster release pinned in requirements/constraints.txt.
AZ_SUFFIX = "a"


def placement_group_name(lab: LabState) -> str:
    return f"{lab.cluster_name}-pg"


def _network_interfaces(host: HostState, subnet: str, group: str) -> list[dict[str, Any]]:
    efa = instance_types.get(host.instance_type).efa_interfaces
    primary: dict[str, Any] = {
        "DeviceIndex": 0,
        "NetworkCardIndex": 0,
        "SubnetId": subnet,
        "Groups": [group],
        "PrivateIpAddress": host.ip,
        "InterfaceType": "efa" if efa else "interface",
    }
    # EC2 gives every further network card of an EFA type one EFA interface at device index 0.
    extra = [
        {
            "DeviceIndex": 0,
            "NetworkCardIndex": card,
            "SubnetId": subnet,
            "Groups": [group],
            "InterfaceType": "efa",
        }
        for card in range(1, efa)
    ]
    return [primary, *extra]


def _tags(lab: LabState, host: HostState) -> list[dict[str, str]]:
    tags = {
        "Name": host.name,
        "parallelcluster:cluster-name": lab.cluster_name,
        "parallelcluster:node-type": host.role,
        "parallelcluster:version": PCLUSTER_VERSION,
        "gpuforge:lab": lab.name,
    }
    if host.queue:
        tags["parallelcluster:queue-name"] = host.queue
    if host.compute_resource:
        tags["parallelcluster:compute-resource-name"] = host.compute_resource
    return [{"Key": k, "Value": v} for k, v in tags.items()]


def register(lab: LabState) -> None:
    """Create the VPC, subnet, EFA security group, placement group and one instance per host."""
    ec2 = aws.client("ec2")
    region = aws.region()
    vpc = ec2.create_vpc(CidrBlock="10.213.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(
        VpcId=vpc, CidrBlock=f"{lab.subnet_prefix}.0/24", AvailabilityZone=region + AZ_SUFFIX
    )["Subnet"]["SubnetId"]
    group = ec2.create_security_group(
        GroupName=f"{lab.cluster_name}-efa", Description="EFA: all traffic to and from itself", VpcId=vpc
    )["GroupId"]
    self_rule = [{"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group}]}]
    ec2.authorize_security_group_ingress(GroupId=group, IpPermissions=self_rule)
    ec2.authorize_security_group_egress(GroupId=group, IpPermissions=self_rule)
    ec2.create_placement_group(GroupName=placement_group_name(lab), Strategy="cluster")
    # The lab's own base image stands for the cached rootfs the hosts boot from (and is much
    # faster than listing moto's ~1,300 built-in AMIs).
    image = ec2.register_image(
        Name=f"gpuforge-lab-{rootfs.SUITE}-{rootfs.recipe_key()}",
        Description="gpuforge lab host root filesystem (Debian)",
        Architecture="x86_64",
        RootDeviceName="/dev/xvda",
        VirtualizationType="hvm",
        EnaSupport=True,
        BlockDeviceMappings=[{"DeviceName": "/dev/xvda", "Ebs": {"VolumeSize": 8, "VolumeType": "gp3"}}],
    )["ImageId"]
    for host in lab.hosts:
        placement: dict[str, str] = {"AvailabilityZone": region + AZ_SUFFIX}
        if host.role == "Compute":
            placement["GroupName"] = placement_group_name(lab)
        reservation = ec2.run_instances(
            ImageId=image,
            InstanceType=host.instance_type,
            MinCount=1,
            MaxCount=1,
            Placement=placement,
            NetworkInterfaces=_network_interfaces(host, subnet, group),
            MetadataOptions={"HttpTokens": "required", "HttpEndpoint": "enabled"},
            TagSpecifications=[{"ResourceType": "instance", "Tags": _tags(lab, host)}],
        )
        host.instance_id = reservation["Instances"][0]["InstanceId"]
    ec2.get_waiter("instance_running").wait(InstanceIds=[h.instance_id for h in lab.hosts if h.instance_id])


def munge_key_parameter(cluster_name: str) -> str:
    """The SSM parameter the slurm role reads the munge key from (its default, rendered)."""
    defaults = yaml.safe_load((paths.repo_root() / "roles/slurm/defaults/main.yml").read_text())
    template = str(defaults["slurm_munge_key_ssm_parameter"])
    return template.replace("{{ slurm_cluster_name }}", cluster_name)


def store_munge_key(lab: LabState) -> str:
    """Give the lab cluster a fresh munge key as an SSM SecureString, as production keeps it."""
    name = munge_key_parameter(lab.cluster_name)
    key = base64.b64encode(secrets.token_bytes(96)).decode()
    aws.client("ssm").put_parameter(Name=name, Type="SecureString", Value=key, Overwrite=True)
    return name
