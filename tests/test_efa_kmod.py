"""The gpuforge.gpu.efa_kmod filter: the efa role skips the installer's kernel module exactly on a container.

The facts are what Ansible's Linux virtual facts report (ansible-core
lib/ansible/module_utils/facts/virtual/linux.py): a systemd-nspawn lab host, a Docker container
(this control host reports exactly the Docker case), and EC2 instances (sys_vendor 'Amazon EC2'
gives kvm). The last test reads the role itself: its default is auto and the installer's flag
follows the decision, not the raw variable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.errors import AnsibleFilterError

import sourcefile

efa_kmod = sourcefile.load("efa_kmod", "plugins/filter/efa_kmod.py")
REPO = Path(__file__).resolve().parents[1]

NSPAWN = {  # /proc/1/environ container=systemd-nspawn, /run/systemd/container
    "virtualization_role": "guest",
    "virtualization_type": "container",
    "virtualization_tech_guest": ["container", "systemd-nspawn"],
    "virtualization_tech_host": [],
}
DOCKER = {
    "virtualization_role": "guest",
    "virtualization_type": "docker",
    "virtualization_tech_guest": ["container", "docker"],
    "virtualization_tech_host": ["kvm"],
}
EC2_NITRO = {
    "virtualization_role": "guest",
    "virtualization_type": "kvm",
    "virtualization_tech_guest": ["kvm"],
    "virtualization_tech_host": [],
}
EC2_XEN = {
    "virtualization_role": "guest",
    "virtualization_type": "xen",
    "virtualization_tech_guest": ["xen"],
    "virtualization_tech_host": [],
}
METAL = {  # a *.metal instance: no hypervisor below the OS
    "virtualization_role": "NA",
    "virtualization_type": "NA",
    "virtualization_tech_guest": [],
    "virtualization_tech_host": [],
}


@pytest.mark.parametrize(
    ("facts", "kind"),
    [
        (NSPAWN, "systemd-nspawn"),
        (DOCKER, "docker"),
        ({**NSPAWN, "virtualization_type": "systemd-nspawn"}, "systemd-nspawn"),
        ({**DOCKER, "virtualization_type": "lxc", "virtualization_tech_guest": ["container", "lxc"]}, "lxc"),
        ({**DOCKER, "virtualization_type": "podman", "virtualization_tech_guest": ["podman"]}, "podman"),
    ],
)
def test_auto_skips_the_kernel_module_in_a_container(facts: dict[str, Any], kind: str) -> None:
    decision = efa_kmod.efa_kmod("auto", facts)
    assert decision["skip"] is True
    assert f"a {kind} container" in decision["reason"]
    assert "shares its host's kernel" in decision["reason"]


@pytest.mark.parametrize("facts", [EC2_NITRO, EC2_XEN, METAL], ids=["nitro", "xen", "metal"])
def test_auto_installs_the_kernel_module_on_a_vm_or_bare_metal(facts: dict[str, Any]) -> None:
    decision = efa_kmod.efa_kmod("auto", facts)
    assert decision["skip"] is False
    assert "kernel of its own" in decision["reason"]


@pytest.mark.parametrize(
    ("setting", "facts", "skip"),
    [(True, EC2_NITRO, True), ("false", NSPAWN, False), ("yes", EC2_NITRO, True), (False, DOCKER, False)],
)
def test_an_explicit_setting_wins_over_the_host(setting: Any, facts: dict[str, Any], skip: bool) -> None:
    decision = efa_kmod.efa_kmod(setting, facts)
    assert decision == {"skip": skip, "reason": f"efa_installer_skip_kmod is set to {str(skip).lower()}"}


def test_auto_without_the_virtual_facts_is_refused_clearly() -> None:
    with pytest.raises(AnsibleFilterError, match="gather the 'virtual' fact subset"):
        efa_kmod.efa_kmod("auto", {"distribution": "Ubuntu"})


def test_a_setting_that_is_not_auto_true_or_false_is_refused() -> None:
    with pytest.raises(AnsibleFilterError, match="must be auto, true or false, got 'sometimes'"):
        efa_kmod.efa_kmod("sometimes", EC2_NITRO)


def test_the_role_defaults_to_auto_and_passes_the_decision_to_the_installer() -> None:
    defaults = yaml.safe_load((REPO / "roles/efa/defaults/main.yml").read_text())
    assert defaults["efa_installer_skip_kmod"] == "auto"
    specs = yaml.safe_load((REPO / "roles/efa/meta/argument_specs.yml").read_text())
    assert specs["argument_specs"]["main"]["options"]["efa_installer_skip_kmod"]["default"] == "auto"
    install = yaml.safe_load((REPO / "roles/efa/tasks/install.yml").read_text())
    decide = next(t for t in install if t["name"].startswith("Decide whether the installer installs"))
    assert "gpuforge.gpu.efa_kmod(ansible_facts)" in decide["ansible.builtin.set_fact"]["_efa_kmod"]
    verified = (REPO / "roles/efa/tasks/install_verified.yml").read_text()
    assert "['--skip-kmod'] if _efa_kmod.skip" in verified
    assert "efa_installer_skip_kmod" not in verified
