"""Cluster spec fields for real training clusters (docs/cluster-spec.md): Capacity Blocks and ODCRs, Spot with
requeue, Iam, storage, Slurm accounting, login nodes, monitoring, tags. Every generated config goes through
aws-parallelcluster's schema (generate() validates), and ParallelCluster's own offline validators decide
the Capacity Block rules. No AWS call is made, not even to moto."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuforge.errors import UserError
from gpuforge.pcluster.generate import generate
from gpuforge.pcluster.validate import validate

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "p5-capacity-block.yml"
DOC = REPO / "docs" / "cluster-spec.md"


# Offline: any botocore API call fails the test (conftest.no_aws).
pytestmark = pytest.mark.usefixtures("no_aws")


def spec() -> dict[str, Any]:
    return dict(yaml.safe_load(EXAMPLE.read_text()))


def _queue(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(q for q in config["Scheduling"]["SlurmQueues"] if q["Name"] == name)


def test_docs_show_the_p5_capacity_block_example_and_it_validates() -> None:
    text = DOC.read_text()
    match = re.search(r"<!-- p5-capacity-block -->\n```yaml\n(.*?)```", text, re.S)
    assert match, "docs/cluster-spec.md lost its p5 Capacity Block example"
    assert yaml.safe_load(match.group(1)) == spec()
    config = generate(spec())
    validate(config)
    train = _queue(config, "train")
    assert train["CapacityType"] == "CAPACITY_BLOCK"
    (p5,) = train["ComputeResources"]
    assert p5["CapacityReservationTarget"] == {"CapacityReservationId": "cr-0123456789abcdef0"}
    assert p5["MinCount"] == p5["MaxCount"] == 4
    assert p5["Efa"] == {"Enabled": True} and p5["DisableSimultaneousMultithreading"] is True
    # ParallelCluster refuses a placement group on a Capacity Block (PlacementGroupCapacityTypeValidator).
    assert train["Networking"]["PlacementGroup"] == {"Enabled": False}
    assert train["JobExclusiveAllocation"] is True
    assert train["ComputeSettings"]["LocalStorage"] == {
        "RootVolume": {"Encrypted": True, "Size": 200},
        "EphemeralVolume": {"MountDir": "/scratch"},
    }


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: s["queues"][0]["compute_resources"][0].pop("capacity_reservation_id"),
            "needs capacity_reservation_id",
        ),
        (lambda s: s["queues"][0]["compute_resources"][0].update(min_count=0), "same value of min count"),
        (
            lambda s: s["queues"][0]["compute_resources"][0].update(min_count=0, max_count=0),
            "must be at least 1",
        ),
        (
            lambda s: s["queues"][0].update(placement_group="pg-train"),
            "placement group constraint should not be set",
        ),
        (lambda s: s["queues"][0].update(allocation_strategy="lowest-price"), "takes no allocation strategy"),
        (
            lambda s: s["queues"][0]["compute_resources"][0].update(
                instance_types=["p5.48xlarge", "p5e.48xlarge"], instance_type=None
            ),
            "reserves one instance type",
        ),
    ],
    ids=["no-reservation", "min-below-max", "zero", "placement-group", "allocation-strategy", "two-types"],
)
def test_capacity_block_rules(edit: Any, message: str) -> None:
    changed = spec()
    edit(changed)
    with pytest.raises(UserError, match=re.escape(message)):
        generate(changed)


def test_odcr_queue_uses_the_reservations_placement_group_or_none() -> None:
    changed = spec()
    queue = changed["queues"][0]
    queue.update(capacity_type="ONDEMAND", capacity_reservation={"id": "cr-0fedcba9876543210"})
    queue["compute_resources"][0].pop("capacity_reservation_id")
    queue["compute_resources"][0]["min_count"] = 0
    config = generate(changed)
    train = _queue(config, "train")
    assert train["CapacityReservationTarget"] == {"CapacityReservationId": "cr-0fedcba9876543210"}
    assert train["Networking"]["PlacementGroup"] == {"Enabled": False}
    queue["placement_group"] = "odcr-pg"
    assert _queue(generate(changed), "train")["Networking"]["PlacementGroup"] == {
        "Enabled": True,
        "Name": "odcr-pg",
    }
    queue["capacity_reservation"] = {"id": "cr-1", "resource_group_arn": "x"}
    with pytest.raises(UserError, match="exactly one of id, resource_group_arn"):
        generate(changed)


def test_spot_queue_requeues_and_takes_several_instance_types() -> None:
    config = generate(spec())
    spot = _queue(config, "spot")
    assert spot["CapacityType"] == "SPOT" and spot["AllocationStrategy"] == "price-capacity-optimized"
    assert spot["ComputeResources"][0]["Instances"] == [
        {"InstanceType": "g5.12xlarge"},
        {"InstanceType": "g6.12xlarge"},
    ]
    assert {"JobRequeue": 1} in config["Scheduling"]["SlurmSettings"]["CustomSlurmSettings"]
    changed = spec()
    changed["queues"][0]["requeue"] = True
    with pytest.raises(UserError, match="only a SPOT queue takes requeue"):
        generate(changed)
    changed = spec()
    changed["queues"][0]["compute_resources"][0]["spot_price"] = 10
    with pytest.raises(UserError, match="only a SPOT queue takes a spot_price"):
        generate(changed)


def test_iam_grants_the_custom_action_buckets_and_the_specs_own() -> None:
    config = generate(spec())
    head = config["HeadNode"]["Iam"]
    assert head["S3Access"] == [
        {"BucketName": "my-gpuforge-bucket"},
        {"BucketName": "my-training-data"},
        {"BucketName": "my-checkpoints", "EnableWriteAccess": True},
    ]
    assert head["AdditionalIamPolicies"] == [
        {"Policy": "arn:aws:iam::aws:policy/CloudWatchAgentServerPolicy"}
    ]
    # The spot queue reads its custom action's bucket, then the spec's grants.
    assert _queue(config, "spot")["Iam"]["S3Access"][:2] == [
        {"BucketName": "my-gpuforge-bucket"},
        {"BucketName": "my-training-data"},
    ]
    changed = spec()
    changed["iam"]["additional_policies"] = ["CloudWatchAgentServerPolicy"]
    with pytest.raises(
        UserError, match=re.escape("iam.additional_policies[0]: 'CloudWatchAgentServerPolicy' is not an IAM")
    ):
        generate(changed)


def test_cluster_wide_settings() -> None:
    config = generate(spec())
    slurm = config["Scheduling"]["SlurmSettings"]
    assert slurm["ScaledownIdletime"] == 10 and slurm["QueueUpdateStrategy"] == "DRAIN"
    assert slurm["Database"]["PasswordSecretArn"].startswith("arn:aws:secretsmanager:")
    assert config["LoginNodes"]["Pools"] == [
        {
            "Name": "login",
            "InstanceType": "c5.2xlarge",
            "Count": 2,
            "Networking": {"SubnetIds": ["subnet-0a1b2c3d4e5f60718"]},
        }
    ]
    assert config["Monitoring"] == {
        "DetailedMonitoring": True,
        "Logs": {"CloudWatch": {"Enabled": True, "RetentionInDays": 30}},
        "Dashboards": {"CloudWatch": {"Enabled": True}},
    }
    assert config["Tags"] == [
        {"Key": "project", "Value": "llm-pretraining"},
        {"Key": "cost-center", "Value": "4711"},
    ]
    head = config["HeadNode"]
    assert head["Networking"]["AdditionalSecurityGroups"] == ["sg-0123456789abcdef0"]
    assert set(head["CustomActions"]) == {"OnNodeConfigured", "OnNodeUpdated"}
    assert _queue(config, "train")["CustomActions"]["OnNodeStart"] == {
        "Script": "s3://my-gpuforge-bucket/bootstrap/node-start.sh"
    }


def test_shared_home_and_fsx_retention_and_data_repositories() -> None:
    config = generate(spec())
    home, fsx = config["SharedStorage"]
    assert home == {
        "MountDir": "/home",
        "Name": "home",
        "StorageType": "Efs",
        "EfsSettings": {"Encrypted": True, "DeletionPolicy": "Retain"},
    }
    settings = fsx["FsxLustreSettings"]
    assert settings["DeletionPolicy"] == "Retain"
    assert [d["DataRepositoryPath"] for d in settings["DataRepositoryAssociations"]] == [
        "s3://my-training-data/datasets",
        "s3://my-checkpoints/run-1",
    ]
    ebs = spec()
    ebs["storage"]["home"] = {"type": "ebs", "size": 500, "deletion_policy": "Snapshot"}
    assert generate(ebs)["SharedStorage"][0]["EbsSettings"] == {
        "Size": 500,
        "Encrypted": True,
        "DeletionPolicy": "Snapshot",
    }
    scratch2 = spec()
    scratch2["storage"]["fsx_lustre"].update(deployment_type="SCRATCH_2", storage_capacity=1200)
    del scratch2["storage"]["fsx_lustre"]["per_unit_storage_throughput"]
    with pytest.raises(UserError, match="need a new PERSISTENT_2 file system"):
        generate(scratch2)


def test_validate_stays_offline_with_a_capacity_reservation(no_aws: list[str]) -> None:
    """ParallelCluster's config object looks capacity reservations up while loading; validate() does not."""
    config = generate(spec())
    validate(copy.deepcopy(config))
    assert no_aws == []
