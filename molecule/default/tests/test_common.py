"""Verifier for gpuforge_common on lab hosts: real files and real hardware detection."""

from __future__ import annotations

import json

import pytest

from gpuforge import versions

testinfra_hosts = ["all"]


def test_manifest_matches_versions_yml(host):
    """manifest.json (schema 2, docs/manifest.md) carries every pin and the same hash the AMI tags carry."""
    manifest_file = host.file("/etc/gpuforge/manifest.json")
    assert manifest_file.exists
    manifest = json.loads(manifest_file.content_string)
    expected = versions.load()
    assert manifest["schema"] == 2
    assert manifest["pins"] == expected.components
    # gpuforge_common alone decides about no component: nothing installed is recorded.
    assert manifest["installed"] == {}
    assert manifest["versions_hash"] == expected.digest


@pytest.mark.parametrize(
    ("path", "is_dir", "mode"),
    [
        ("/etc/gpuforge", True, 0o755),
        ("/etc/gpuforge/manifest.json", False, 0o644),
        ("/etc/gpuforge/hardware.json", False, 0o644),
    ],
)
def test_gpuforge_files_are_root_owned_and_not_writable_by_others(host, path, is_dir, mode):
    """The records other roles and the drift report trust: root:root with the mode the role sets
    (roles/gpuforge_common/tasks/manifest.yml), so no other user can change what they claim."""
    managed = host.file(path)
    assert managed.is_directory if is_dir else managed.is_file
    assert (managed.user, managed.group) == ("root", "root")
    assert managed.mode == mode


@pytest.mark.parametrize(
    ("instance_type", "gpus", "efa"), [("c5n.large", 0, 0), ("p5.48xlarge", 8, 32)], ids=["head", "compute"]
)
def test_hardware_record_says_not_present(host, instance_type, gpus, efa):
    """The lab has no GPU or EFA: the record says so next to what the instance type expects."""
    record = json.loads(host.file("/etc/gpuforge/hardware.json").content_string)
    if record["instance_type"] != instance_type:
        pytest.skip(f"this host is a {record['instance_type']}")
    assert not host.file("/dev/nvidia0").exists
    assert record["gpu_present"] is False and record["gpu_count"] == 0
    assert record["efa_present"] is False and record["efa_count"] == 0
    assert record["gpu_expected"] == gpus
    assert record["efa_expected"] == efa


def test_hostname_is_the_lab_host(host):
    """Each platform is a distinct lab host with its own hostname."""
    name = host.check_output("hostname")
    assert name.startswith(("ip-10-213-", "gpu-st-"))
