"""gpuforge_common refuses an operating system gpuforge does not support, on a real lab host.

The host is made to look like Ubuntu 20.04 through /etc/os-release (what Ansible's
distribution facts read), then restored.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

if TYPE_CHECKING:
    from conftest import PlaybookRunner

pytestmark = pytest.mark.lab

FAKE_OS_RELEASE = 'NAME="Ubuntu"\nVERSION_ID="20.04"\nID=ubuntu\nID_LIKE=debian\nVERSION_CODENAME=focal\n'


def _lab_ssh(env: dict[str, str], host: str, command: str) -> str:
    out = subprocess.run(
        ["gpuforge-lab", "ssh", "--name", env["GPUFORGE_LAB"], host, "--", command],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    )
    return out.stdout


@pytest.fixture
def focal_host(fleet_lab: dict[str, str]) -> Iterator[str]:
    """A lab host posing as Ubuntu 20.04; yields its inventory name (EC2's private DNS name)."""
    status = subprocess.run(
        ["gpuforge-lab", "status", "--name", fleet_lab["GPUFORGE_LAB"], "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    node = json.loads(status.stdout)["hosts"][1]
    # /etc/os-release is a symlink on Debian: move it aside rather than write through it.
    _lab_ssh(fleet_lab, node["name"], "sudo mv /etc/os-release /etc/os-release.gpuforge-test")
    _lab_ssh(fleet_lab, node["name"], f"printf '{FAKE_OS_RELEASE}' | sudo tee /etc/os-release >/dev/null")
    yield "ip-" + node["ip"].replace(".", "-") + ".ec2.internal"
    _lab_ssh(fleet_lab, node["name"], "sudo mv -f /etc/os-release.gpuforge-test /etc/os-release")


def test_unsupported_os_fails_early_with_a_clear_message(
    fleet_lab: dict[str, str], focal_host: str, run_playbook: PlaybookRunner
) -> None:
    result = run_playbook(
        # Gather afresh and cache nothing: the fake OS must not outlive this test.
        {**fleet_lab, "ANSIBLE_GATHERING": "implicit", "ANSIBLE_CACHE_PLUGIN": "memory"},
        "molecule/default/converge.yml",
        "--limit",
        focal_host,
    )
    assert result.returncode == 2, result.stdout[-2000:]
    assert "gpuforge supports Ubuntu 22.04" in result.stdout
    assert "this host runs Ubuntu 20.04" in result.stdout
    assert "Write the versions manifest" not in result.stdout  # Nothing ran past validation.


def test_one_probe_reads_what_slurm_and_health_ask_of_a_node(
    fleet_lab: dict[str, str], run_playbook: PlaybookRunner, tmp_path: Path
) -> None:
    """gpuforge_common's probe (one round trip) gives the hostname, CPUs and memory setup's hardware
    subset reports (slurm.conf's NodeName line was built from those), the /dev/nvidiaN count and
    whether /opt/parallelcluster exists, on a real host, with the directory and without."""
    play = tmp_path / "probe.yml"
    assert_probe = {
        "ansible.builtin.assert": {
            "that": [
                "gpuforge_node.hostname == ansible_facts.hostname",
                "gpuforge_node.vcpus | int == ansible_facts.processor_vcpus | int",
                "gpuforge_node.memtotal_mb | int == ansible_facts.memtotal_mb | int",
                "gpuforge_gpu_device_nodes | int == _devices.stdout | int",
                "gpuforge_parallelcluster | bool == (pcluster | bool)",
            ]
        }
    }
    tasks = [
        {"ansible.builtin.setup": {"gather_subset": ["min", "hardware"]}},
        {
            "ansible.builtin.command": "sh -c 'ls /dev | grep -c \"^nvidia[0-9][0-9]*$\" || true'",
            "register": "_devices",
            "changed_when": False,
        },
        {
            "ansible.builtin.file": {
                "path": "/opt/parallelcluster",
                "state": "{{ 'directory' if pcluster | bool else 'absent' }}",
            }
        },
        {
            "ansible.builtin.include_role": {"name": "gpuforge.gpu.gpuforge_common"},
            "vars": {"gpuforge_common_manifest_enabled": False},
        },
        assert_probe,
        {"ansible.builtin.file": {"path": "/opt/parallelcluster", "state": "absent"}},
    ]
    play.write_text(yaml.safe_dump([{"hosts": "all", "become": True, "gather_facts": False, "tasks": tasks}]))
    for pcluster in (False, True):
        result = run_playbook(
            {**fleet_lab, "ANSIBLE_CACHE_PLUGIN": "memory"}, str(play), "-e", f"pcluster={pcluster}"
        )
        assert result.returncode == 0, result.stdout[-3000:]
        assert "failed=0" in result.stdout and "unreachable=0" in result.stdout
