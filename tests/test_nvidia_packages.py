"""The gpuforge.gpu.nvidia_driver_packages filter: the driver's apt names in NVIDIA's CUDA repository,
per branch (suffixes dropped from R580 for fabric manager/NSCQ/NVSDM and from R590 for the driver)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from ansible_collections.gpuforge.gpu.plugins.plugin_utils import targets

import sourcefile
from gpuforge import versions

REPO = Path(__file__).resolve().parents[1]
packages = sourcefile.load("nvidia_packages", "plugins/filter/nvidia_packages.py")


def test_r595_names_carry_no_branch_and_are_locked_by_the_pinning_package() -> None:
    names = packages.nvidia_driver_packages(
        "595.91.07", kernel="6.8.0-1021-aws", fabricmanager=True, nvsdm=True
    )
    assert names["probe"] == "nvidia-utils"
    assert names["userspace"] == [
        "nvidia-driver-pinning-595.91.07",
        "nvidia-headless-no-dkms-open=595.91.07-*",
        "nvidia-utils=595.91.07-*",
        "nvidia-compute-utils=595.91.07-*",
        "libnvidia-compute=595.91.07-*",
    ]
    assert names["kernel_module"] == ["linux-headers-6.8.0-1021-aws", "nvidia-dkms-open=595.91.07-*"]
    # Not nvidia-fabricmanager-595 (the name of Ubuntu's archive, tied to the -server driver flavor).
    assert names["fabricmanager"] == [
        "nvidia-fabricmanager=595.91.07-*",
        "libnvidia-nscq=595.91.07-*",
        "libnvsdm=595.91.07-*",
    ]


def test_r580_keeps_driver_suffixes_but_not_the_fabric_managers() -> None:
    """R580 in the CUDA repository: nvidia-fabricmanager-580 is only a virtual package
    (NVIDIA/gpu-driver-container PR #451), the driver packages still carry -580."""
    names = packages.nvidia_driver_packages("580.159.03", fabricmanager=True)
    assert names["probe"] == "nvidia-utils-580"
    assert names["pinning"] == ""
    assert "nvidia-headless-no-dkms-580-open=580.159.03-*" in names["userspace"]
    assert names["fabricmanager"] == ["nvidia-fabricmanager=580.159.03-*", "libnvidia-nscq=580.159.03-*"]


def test_before_r580_every_name_carries_the_branch() -> None:
    names = packages.nvidia_driver_packages(
        "570.195.03", kernel_module="proprietary", fabricmanager=True, nvsdm=True
    )
    assert names["fabricmanager"] == [
        "nvidia-fabricmanager-570=570.195.03-*",
        "libnvidia-nscq-570=570.195.03-*",
        "libnvsdm-570=570.195.03-*",
    ]
    assert names["kernel_module"] == ["nvidia-dkms-570=570.195.03-*"]
    # No NVSDM before R570.
    assert (
        "libnvsdm-550=550.163.01-*"
        not in packages.nvidia_driver_packages("550.163.01", fabricmanager=True, nvsdm=True)["fabricmanager"]
    )


def test_no_fabric_manager_unless_asked() -> None:
    assert packages.nvidia_driver_packages("595.91.07")["fabricmanager"] == []


def test_the_pinned_release_has_names() -> None:
    pin = versions.load().components["nvidia_driver"]["version"]
    names = packages.nvidia_driver_packages(pin, fabricmanager=True)
    assert all(name.endswith(f"={pin}-*") for name in names["fabricmanager"])


@pytest.mark.parametrize(
    ("version", "module"), [("595", "open"), ("latest", "open"), ("595.91.07", "closed")]
)
def test_bad_input_is_refused(version: str, module: str) -> None:
    with pytest.raises(AnsibleFilterError):
        packages.nvidia_driver_packages(version, kernel_module=module)


def test_the_roles_ubuntu_vars_name_the_packages_of_the_branch_in_use(tmp_path: Path) -> None:
    """roles/nvidia_driver/vars/Ubuntu.yml, rendered by Ansible for a 595 driver on a B200 target."""
    play = tmp_path / "play.yml"
    play.write_text(
        "- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n"
        f"    - ansible.builtin.include_vars: {REPO}/roles/nvidia_driver/vars/Ubuntu.yml\n"
        "    - ansible.builtin.debug:\n        msg: \"{{ {'fm': _nvidia_driver_fabricmanager_packages,"
        " 'user': _nvidia_driver_userspace_packages, 'probe': _nvidia_driver_probe_package} | to_json }}\"\n"
    )
    extra = {
        "ansible_facts": {"kernel": "6.8.0-1021-aws"},
        "_nvidia_driver_target_version": "595.91.07",
        "nvidia_driver_version": "595.91.07",
        "nvidia_driver_kernel_module": "open",
        "nvidia_driver_nvlsm_enabled": True,
        "ansible_python_interpreter": sys.executable,
    }
    proc = subprocess.run(
        [
            str(Path(sys.executable).with_name("ansible-playbook")),
            "-i",
            "localhost,",
            "-e",
            json.dumps(extra),
            str(play),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        timeout=300,
        env={
            **os.environ,
            "ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json",
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        },
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout[proc.stdout.index("{") :])["plays"][0]["tasks"][1]["hosts"]["localhost"]
    shown = json.loads(result["msg"])
    assert shown["fm"] == [
        "nvidia-fabricmanager=595.91.07-*",
        "libnvidia-nscq=595.91.07-*",
        "libnvsdm=595.91.07-*",
    ]
    assert shown["probe"] == "nvidia-utils"
    assert shown["user"][0] == "nvidia-driver-pinning-595.91.07"


def test_blackwell_targets_need_the_open_modules() -> None:
    """data/instance_types.yml: B200 runs only on the open kernel modules; H100 on either."""
    data = yaml.safe_load((REPO / "data/instance_types.yml").read_text())
    types, models = data["gpuforge_instance_types"], data["gpuforge_gpu_models"]
    # The collection's plugins/plugin_utils/targets.py (filter gpuforge.gpu.targets_needing_open_modules).
    assert targets.open_modules(["p5.48xlarge", "p6-b200.48xlarge"], types, models) == ["p6-b200.48xlarge"]
    assert targets.open_modules(["p5.48xlarge", "g6.xlarge", "unknown.type"], types, models) == []


def _validate(tmp_path: Path, module: str, targets: list[str]) -> subprocess.CompletedProcess[str]:
    """roles/nvidia_driver/tasks/validate.yml, run by Ansible with the catalog and these inputs."""
    data = yaml.safe_load((REPO / "data/instance_types.yml").read_text())
    play = tmp_path / "validate.yml"
    play.write_text(
        "- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n"
        f"    - ansible.builtin.include_tasks: {REPO}/roles/nvidia_driver/tasks/validate.yml\n"
    )
    extra = {
        "ansible_python_interpreter": sys.executable,
        "ansible_facts": {"distribution": "Ubuntu"},
        "nvidia_driver_version": "595.91.07",
        "nvidia_driver_branch": "595",
        "nvidia_driver_kernel_module": module,
        "gpuforge_targets": targets,
        "gpuforge_instance_types": data["gpuforge_instance_types"],
        "gpuforge_gpu_models": data["gpuforge_gpu_models"],
    }
    return subprocess.run(
        [
            str(Path(sys.executable).with_name("ansible-playbook")),
            "-i",
            "localhost,",
            "-e",
            json.dumps(extra),
            str(play),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        timeout=300,
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")},
    )


def test_the_role_refuses_proprietary_modules_for_a_b200_target(tmp_path: Path) -> None:
    refused = _validate(tmp_path, "proprietary", ["p5.48xlarge", "p6-b200.48xlarge"])
    assert refused.returncode != 0
    assert "p6-b200.48xlarge run only on NVIDIA's open kernel modules" in refused.stdout
    assert _validate(tmp_path, "proprietary", ["p5.48xlarge"]).returncode == 0
    assert _validate(tmp_path, "open", ["p6-b200.48xlarge"]).returncode == 0
