"""`gpuforge preflight` against moto_server, the test double for AWS (see tests/conftest.py).

moto runs with gpuforge's extensions (gpuforge_lab.moto_ext) for placement groups and
per-network-card EFA interfaces. Every check is driven into PASS and into FAIL by building a
cluster that is right, then one that is wrong in exactly one way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import boto3
import pytest

import clitools
from gpuforge import cli as gpuforge_cli
from gpuforge import instance_types
from gpuforge.commands import preflight as preflight_cli
from gpuforge.errors import UserError
from gpuforge.preflight import runner
from gpuforge.preflight.cluster import CLUSTER_TAG, NODE_TYPE_TAG, QUEUE_TAG
from gpuforge.preflight.result import CheckResult, Status, render_table
from gpuforge_lab.moto import MotoServer

CLUSTER = "train"
GPU_TYPE = "p5.48xlarge"


@dataclass
class Lab:
    """One VPC with two subnets (two AZs), an EFA security group and a cluster placement group."""

    ec2: Any
    ami: str
    subnets: dict[str, str]
    efa_sg: str
    placement_group: str = "train-pg"
    instance_ids: list[str] = field(default_factory=list)

    def security_group(self, ingress: bool, egress: bool, name: str) -> str:
        vpc = self.ec2.describe_subnets(SubnetIds=[self.subnets["us-east-1a"]])["Subnets"][0]["VpcId"]
        sg: str = self.ec2.create_security_group(GroupName=name, Description=name, VpcId=vpc)["GroupId"]
        self_all = [{"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": sg}]}]
        if ingress:
            self.ec2.authorize_security_group_ingress(GroupId=sg, IpPermissions=self_all)
        if egress:
            self.ec2.authorize_security_group_egress(GroupId=sg, IpPermissions=self_all)
        return sg

    def launch(
        self,
        count: int = 1,
        instance_type: str = GPU_TYPE,
        az: str = "us-east-1a",
        efa: int | None = None,
        group: str | None = "default",
        sg: str | None = None,
        node_type: str = "Compute",
        queue: str | None = None,
    ) -> list[str]:
        """Launch count nodes; efa defaults to the type's EFA count from data/instance_types.yml."""
        efa_count = instance_types.get(instance_type).efa_interfaces if efa is None else efa
        cards = max(efa_count, 1)
        nics = [
            {
                "DeviceIndex": 0 if card == 0 else 1,
                "NetworkCardIndex": card,
                "SubnetId": self.subnets[az],
                "InterfaceType": "efa" if card < efa_count else "interface",
                "Groups": [sg or self.efa_sg],
            }
            for card in range(cards)
        ]
        placement: dict[str, str] = {"AvailabilityZone": az}
        if group is not None:
            placement["GroupName"] = self.placement_group if group == "default" else group
        tags = [{"Key": CLUSTER_TAG, "Value": CLUSTER}, {"Key": NODE_TYPE_TAG, "Value": node_type}]
        if queue is not None:
            tags.append({"Key": QUEUE_TAG, "Value": queue})
        reservation = self.ec2.run_instances(
            ImageId=self.ami,
            MinCount=count,
            MaxCount=count,
            InstanceType=instance_type,
            Placement=placement,
            NetworkInterfaces=nics,
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
        )
        ids = [i["InstanceId"] for i in reservation["Instances"]]
        self.instance_ids.extend(ids)
        return ids


_AMI: list[str] = []


def moto_ami(ec2: Any) -> str:
    """One of moto's built-in AMIs; they survive resets, and listing them takes seconds, so once."""
    if not _AMI:
        _AMI.append(ec2.describe_images(Owners=["amazon"], MaxResults=5)["Images"][0]["ImageId"])
    return _AMI[0]


@pytest.fixture
def lab(aws: MotoServer) -> Lab:
    ec2 = boto3.client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnets = {
        az: ec2.create_subnet(VpcId=vpc, CidrBlock=cidr, AvailabilityZone=az)["Subnet"]["SubnetId"]
        for az, cidr in (("us-east-1a", "10.0.1.0/24"), ("us-east-1b", "10.0.2.0/24"))
    }
    ami = moto_ami(ec2)
    built = Lab(ec2=ec2, ami=ami, subnets=subnets, efa_sg="")
    built.efa_sg = built.security_group(ingress=True, egress=True, name="efa")
    ec2.create_placement_group(GroupName=built.placement_group, Strategy="cluster")
    return built


def run(
    placement_group: str | None = None, spare_nodes: int = 1, quotas: Any = None, queue: str | None = None
) -> dict[str, CheckResult]:
    results = runner.run(
        boto3.client("ec2"),
        quotas or boto3.client("service-quotas"),
        CLUSTER,
        placement_group=placement_group,
        spare_nodes=spare_nodes,
        queue=queue,
    )
    return {r.name: r for r in results}


def statuses(results: dict[str, CheckResult]) -> dict[str, Status]:
    return {name: r.status for name, r in results.items()}


def test_healthy_cluster_passes_every_check_and_skips_quotas_moto_lacks(lab: Lab) -> None:
    lab.launch(count=2)
    lab.launch(instance_type="c5n.large", efa=0, group=None, node_type="HeadNode")
    results = run()
    assert statuses(results) == {
        "cluster-instances": Status.PASS,
        "placement-group": Status.PASS,
        "placement-group-capacity": Status.PASS,
        "single-az": Status.PASS,
        "efa-interfaces": Status.PASS,
        "efa-security-group": Status.PASS,
        # moto's Service Quotas knows only the vpc service: the check must say so, not pass.
        "quota-L-417A185B": Status.SKIP,
    }
    assert "3 instances, 2 compute nodes" in results["cluster-instances"].detail
    assert "NoSuchResourceException" in results["quota-L-417A185B"].detail


def test_no_tagged_instances_fails(lab: Lab) -> None:
    results = run()
    assert statuses(results) == {"cluster-instances": Status.FAIL}
    assert f"{CLUSTER_TAG}={CLUSTER}" in results["cluster-instances"].detail


def test_missing_placement_group_fails(lab: Lab) -> None:
    lab.launch(count=2, group=None)
    results = run(placement_group="no-such-pg")
    assert results["placement-group"].status is Status.FAIL
    assert "'no-such-pg' does not exist" in results["placement-group"].detail
    assert results["placement-group-capacity"].status is Status.SKIP


def test_nodes_in_no_group_and_none_named_fails(lab: Lab) -> None:
    lab.launch(count=2, group=None)
    results = run()
    assert results["placement-group"].status is Status.FAIL
    assert "--placement-group" in results["placement-group"].detail


def test_spread_placement_group_fails(lab: Lab) -> None:
    lab.ec2.create_placement_group(GroupName="spread-pg", Strategy="spread")
    lab.launch(count=2, group="spread-pg")
    results = run()
    assert results["placement-group"].status is Status.FAIL
    assert "strategy spread" in results["placement-group"].detail


def test_node_outside_the_group_means_group_at_capacity(lab: Lab) -> None:
    lab.launch(count=2)
    outside = lab.launch(count=1, group=None)
    results = run(placement_group=lab.placement_group)
    assert results["placement-group"].status is Status.PASS
    assert results["placement-group-capacity"].status is Status.FAIL
    assert outside[0] in results["placement-group-capacity"].detail
    assert "1 of 3 compute nodes" in results["placement-group-capacity"].detail


def test_nodes_in_two_azs_fail(lab: Lab) -> None:
    lab.launch(count=2, az="us-east-1a")
    lab.launch(count=1, az="us-east-1b")
    results = run()
    assert results["single-az"].status is Status.FAIL
    assert "us-east-1a: 2, us-east-1b: 1" in results["single-az"].detail


def test_queues_are_checked_each_in_its_own_group_and_az(lab: Lab) -> None:
    """ParallelCluster gives every queue its own subnet and placement group: that is not a failure."""
    lab.ec2.create_placement_group(GroupName="other-pg", Strategy="cluster")
    lab.launch(count=2, queue="gpu-a")
    lab.launch(count=1, queue="gpu-b", az="us-east-1b", group="other-pg")
    results = run()
    for queue in ("gpu-a", "gpu-b"):
        for check in ("placement-group", "placement-group-capacity", "single-az"):
            assert results[f"{check}[{queue}]"].status is Status.PASS, results[f"{check}[{queue}]"]
    assert "other-pg" in results["placement-group[gpu-b]"].detail
    assert results["efa-interfaces"].status is Status.PASS


def test_a_queue_split_across_azs_fails_only_for_that_queue(lab: Lab) -> None:
    lab.launch(count=1, queue="gpu-a")
    lab.launch(count=1, queue="gpu-b")
    lab.launch(count=1, queue="gpu-b", az="us-east-1b")
    results = run()
    assert results["single-az[gpu-a]"].status is Status.PASS
    assert results["single-az[gpu-b]"].status is Status.FAIL


def test_queue_option_limits_the_checks_to_one_queue(lab: Lab) -> None:
    lab.launch(count=1, queue="gpu-a")
    lab.launch(count=1, queue="gpu-b", efa=0, group=None)
    only_a = run(queue="gpu-a")
    assert "2 instances, 1 compute nodes" in only_a["cluster-instances"].detail
    assert only_a["placement-group"].status is Status.PASS
    assert only_a["efa-interfaces"].status is Status.PASS
    assert run(queue="gpu-b")["efa-interfaces"].status is Status.FAIL
    missing = run(queue="nope")
    assert statuses(missing) == {"cluster-instances": Status.FAIL}
    assert "gpu-a, gpu-b" in missing["cluster-instances"].detail


def test_p5_without_efa_interfaces_fails(lab: Lab) -> None:
    lab.launch(count=1)
    bare = lab.launch(count=1, efa=0)
    results = run()
    expected = instance_types.get(GPU_TYPE).efa_interfaces
    assert results["efa-interfaces"].status is Status.FAIL
    assert f"{bare[0]} ({GPU_TYPE}): 0 of {expected} EFA interfaces" in results["efa-interfaces"].detail


def test_p5_with_some_efa_interfaces_missing_fails(lab: Lab) -> None:
    expected = instance_types.get(GPU_TYPE).efa_interfaces
    lab.launch(count=1, efa=expected - 1)
    results = run()
    assert results["efa-interfaces"].status is Status.FAIL
    assert f"{expected - 1} of {expected}" in results["efa-interfaces"].detail


def test_no_gpu_compute_nodes_skips_efa_check(lab: Lab) -> None:
    lab.launch(count=1, instance_type="c5n.large", efa=0)
    assert run()["efa-interfaces"].status is Status.SKIP


@pytest.mark.parametrize(("ingress", "egress"), [(True, False), (False, True), (False, False)])
def test_security_group_without_self_all_traffic_rule_fails(lab: Lab, ingress: bool, egress: bool) -> None:
    sg = lab.security_group(ingress=ingress, egress=egress, name=f"half-{ingress}-{egress}")
    ids = lab.launch(count=1, sg=sg)
    results = run()
    assert results["efa-security-group"].status is Status.FAIL
    assert ids[0] in results["efa-security-group"].detail
    assert sg in results["efa-security-group"].detail


def test_security_group_with_port_limited_self_rule_fails(lab: Lab) -> None:
    vpc = lab.ec2.describe_subnets(SubnetIds=[lab.subnets["us-east-1a"]])["Subnets"][0]["VpcId"]
    sg = lab.ec2.create_security_group(GroupName="tcp-only", Description="tcp", VpcId=vpc)["GroupId"]
    tcp_self = [{"IpProtocol": "tcp", "FromPort": 0, "ToPort": 65535, "UserIdGroupPairs": [{"GroupId": sg}]}]
    lab.ec2.authorize_security_group_ingress(GroupId=sg, IpPermissions=tcp_self)
    lab.ec2.authorize_security_group_egress(GroupId=sg, IpPermissions=tcp_self)
    lab.launch(count=1, sg=sg)
    assert run()["efa-security-group"].status is Status.FAIL


def test_nodes_with_different_self_referencing_groups_fail(lab: Lab) -> None:
    other = lab.security_group(ingress=True, egress=True, name="efa-other")
    lab.launch(count=1)
    lab.launch(count=1, sg=other)
    results = run()
    assert results["efa-security-group"].status is Status.FAIL
    assert "different" in results["efa-security-group"].detail


class FakeQuotas:
    """A stand-in for the Service Quotas client (test double): moto does not serve EC2 quotas."""

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values
        self.calls: list[tuple[str, str]] = []

    def get_service_quota(self, ServiceCode: str, QuotaCode: str) -> dict[str, Any]:  # noqa: N803 (boto3 names)
        self.calls.append((ServiceCode, QuotaCode))
        return {"Quota": {"QuotaCode": QuotaCode, "Value": self.values[QuotaCode]}}


def vcpus(ec2: Any, instance_type: str) -> int:
    info = ec2.describe_instance_types(InstanceTypes=[instance_type])["InstanceTypes"][0]
    return int(info["VCpuInfo"]["DefaultVCpus"])


@pytest.mark.parametrize("spare_nodes", [0, 1, 2])
def test_quota_passes_when_it_covers_usage_plus_spares_and_fails_one_vcpu_short(
    lab: Lab, spare_nodes: int
) -> None:
    lab.launch(count=2)
    # A P instance outside the cluster also counts: the quota is per Region.
    lab.ec2.run_instances(ImageId=lab.ami, MinCount=1, MaxCount=1, InstanceType="p4d.24xlarge")
    # A Spot Instance does not: Spot has its own quotas.
    spot = lab.ec2.run_instances(
        ImageId=lab.ami,
        MinCount=1,
        MaxCount=1,
        InstanceType="p4d.24xlarge",
        InstanceMarketOptions={"MarketType": "spot"},
    )
    assert spot["Instances"][0].get("InstanceLifecycle") == "spot"
    p5, p4d = vcpus(lab.ec2, GPU_TYPE), vcpus(lab.ec2, "p4d.24xlarge")
    need = 2 * p5 + p4d + spare_nodes * p5

    enough = FakeQuotas({"L-417A185B": float(need)})
    result = run(spare_nodes=spare_nodes, quotas=enough)["quota-L-417A185B"]
    assert result.status is Status.PASS
    assert enough.calls == [("ec2", "L-417A185B")]

    too_few = FakeQuotas({"L-417A185B": float(need - 1)})
    short = run(spare_nodes=spare_nodes, quotas=too_few)["quota-L-417A185B"]
    assert short.status is Status.FAIL
    assert f"at least {need}" in short.detail


def test_g_family_nodes_use_the_g_and_vt_quota(lab: Lab) -> None:
    lab.launch(count=1, instance_type="g5.48xlarge")
    fake = FakeQuotas({"L-DB2E81BA": 0.0})
    results = run(quotas=fake)
    assert fake.calls == [("ec2", "L-DB2E81BA")]
    assert results["quota-L-DB2E81BA"].status is Status.FAIL


def test_table_lists_every_row_and_the_verdict(lab: Lab) -> None:
    lab.launch(count=1, efa=0)
    results = list(run().values())
    table = render_table(results)
    for r in results:
        assert any(line.startswith(r.name) and r.status.value in line for line in table.splitlines())
    assert "preflight FAILED" in table
    # Every row's detail starts in the DETAIL column.
    lines = table.splitlines()
    column = lines[0].index("DETAIL")
    for line, r in zip(lines[2:], results, strict=False):
        assert line[column:] == r.detail


cli = functools.partial(clitools.run, preflight_cli)


def test_cli_exit_codes(lab: Lab, capsys: pytest.CaptureFixture[str]) -> None:
    lab.launch(count=2)
    assert cli(["preflight", "--cluster-name", CLUSTER, "--region", "us-east-1"]) == 0
    assert "preflight PASSED" in capsys.readouterr().out
    lab.launch(count=1, az="us-east-1b")
    assert cli(["preflight", "--cluster-name", CLUSTER]) == 1
    out = capsys.readouterr().out
    assert "single-az" in out
    assert "preflight FAILED" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cluster-name", "9bad"], "--cluster-name"),
        (["--cluster-name", "ok", "--region", "mars"], "--region"),
        (["--cluster-name", "ok", "--spare-nodes", "-1"], "--spare-nodes"),
    ],
)
def test_cli_bad_input_is_a_user_error(argv: list[str], message: str) -> None:
    with pytest.raises(UserError, match=message) as excinfo:
        cli(["preflight", *argv])
    assert excinfo.value.exit_code == 2


def test_registered_in_the_gpuforge_command(lab: Lab, capsys: pytest.CaptureFixture[str]) -> None:
    lab.launch(count=1, efa=0)
    assert gpuforge_cli.main(["preflight", "--cluster-name", CLUSTER]) == 1
    assert "efa-interfaces" in capsys.readouterr().out
    assert gpuforge_cli.main(["preflight", "--cluster-name", CLUSTER, "--region", "nowhere"]) == 2
    assert "gpuforge: error: --region" in capsys.readouterr().err
