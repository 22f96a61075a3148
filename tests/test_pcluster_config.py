"""gpuforge.pcluster.config: YAML round trip, AMI references and AMI patching (pure; no AWS)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from gpuforge.errors import UserError
from gpuforge.pcluster.config import custom_amis, dump_config, load_config, set_custom_ami

CLUSTER_AMI = "ami-0123456789abcdef0"
QUEUE_AMI = "ami-0fedcba9876543210"
HEAD_AMI = "ami-1234abcd"
LOGIN_AMI = "ami-00000000000000001"
NEW_AMI = "ami-0aaaaaaaaaaaaaaaa"


def _config() -> dict[str, Any]:
    return {
        "Region": "us-east-1",
        "Image": {"Os": "ubuntu2204", "CustomAmi": CLUSTER_AMI},
        "HeadNode": {
            "InstanceType": "c5.xlarge",
            "Networking": {"SubnetId": "subnet-0123456789abcdef0"},
            "Image": {"CustomAmi": HEAD_AMI},
        },
        "LoginNodes": {
            "Pools": [{"Name": "login", "InstanceType": "c5.large", "Image": {"CustomAmi": LOGIN_AMI}}]
        },
        "Scheduling": {
            "Scheduler": "slurm",
            "SlurmQueues": [
                {"Name": "gpu", "Image": {"CustomAmi": QUEUE_AMI}, "ComputeResources": []},
                {"Name": "cpu", "ComputeResources": []},
            ],
        },
    }


def test_round_trip_keeps_content_and_key_order(tmp_path: Path) -> None:
    config = _config()
    path = tmp_path / "sub" / "cluster.yml"
    dump_config(config, path)
    loaded = load_config(path)
    assert loaded == config
    assert list(loaded) == list(config)
    assert list(loaded["HeadNode"]) == list(config["HeadNode"])
    # Block style, top-level keys in the order given, not sorted.
    lines = [line.split(":")[0] for line in path.read_text().splitlines() if not line.startswith(" ")]
    assert [k for k in lines if k and not k.startswith("-")] == list(config)
    assert list(tmp_path.joinpath("sub").iterdir()) == [path], "no temporary file is left behind"


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "cannot read cluster config"),
        ("Region: [unclosed\n", "is not valid YAML"),
        ("- just\n- a list\n", "must be a YAML mapping"),
        ("", "must be a YAML mapping"),
    ],
)
def test_load_config_rejects_bad_files(tmp_path: Path, content: str | None, fragment: str) -> None:
    path = tmp_path / "cluster.yml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=fragment):
        load_config(path)


def test_custom_amis_finds_every_reference() -> None:
    assert custom_amis(_config()) == {CLUSTER_AMI, QUEUE_AMI, HEAD_AMI, LOGIN_AMI}


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"Image": "not-a-mapping", "Scheduling": {"SlurmQueues": "nope"}},
        {"Scheduling": {"SlurmQueues": [None, {"Name": "q"}]}, "LoginNodes": {"Pools": None}},
    ],
)
def test_custom_amis_tolerates_partial_configs(config: dict[str, Any]) -> None:
    assert custom_amis(config) == set()


def test_set_custom_ami_cluster_wide_returns_a_new_config() -> None:
    config = _config()
    before = copy.deepcopy(config)
    patched = set_custom_ami(config, NEW_AMI, cluster_wide=True)
    assert config == before, "the input is not modified"
    assert patched["Image"] == {"Os": "ubuntu2204", "CustomAmi": NEW_AMI}
    # Per-queue and head node overrides are left as they were.
    assert custom_amis(patched) == {NEW_AMI, QUEUE_AMI, HEAD_AMI, LOGIN_AMI}


def test_set_custom_ami_warns_about_queues_with_their_own_ami(caplog: pytest.LogCaptureFixture) -> None:
    set_custom_ami(_config(), NEW_AMI, cluster_wide=True)
    assert "queue gpu" in caplog.text
    assert "the head node" in caplog.text
    assert "queue cpu" not in caplog.text


def test_set_custom_ami_per_queue() -> None:
    config = _config()
    patched = set_custom_ami(config, NEW_AMI, ["cpu", "gpu"])
    queues = {q["Name"]: q for q in patched["Scheduling"]["SlurmQueues"]}
    assert queues["cpu"]["Image"] == {"CustomAmi": NEW_AMI}
    assert queues["gpu"]["Image"] == {"CustomAmi": NEW_AMI}
    assert patched["Image"]["CustomAmi"] == CLUSTER_AMI
    assert "Image" not in config["Scheduling"]["SlurmQueues"][1], "the input is not modified"


def test_set_custom_ami_one_queue_leaves_the_others() -> None:
    patched = set_custom_ami(_config(), NEW_AMI, ["cpu"])
    queues = {q["Name"]: q for q in patched["Scheduling"]["SlurmQueues"]}
    assert queues["gpu"]["Image"]["CustomAmi"] == QUEUE_AMI
    assert queues["cpu"]["Image"]["CustomAmi"] == NEW_AMI


def test_set_custom_ami_unknown_queue_lists_the_queues() -> None:
    with pytest.raises(UserError, match=r"unknown queue\(s\) gpux; the config's Slurm queues are: gpu, cpu"):
        set_custom_ami(_config(), NEW_AMI, ["gpux"])


def test_set_custom_ami_needs_a_queue_when_queues_given() -> None:
    with pytest.raises(UserError, match="no queue named"):
        set_custom_ami(_config(), NEW_AMI, [])


def test_set_custom_ami_creates_a_missing_image_section() -> None:
    assert set_custom_ami({"Region": "us-east-1"}, NEW_AMI, cluster_wide=True)["Image"] == {
        "CustomAmi": NEW_AMI
    }


def test_set_custom_ami_gives_every_queue_the_image_and_drain_by_default() -> None:
    """Without queues and cluster_wide, every Slurm queue gets the image (the setting ParallelCluster can
    roll on a running cluster) and the config gets QueueUpdateStrategy DRAIN; the cluster-wide image stays."""
    config = _config()
    patched = set_custom_ami(config, NEW_AMI)
    assert [q["Image"]["CustomAmi"] for q in patched["Scheduling"]["SlurmQueues"]] == [NEW_AMI, NEW_AMI]
    assert patched["Image"]["CustomAmi"] == CLUSTER_AMI
    assert patched["Scheduling"]["SlurmSettings"] == {"QueueUpdateStrategy": "DRAIN"}


@pytest.mark.parametrize(
    ("given", "strategy", "expected"),
    [
        ("TERMINATE", None, "TERMINATE"),  # the config's own choice is kept
        ("TERMINATE", "DRAIN", "DRAIN"),  # an explicit one wins
        (None, "COMPUTE_FLEET_STOP", "COMPUTE_FLEET_STOP"),
    ],
)
def test_set_custom_ami_queue_update_strategy(given: str | None, strategy: str | None, expected: str) -> None:
    config = _config()
    if given:
        config["Scheduling"]["SlurmSettings"] = {"QueueUpdateStrategy": given, "ScaledownIdletime": 5}
    patched = set_custom_ami(config, NEW_AMI, ["cpu"], queue_update_strategy=strategy)
    assert patched["Scheduling"]["SlurmSettings"]["QueueUpdateStrategy"] == expected
    with pytest.raises(UserError, match="unknown QueueUpdateStrategy"):
        set_custom_ami(config, NEW_AMI, queue_update_strategy="LATER")


def test_set_custom_ami_cluster_wide_sets_the_os_and_refuses_queues() -> None:
    patched = set_custom_ami(_config(), NEW_AMI, cluster_wide=True, os="ubuntu2404")
    assert patched["Image"] == {"Os": "ubuntu2404", "CustomAmi": NEW_AMI}
    with pytest.raises(UserError, match="not both"):
        set_custom_ami(_config(), NEW_AMI, ["gpu"], cluster_wide=True)


@pytest.mark.parametrize(
    "ami",
    ["ami-123", "ami-0123456789ABCDEF0", "ami-0123456789abcdef", "img-0123456789abcdef0", "", "ami-0123456g"],
)
def test_set_custom_ami_rejects_malformed_ids(ami: str) -> None:
    with pytest.raises(UserError, match="invalid AMI id"):
        set_custom_ami(_config(), ami)


@pytest.mark.parametrize("ami", ["ami-1234abcd", "ami-0123456789abcdef0"])
def test_set_custom_ami_accepts_both_id_lengths(ami: str) -> None:
    patched = set_custom_ami(_config(), ami)
    assert {q["Image"]["CustomAmi"] for q in patched["Scheduling"]["SlurmQueues"]} == {ami}
