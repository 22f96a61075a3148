"""The inventories of running ParallelCluster fleets, against moto_server (the EC2 test double).

inventory/ec2_fleet.yml (this collection's gpuforge.gpu.ec2_fleet plugin) and inventory/aws_ec2.yml
(amazon.aws.aws_ec2) must group one fleet the same way and give the host variables the roles read
the same values; the plugin also caches, covers several regions and fails in one line.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from botocore.config import Config

import sourcefile
from gpuforge_lab.bench import ec2fleet
from gpuforge_lab.bench.throttle import ThrottlingProxy
from gpuforge_lab.moto import MotoServer, free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PLUGIN = REPO / "inventory/ec2_fleet.yml"
AWS_EC2 = REPO / "inventory/aws_ec2.yml"
# The host variables the roles and playbooks read (grep roles/ playbooks/ for them).
READ_VARS = (
    "ansible_host",
    "gpuforge_cluster_name",
    "gpuforge_node_type",
    "gpuforge_queue",
    "gpuforge_compute_resource",
    "gpuforge_instance_type",
    "gpuforge_node_name",
    "aws_image_id",
)
FLEET = [
    ec2fleet.Queue("train", "gpu", "p5-48xlarge", "p5.48xlarge", 4),
    ec2fleet.Queue("train", "gpu-small", "p4d-24xlarge", "p4d.24xlarge", 2),
    ec2fleet.Queue("infer", "cpu", "c5-large", "c5.large", 2),
]


def inventory(source: Path, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    out = subprocess.run(
        [str(BIN / "ansible-inventory"), "-i", str(source), "--list", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={
            **os.environ,
            "ANSIBLE_INVENTORY_CACHE_CONNECTION": str(tmp_path / "inv-cache"),
            "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "true",
            **(env or {}),
        },
        timeout=300,
    )
    return out


def inventory_group_vars() -> set[str]:
    """The variable names inventory/group_vars/ defines (both inventories add them to every host)."""
    names: set[str] = set()
    for path in (REPO / "inventory" / "group_vars").rglob("*.yml"):
        names |= set(yaml.safe_load(path.read_text()) or {})
    return names


def listing(source: Path, tmp_path: Path, *args: str) -> dict[str, Any]:
    out = inventory(source, tmp_path, *args)
    assert out.returncode == 0, out.stderr
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def plain(value: Any) -> Any:
    # ansible-inventory marks values from the cloud as unsafe: {"__ansible_unsafe": "10.0.0.4"}.
    return value.get("__ansible_unsafe") if isinstance(value, dict) else value


def groups(data: dict[str, Any]) -> dict[str, list[str]]:
    return {
        name: sorted(body.get("hosts", []))
        for name, body in data.items()
        if name not in {"_meta", "all", "ungrouped"} and body.get("hosts")
    }


def read_vars(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        host: {k: plain(v[k]) for k in READ_VARS if k in v} for host, v in data["_meta"]["hostvars"].items()
    }


@pytest.fixture
def fleet(aws: MotoServer) -> MotoServer:
    ec2fleet.build(boto3.client("ec2"), FLEET, subnets=2, batch=3, lab=True)
    return aws


def test_plugin_and_aws_ec2_build_the_same_groups_and_read_vars(fleet: MotoServer, tmp_path: Path) -> None:
    ours = listing(PLUGIN, tmp_path, "--flush-cache")
    theirs = listing(AWS_EC2, tmp_path, "--flush-cache")
    assert groups(ours) == groups(theirs)
    assert read_vars(ours) == read_vars(theirs)
    found = groups(ours)
    # 2 head nodes + 8 compute nodes; the untagged and the stopped instance are left out.
    assert len(ours["_meta"]["hostvars"]) == 10
    assert len(found["head_node"]) == 2 and len(found["compute"]) == 8
    assert len(found["gpu"]) == 6 and len(found["gpuforge_lab"]) == 10
    assert {"cluster_train", "cluster_infer", "queue_gpu", "queue_gpu_small", "az_us_east_1a"} <= set(found)
    assert len(found["instance_type_p5_48xlarge"]) == 4
    # Only what the roles read and the instance's identity (and inventory/group_vars/), not EC2's
    # whole description as aws_* variables.
    name, host = next(iter(ours["_meta"]["hostvars"].items()))
    full = theirs["_meta"]["hostvars"][name]
    group_vars = {k for k in full if k in inventory_group_vars() and k not in READ_VARS}
    assert set(host) - group_vars <= {*READ_VARS, "aws_instance_id", "aws_region"}
    assert "aws_network_interfaces" in full and "aws_network_interfaces" not in host


def test_plugin_client_leaves_timestamps_unparsed(fleet: MotoServer) -> None:
    # Parsing each p5's 32 attachment times was about 45% of a describe (docs/performance.md); the
    # records read none. Other clients in the process keep botocore's datetimes.
    ec2 = sourcefile.load("ec2_fleet_test", "plugins/inventory/ec2_fleet.py").ec2_client(
        boto3, "us-east-1", None, None, Config()
    )
    p5 = next(
        i
        for r in ec2.describe_instances()["Reservations"]
        for i in r["Instances"]
        if i["InstanceType"] == "p5.48xlarge"
    )
    assert isinstance(p5["LaunchTime"], str)
    assert len(p5["NetworkInterfaces"]) == 32
    assert all(isinstance(n["Attachment"]["AttachTime"], str) for n in p5["NetworkInterfaces"])
    default = boto3.client("ec2").describe_instances()["Reservations"][0]["Instances"][0]
    assert isinstance(default["LaunchTime"], datetime.datetime)


def test_plugin_answers_from_its_cache_until_flushed(fleet: MotoServer, tmp_path: Path) -> None:
    first = listing(PLUGIN, tmp_path, "--flush-cache")
    ec2 = boto3.client("ec2")
    ids = [
        i["InstanceId"]
        for r in ec2.describe_instances(
            Filters=[{"Name": "tag:parallelcluster:queue-name", "Values": ["cpu"]}]
        )["Reservations"]
        for i in r["Instances"]
    ]
    ec2.terminate_instances(InstanceIds=ids)
    assert listing(PLUGIN, tmp_path)["_meta"]["hostvars"] == first["_meta"]["hostvars"]
    assert len(listing(PLUGIN, tmp_path, "--flush-cache")["_meta"]["hostvars"]) == 8


def test_plugin_lists_several_regions_and_filters_clusters(aws: MotoServer, tmp_path: Path) -> None:
    ec2fleet.build(boto3.client("ec2", region_name="us-east-1"), FLEET[:1], subnets=1)
    west = [ec2fleet.Queue("west", "gpu", "p4d-24xlarge", "p4d.24xlarge", 2)]
    ec2fleet.build(boto3.client("ec2", region_name="us-west-2"), west, subnets=1)
    config = tmp_path / "two_regions.ec2_fleet.yml"
    config.write_text("plugin: gpuforge.gpu.ec2_fleet\nregions: [us-east-1, us-west-2]\n")
    data = listing(config, tmp_path)
    regions = {plain(v["aws_region"]) for v in data["_meta"]["hostvars"].values()}
    assert regions == {"us-east-1", "us-west-2"}
    assert len(data["cluster_west"]["hosts"]) == 3 and len(data["cluster_train"]["hosts"]) == 5
    config.write_text(
        "plugin: gpuforge.gpu.ec2_fleet\nregions: [us-east-1, us-west-2]\ncluster_names: [west]\n"
    )
    west_only = listing(config, tmp_path)
    assert sorted(west_only["_meta"]["hostvars"]) == sorted(data["cluster_west"]["hosts"])


def test_plugin_rides_out_ec2_throttling(fleet: MotoServer, tmp_path: Path) -> None:
    """RequestLimitExceeded (from the throttling test double) is retried; with one attempt it is one line."""
    proxy = ThrottlingProxy(fleet.url, throttle_first=3).start()
    try:
        retried = inventory(PLUGIN, tmp_path, "--flush-cache", env={"AWS_ENDPOINT_URL": proxy.url})
        assert retried.returncode == 0, retried.stderr
        assert len(json.loads(retried.stdout)["_meta"]["hostvars"]) == 10
        assert proxy.counts.throttled == 3
        config = tmp_path / "once.ec2_fleet.yml"
        config.write_text("plugin: gpuforge.gpu.ec2_fleet\nmax_attempts: 1\n")
        proxy.counts.throttled = 0
        once = inventory(config, tmp_path, env={"AWS_ENDPOINT_URL": proxy.url})
        assert once.returncode != 0
        assert "describe_instances in us-east-1 refused: RequestLimitExceeded" in once.stderr, once.stderr
    finally:
        proxy.stop()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_URL": ""},
            "gpuforge.gpu.ec2_fleet: us-east-1: Could not connect to the endpoint URL",
        ),
        (
            {
                "AWS_ACCESS_KEY_ID": "",
                "AWS_SECRET_ACCESS_KEY": "",
                "AWS_SESSION_TOKEN": "",
                "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                "AWS_CONFIG_FILE": "/nonexistent",
            },
            "gpuforge.gpu.ec2_fleet: no AWS credentials for us-east-1",
        ),
    ],
    ids=["unreachable-endpoint", "no-credentials"],
)
def test_plugin_fails_in_one_line(
    aws: MotoServer, tmp_path: Path, env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in env.items():
        if value:
            monkeypatch.setenv(key, value)
        else:
            monkeypatch.delenv(key, raising=False)
    config = tmp_path / "once.ec2_fleet.yml"
    config.write_text("plugin: gpuforge.gpu.ec2_fleet\nmax_attempts: 1\n")
    out = inventory(config, tmp_path)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
