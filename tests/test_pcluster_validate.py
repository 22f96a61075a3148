"""gpuforge.pcluster.validate: aws-parallelcluster's own schema, run offline (no AWS, not even moto)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest

from gpuforge.errors import UserError
from gpuforge.pcluster.validate import error_lines, supported_regions, validate

# Offline: any botocore API call fails the test (conftest.no_aws).
pytestmark = pytest.mark.usefixtures("no_aws")


def valid_config() -> dict[str, Any]:
    """A hand-written ParallelCluster 3 config using the sections gpuforge generates, plus login nodes."""
    subnet = "subnet-0123456789abcdef0"
    return {
        "Region": "us-west-2",
        "Image": {"Os": "ubuntu2204", "CustomAmi": "ami-0123456789abcdef0"},
        "HeadNode": {
            "InstanceType": "c5.2xlarge",
            "Networking": {"SubnetId": subnet},
            "Ssh": {"KeyName": "gpuforge"},
            "CustomActions": {
                "OnNodeConfigured": {"Script": "s3://bucket/pull.sh", "Args": ["-t", "configure"]}
            },
        },
        "LoginNodes": {
            "Pools": [
                {
                    "Name": "login",
                    "InstanceType": "c5.large",
                    "Count": 1,
                    "Networking": {"SubnetIds": [subnet]},
                    "Image": {"CustomAmi": "ami-0123456789abcdef1"},
                }
            ]
        },
        "Scheduling": {
            "Scheduler": "slurm",
            "SlurmSettings": {"CustomSlurmSettings": [{"PrivateData": "cloud"}]},
            "SlurmQueues": [
                {
                    "Name": "gpu",
                    "ComputeResources": [
                        {
                            "Name": "p5",
                            "InstanceType": "p5.48xlarge",
                            "MinCount": 0,
                            "MaxCount": 2,
                            "Efa": {"Enabled": True},
                            "HealthChecks": {"Gpu": {"Enabled": True}},
                        }
                    ],
                    "Networking": {"SubnetIds": [subnet], "PlacementGroup": {"Enabled": True}},
                }
            ],
        },
        "SharedStorage": [
            {
                "Name": "fsx",
                "StorageType": "FsxLustre",
                "MountDir": "/fsx",
                "FsxLustreSettings": {"FileSystemId": "fs-0123456789abcdef0"},
            }
        ],
    }


def test_accepts_a_correct_config() -> None:
    config = valid_config()
    before = copy.deepcopy(config)
    validate(config)
    assert config == before, "validation leaves the config untouched"


def test_rejects_missing_scheduling_and_misspelt_key() -> None:
    config = valid_config()
    del config["Scheduling"]
    config["HeadNode"]["InstanceTyp"] = config["HeadNode"].pop("InstanceType")
    with pytest.raises(UserError) as info:
        validate(config)
    message = str(info.value)
    assert "Scheduling: Missing data for required field." in message
    assert "HeadNode.InstanceTyp: Unknown field." in message
    assert "HeadNode.InstanceType: Missing data for required field." in message


def test_error_paths_name_list_items() -> None:
    config = valid_config()
    resource = config["Scheduling"]["SlurmQueues"][0]["ComputeResources"][0]
    resource["MaxCount"] = 0
    resource["Efa"]["Enabled"] = "sometimes"
    config["SharedStorage"][0]["FsxLustreSettings"]["FileSystemId"] = "fs-1"
    with pytest.raises(UserError) as info:
        validate(config)
    message = str(info.value)
    assert "Scheduling.SlurmQueues[0].ComputeResources[0].MaxCount:" in message
    assert "Scheduling.SlurmQueues[0].ComputeResources[0].Efa.Enabled: Not a valid boolean." in message
    assert (
        "SharedStorage[0].FsxLustreSettings.FileSystemId: String does not match expected pattern." in message
    )


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("Image", "Os"), "windows"),
        (("Image", "CustomAmi"), "ami-xyz"),
        (("HeadNode", "Networking", "SubnetId"), "sn-123"),
        (("Scheduling", "Scheduler"), "pbs"),
    ],
)
def test_rejects_bad_values(path: tuple[str, ...], value: str) -> None:
    config = valid_config()
    target = config
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(UserError, match=".".join(path)):
        validate(config)


def test_region_comes_from_the_config_and_env_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    validate(valid_config())
    assert os.environ["AWS_DEFAULT_REGION"] == "eu-west-1"


def test_missing_region_falls_back_to_env_or_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    config = valid_config()
    del config["Region"]
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    validate(config)
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    with pytest.raises(UserError, match="no Region"):
        validate(config)
    assert "AWS_DEFAULT_REGION" not in os.environ


def test_rejects_an_unsupported_region() -> None:
    config = valid_config()
    config["Region"] = "mars-north-1"
    with pytest.raises(UserError, match="not a region ParallelCluster supports"):
        validate(config)


def test_supported_regions_come_from_the_package() -> None:
    regions = supported_regions()
    assert {"us-east-1", "us-west-2", "eu-west-1"} <= regions
    assert all(r and r == r.strip() for r in regions)


def test_error_lines_flatten_nested_messages() -> None:
    messages = {"A": {0: {"B": ["bad"]}, "_schema": ["whole A"]}, "C": ["missing"]}
    assert error_lines(messages) == ["A[0].B: bad", "A: whole A", "C: missing"]


def _secured(config: dict[str, Any]) -> dict[str, Any]:
    """valid_config() with every security setting stated, as `cluster-config generate` writes them."""
    config["Imds"] = {"ImdsSupport": "v2.0"}
    config["HeadNode"]["Imds"] = {"Secured": True}
    config["HeadNode"]["LocalStorage"] = {"RootVolume": {"Encrypted": True}}
    for queue in config["Scheduling"]["SlurmQueues"]:
        queue["ComputeSettings"] = {"LocalStorage": {"RootVolume": {"Encrypted": True, "Size": 200}}}
    return config


def test_accepts_security_settings_stated_or_left_to_defaults() -> None:
    validate(_secured(valid_config()))
    validate(valid_config())


HEAD_ROOT = "HeadNode.LocalStorage.RootVolume.Encrypted"
QUEUE_ROOT = "Scheduling.SlurmQueues[0].ComputeSettings.LocalStorage.RootVolume.Encrypted"

# (path to set, weak value, the error line's start, what it must tell the user to set)
WEAKENED = [
    (("Imds", "ImdsSupport"), "v1.0", "Imds.ImdsSupport: v1.0 ", "set ImdsSupport: v2.0"),
    (
        ("HeadNode", "LocalStorage", "RootVolume", "Encrypted"),
        False,
        f"{HEAD_ROOT}: false ",
        "Encrypted: true",
    ),
    (
        ("Scheduling", "SlurmQueues", 0, "ComputeSettings", "LocalStorage", "RootVolume", "Encrypted"),
        False,
        f"{QUEUE_ROOT}: false ",
        "Encrypted: true",
    ),
]


@pytest.mark.parametrize(
    ("path", "value", "line", "fix"), WEAKENED, ids=[w[2].split(":")[0] for w in WEAKENED]
)
def test_rejects_a_config_that_turns_security_off(
    path: tuple[Any, ...], value: Any, line: str, fix: str
) -> None:
    config = _secured(valid_config())
    target: Any = config
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(UserError) as info:
        validate(config)
    message = str(info.value)
    assert message.startswith("the cluster config turns off a security default:\n"), message
    (error,) = message.splitlines()[1:]
    assert error.strip().startswith(line), error
    assert fix in error


def test_lists_every_weakened_setting_at_once() -> None:
    """One run names each setting to change, the second queue's by its own index."""
    config = _secured(valid_config())
    queues = config["Scheduling"]["SlurmQueues"]
    queues.append(copy.deepcopy(queues[0]) | {"Name": "gpu2"})
    config["Imds"]["ImdsSupport"] = "v1.0"
    config["HeadNode"]["LocalStorage"]["RootVolume"]["Encrypted"] = False
    queues[1]["ComputeSettings"]["LocalStorage"]["RootVolume"]["Encrypted"] = False
    with pytest.raises(UserError) as info:
        validate(config)
    fields = [line.strip().split(":")[0] for line in str(info.value).splitlines()[1:]]
    assert fields == ["Imds.ImdsSupport", HEAD_ROOT, QUEUE_ROOT.replace("[0]", "[1]")]


def test_cli_validate_exits_2_naming_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuforge import cli
    from gpuforge.pcluster.config import dump_config

    # Only this feature's commands, as in test_pcluster_cli.py, so other modules cannot break this test.
    monkeypatch.setattr(cli, "_COMMAND_MODULES", ("gpuforge.commands.cluster_config",))
    config = _secured(valid_config())
    config["Imds"]["ImdsSupport"] = "v1.0"
    path = tmp_path / "cluster.yml"
    dump_config(config, path)
    assert cli.main(["cluster-config", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpuforge: error: the cluster config turns off a security default:")
    assert "Imds.ImdsSupport: v1.0" in err
