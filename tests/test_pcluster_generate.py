"""gpuforge.pcluster.generate: spec -> ParallelCluster 3 config (pure; facts from data/instance_types.yml)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuforge import instance_types
from gpuforge.errors import UserError
from gpuforge.pcluster.config import custom_amis
from gpuforge.pcluster.generate import generate
from gpuforge.pcluster.validate import validate

KMS_KEY = "1234abcd-12ab-34cd-56ef-1234567890ab"

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cluster-spec.yml"
SUBNET_A = "subnet-0123456789abcdef0"
SUBNET_B = "subnet-0123456789abcdef1"


def base_spec() -> dict[str, Any]:
    return {
        "region": "us-east-1",
        "ami": "ami-0123456789abcdef0",
        "os": "ubuntu2204",
        "head_node": {"instance_type": "c5.2xlarge", "subnet_id": SUBNET_A, "ssh_key": "gpuforge"},
        "queues": [
            {
                "name": "gpu",
                "subnet_ids": [SUBNET_A],
                "compute_resources": [{"instance_type": "p5.48xlarge", "max_count": 4}],
            }
        ],
        "storage": {
            "fsx_lustre": {
                "storage_capacity": 1200,
                "deployment_type": "PERSISTENT_2",
                "per_unit_storage_throughput": 250,
            }
        },
    }


def _queue(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(q for q in config["Scheduling"]["SlurmQueues"] if q["Name"] == name)


def test_example_spec_generates_a_valid_config() -> None:
    spec = yaml.safe_load(EXAMPLE.read_text())
    config = generate(spec)
    validate(config)
    assert config["Region"] == spec["region"]
    assert config["Image"] == {"Os": spec["os"], "CustomAmi": spec["ami"]}
    head = config["HeadNode"]
    assert head["InstanceType"] == spec["head_node"]["instance_type"]
    assert head["Networking"] == {"SubnetId": spec["head_node"]["subnet_id"]}
    assert head["Ssh"] == {"KeyName": spec["head_node"]["ssh_key"]}
    action = spec["head_node"]["on_node_configured"]
    # gpuforge_node: true gives the head node its part (tests/test_node_side.py covers the rest).
    assert head["CustomActions"] == {
        "OnNodeConfigured": {"Script": action["script"], "Args": ["--node-type", "HeadNode"]}
    }
    assert config["Scheduling"]["Scheduler"] == "slurm"
    assert config["Scheduling"]["SlurmSettings"] == {
        "QueueUpdateStrategy": "DRAIN",
        "CustomSlurmSettings": spec["slurm"]["custom_settings"],
    }
    assert [q["Name"] for q in config["Scheduling"]["SlurmQueues"]] == [q["name"] for q in spec["queues"]]
    fsx = spec["storage"]["fsx_lustre"]
    assert config["SharedStorage"] == [
        {
            "Name": fsx["name"],
            "StorageType": "FsxLustre",
            "MountDir": fsx["mount_dir"],
            "FsxLustreSettings": {
                "StorageCapacity": fsx["storage_capacity"],
                "DeploymentType": fsx["deployment_type"],
                "PerUnitStorageThroughput": fsx["per_unit_storage_throughput"],
            },
        }
    ]


@pytest.mark.parametrize("name", sorted(instance_types.all_types()))
def test_efa_placement_and_gpu_health_follow_instance_facts(name: str) -> None:
    facts = instance_types.get(name)
    spec = base_spec()
    spec["queues"][0]["compute_resources"] = [{"instance_type": name, "min_count": 1, "max_count": 2}]
    config = generate(spec)
    queue = _queue(config, "gpu")
    (resource,) = queue["ComputeResources"]
    assert resource["Name"] == name.replace(".", "-")
    assert (resource["InstanceType"], resource["MinCount"], resource["MaxCount"]) == (name, 1, 2)
    assert resource.get("Efa") == ({"Enabled": True} if facts.efa_interfaces > 0 else None)
    assert resource.get("HealthChecks") == ({"Gpu": {"Enabled": True}} if facts.gpus > 0 else None)
    assert queue["Networking"].get("PlacementGroup") == (
        {"Enabled": True} if facts.efa_interfaces > 0 else None
    )


def test_placement_group_is_per_queue() -> None:
    spec = base_spec()
    no_efa = next(t for t in instance_types.all_types().values() if t.efa_interfaces == 0)
    spec["storage"] = {"fsx_lustre": {"file_system_id": "fs-0123456789abcdef0"}}
    spec["queues"].append(
        {
            "name": "small",
            "subnet_ids": [SUBNET_A, SUBNET_B],
            "compute_resources": [{"instance_type": no_efa.name, "max_count": 1}],
        }
    )
    config = generate(spec)
    assert _queue(config, "gpu")["Networking"]["PlacementGroup"] == {"Enabled": True}
    assert _queue(config, "small")["Networking"] == {"SubnetIds": [SUBNET_A, SUBNET_B]}
    assert config["SharedStorage"][0]["FsxLustreSettings"] == {"FileSystemId": "fs-0123456789abcdef0"}


def test_optional_parts() -> None:
    spec = base_spec()
    del spec["storage"]
    queue = spec["queues"][0]
    queue.update(capacity_type="SPOT", ami="ami-0fedcba9876543210")
    queue["on_node_configured"] = {"script": "https://example.com/pull.sh"}
    config = generate(spec)
    assert "SharedStorage" not in config
    # Without slurm settings in the spec, the config still states DRAIN (ParallelCluster's default,
    # COMPUTE_FLEET_STOP, would make update-cluster refuse a new queue image while jobs run).
    assert config["Scheduling"]["SlurmSettings"] == {"QueueUpdateStrategy": "DRAIN"}
    generated = _queue(config, "gpu")
    assert generated["CapacityType"] == "SPOT"
    assert generated["CustomActions"] == {"OnNodeConfigured": {"Script": "https://example.com/pull.sh"}}
    assert custom_amis(config) == {"ami-0123456789abcdef0", "ami-0fedcba9876543210"}


def _security_specs() -> dict[str, dict[str, Any]]:
    """Specs covering each shape of output: several queues, no storage, an existing file system."""
    no_storage = base_spec()
    del no_storage["storage"]
    no_storage["queues"][0]["ami"] = "ami-0fedcba9876543210"
    existing_fsx = base_spec()
    existing_fsx["storage"] = {"fsx_lustre": {"file_system_id": "fs-0123456789abcdef0"}}
    no_efa = next(t for t in instance_types.all_types().values() if t.efa_interfaces == 0)
    existing_fsx["queues"].append(
        {
            "name": "cpu",
            "subnet_ids": [SUBNET_A, SUBNET_B],
            "compute_resources": [{"instance_type": no_efa.name, "max_count": 1}],
        }
    )
    return {
        "example": yaml.safe_load(EXAMPLE.read_text()),
        "base": base_spec(),
        "no-storage": no_storage,
        "existing-fsx-two-queues": existing_fsx,
    }


@pytest.mark.parametrize("spec", list(_security_specs().values()), ids=list(_security_specs()))
def test_security_settings_are_stated_not_left_to_defaults(
    spec: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """IMDSv2 only, a secured head node IMDS and encrypted root volumes, on the head node and every queue.

    Checked twice: in the YAML gpuforge writes, and in the model aws-parallelcluster builds from it, where
    each value must be the one given (not implied from a default), so a key ParallelCluster would read
    from elsewhere, or a default that later changes, cannot make the check pass.
    """
    from pcluster.schemas.cluster_schema import ClusterSchema

    config = generate(spec)
    assert config["Imds"] == {"ImdsSupport": "v2.0"}
    assert config["HeadNode"]["Imds"] == {"Secured": True}
    assert config["HeadNode"]["LocalStorage"] == {"RootVolume": {"Encrypted": True}}
    queues = config["Scheduling"]["SlurmQueues"]
    assert len(queues) == len(spec["queues"])
    for queue in queues:
        assert queue["ComputeSettings"] == {"LocalStorage": {"RootVolume": {"Encrypted": True}}}, queue[
            "Name"
        ]

    monkeypatch.setenv("AWS_DEFAULT_REGION", config["Region"])
    model = ClusterSchema(cluster_name="gpuforge-test").load(copy.deepcopy(config))
    stated: list[tuple[str, Any, str, Any]] = [
        ("Imds.ImdsSupport", model.imds, "imds_support", "v2.0"),
        ("HeadNode.Imds.Secured", model.head_node.imds, "secured", True),
        ("HeadNode root volume", model.head_node.local_storage.root_volume, "encrypted", True),
    ]
    stated += [
        (f"queue {q.name} root volume", q.compute_settings.local_storage.root_volume, "encrypted", True)
        for q in model.scheduling.queues
    ]
    assert len(stated) == 3 + len(queues)
    for what, resource, attr, expected in stated:
        assert getattr(resource, attr) == expected, what
        assert not resource.is_implied(attr), f"{what} is ParallelCluster's default, not gpuforge's setting"


def test_new_fsx_takes_an_optional_kms_key() -> None:
    """FSx for Lustre is always encrypted at rest; a customer-managed key is passed through when given."""
    spec = base_spec()
    assert "KmsKeyId" not in generate(spec)["SharedStorage"][0]["FsxLustreSettings"]
    arn = f"arn:aws:kms:us-east-1:123456789012:key/{KMS_KEY}"
    for key in (KMS_KEY, arn, "mrk-1234abcd12ab34cd56ef1234567890ab"):
        spec["storage"]["fsx_lustre"]["kms_key_id"] = key
        assert generate(spec)["SharedStorage"][0]["FsxLustreSettings"]["KmsKeyId"] == key


def test_generate_does_not_modify_the_spec() -> None:
    spec = base_spec()
    before = copy.deepcopy(spec)
    generate(spec)
    assert spec == before


def _without(path: str) -> Any:
    def edit(spec: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = spec
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        del target[last]

    return edit


def _set(path: str, value: Any) -> Any:
    def edit(spec: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = spec
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        target[last] = value

    return edit


CR = "queues.0.compute_resources.0"
FSX = "storage.fsx_lustre"

# (edit to the valid base spec, the field the error must name, a fragment of the explanation)
BAD_SPECS = [
    (_without("region"), "region", "missing"),
    (_without("ami"), "ami", "missing"),
    (_without("head_node"), "head_node", "missing"),
    (_without("queues"), "queues", "missing"),
    (_set("regoin", "us-east-1"), "(top level)", "unknown key(s) regoin"),
    (_set("region", "mars-north-1"), "region", "not a region ParallelCluster supports"),
    (_set("ami", "ami-xyz"), "ami", "invalid AMI id"),
    (_without("head_node.ssh_key"), "head_node.ssh_key", "missing"),
    (_set("head_node.subnet_id", "subnet-12"), "head_node.subnet_id", "not a subnet id"),
    (_set("head_node.instance_type", "big"), "head_node.instance_type", "not an EC2 instance type"),
    (
        _set("head_node.on_node_configured", {"script": "ftp://x/y.sh"}),
        "head_node.on_node_configured.script",
        "s3://",
    ),
    (
        _set("head_node.on_node_configured", {"script": "s3://b/p.sh", "args": "-v"}),
        "head_node.on_node_configured.args",
        "list",
    ),
    (_set("queues", []), "queues", "at least 1"),
    (_set("queues.0.name", "GPU_Queue"), "queues[0].name", "lowercase"),
    (_set("queues.0.name", "q" * 26), "queues[0].name", "at most 25"),
    (_set("queues.0.name", "default"), "queues[0].name", "forbidden"),
    (_set("queues.0.subnet_ids", "subnet-0123456789abcdef0"), "queues[0].subnet_ids", "must be a list"),
    (_set("queues.0.subnet_ids", ["subnet-xyz"]), "queues[0].subnet_ids[0]", "not a subnet id"),
    (_set("queues.0.subnet_ids", [SUBNET_A, SUBNET_A]), "queues[0].subnet_ids", "more than once"),
    (_set("queues.0.subnet_ids", [SUBNET_A, SUBNET_B]), "queues[0].subnet_ids", "EFA queue"),
    (_set("queues.0.capacity_type", "CHEAP"), "queues[0].capacity_type", "one of"),
    (_set("queues.0.ami", "ami-1"), "queues[0].ami", "invalid AMI id"),
    (_set("queues.0.compute_resources", []), "queues[0].compute_resources", "at least 1"),
    (
        _set(f"{CR}.instance_type", "p9.96xlarge"),
        "queues[0].compute_resources[0].instance_type",
        "unknown instance",
    ),
    (_without(f"{CR}.max_count"), "queues[0].compute_resources[0].max_count", "missing"),
    (_set(f"{CR}.max_count", 0), "queues[0].compute_resources[0].max_count", "at least 1"),
    (_set(f"{CR}.max_count", "4"), "queues[0].compute_resources[0].max_count", "integer"),
    (_set(f"{CR}.max_count", True), "queues[0].compute_resources[0].max_count", "integer"),
    (_set(f"{CR}.min_count", 5), "queues[0].compute_resources[0].min_count", "greater than max_count 4"),
    (_set(f"{CR}.min_count", -1), "queues[0].compute_resources[0].min_count", "at least 0"),
    (_set(f"{CR}.count", 1), "queues[0].compute_resources[0]", "unknown key"),
    (_set(f"{FSX}.deployment_type", "FAST"), f"{FSX}.deployment_type", "one of"),
    (_set(f"{FSX}.storage_capacity", 1000), f"{FSX}.storage_capacity", "1,200 GB or increments of 2,400"),
    (
        _without(f"{FSX}.per_unit_storage_throughput"),
        f"{FSX}.per_unit_storage_throughput",
        "must be specified",
    ),
    (
        _set(f"{FSX}.per_unit_storage_throughput", 300),
        f"{FSX}.per_unit_storage_throughput",
        "following values",
    ),
    (_without(f"{FSX}.storage_capacity"), FSX, "give file_system_id"),
    (_set(f"{FSX}.file_system_id", "fs-0123456789abcdef0"), f"{FSX}.file_system_id", "takes no"),
    (_set(FSX, {"file_system_id": "fs-123"}), f"{FSX}.file_system_id", "not an FSx file system id"),
    (
        _set(
            FSX,
            {"storage_capacity": 1200, "deployment_type": "SCRATCH_2", "per_unit_storage_throughput": 200},
        ),
        f"{FSX}.per_unit_storage_throughput",
        "only be used",
    ),
    (_set("slurm", {"custom_settings": ["PrivateData=cloud"]}), "slurm.custom_settings[0]", "mapping"),
    (_set(f"{FSX}.kms_key_id", "alias/fsx"), f"{FSX}.kms_key_id", "not a KMS key id or key ARN"),
    (
        _set(FSX, {"storage_capacity": 1200, "deployment_type": "SCRATCH_2", "kms_key_id": KMS_KEY}),
        f"{FSX}.kms_key_id",
        "KMS key id can only be used",
    ),
    (
        _set(FSX, {"file_system_id": "fs-0123456789abcdef0", "kms_key_id": KMS_KEY}),
        f"{FSX}.file_system_id",
        "takes no kms_key_id",
    ),
]


@pytest.mark.parametrize(("edit", "field", "fragment"), BAD_SPECS)
def test_malformed_spec_names_the_field(edit: Any, field: str, fragment: str) -> None:
    spec = base_spec()
    edit(spec)
    with pytest.raises(UserError) as info:
        generate(spec)
    message = str(info.value)
    assert message.startswith(f"cluster spec: {field}: "), message
    assert fragment in message


def test_new_fsx_needs_single_subnet_queues() -> None:
    spec = base_spec()
    no_efa = next(t for t in instance_types.all_types().values() if t.efa_interfaces == 0)
    spec["queues"][0] = {
        "name": "cpu",
        "subnet_ids": [SUBNET_A, SUBNET_B],
        "compute_resources": [{"instance_type": no_efa.name, "max_count": 1}],
    }
    with pytest.raises(
        UserError, match=r"queues\[0\]\.subnet_ids: a new FSx file system needs single-subnet"
    ):
        generate(spec)


def test_duplicate_names_are_rejected() -> None:
    spec = base_spec()
    spec["queues"].append(copy.deepcopy(spec["queues"][0]))
    with pytest.raises(UserError, match=r"queues: queue name\(s\) gpu repeat"):
        generate(spec)
    spec = base_spec()
    spec["queues"][0]["compute_resources"].append({"instance_type": "p5.48xlarge", "max_count": 1})
    with pytest.raises(UserError, match=r"compute_resources: compute resource name\(s\) p5-48xlarge repeat"):
        generate(spec)


def test_spec_must_be_a_mapping() -> None:
    with pytest.raises(UserError, match="must be a mapping"):
        generate(["not", "a", "spec"])  # type: ignore[arg-type]


def test_docs_example_matches_the_generator() -> None:
    """docs/cluster-spec.md shows a spec and its output; keep the page true."""
    doc = (EXAMPLE.parents[1] / "docs" / "cluster-spec.md").read_text()
    blocks = [yaml.safe_load(b.split("```", 1)[0]) for b in doc.split("```yaml\n")[1:]]
    spec, expected = blocks[0], blocks[1]
    assert generate(spec) == expected
