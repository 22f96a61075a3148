"""Ansible filter: whether the EFA installer must skip its kernel module on this host, and why.

The installer's kernel module step (efa-driver-dkms) builds and loads a module into the running
kernel. A container (systemd-nspawn, Docker, LXC, Podman, ...) shares its host's kernel and may not
load modules, so there the module belongs to the host and the installer runs with --skip-kmod, as
AWS's own container images do (aws-samples/awsome-distributed-training,
micro-benchmarks/nccl-tests/nccl-tests.Dockerfile at 0162aacd, "Install EFA installer" step:
`./efa_installer.sh -y -g -d --skip-kmod --skip-limit-conf --no-verify`). A virtual machine (every EC2
instance type gpuforge targets: Nitro, which Ansible reports as kvm) or bare metal has a kernel of its
own, and the module is installed.

    efa_installer_skip_kmod: auto   # or true / false to decide by hand
    _efa_kmod: "{{ efa_installer_skip_kmod | gpuforge.gpu.efa_kmod(ansible_facts) }}"

The host is judged by Ansible's own virtual facts (ansible-core lib/ansible/module_utils/facts/
virtual/linux.py, 2.19: a container sets virtualization_role 'guest', virtualization_type one of
the container kinds below, and adds 'container' to virtualization_tech_guest; EC2's sys_vendor
'Amazon EC2' gives type 'kvm'). Nothing here reads a lab variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError

# virtualization_type values Ansible's Linux virtual facts give a container (linux.py, 2.19): from
# /proc/1/cgroup, /proc/1/environ (container=...), /proc/vz, /run/systemd/container, /.dockerenv.
CONTAINER_TYPES = frozenset(
    {"docker", "lxc", "podman", "containerd", "container", "openvz", "systemd-nspawn", "lxc-libvirt", "rkt"}
)
_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})


def _explicit(setting: Any) -> bool | None:
    """True/False for an explicit setting, None for 'auto'; anything else is refused."""
    if isinstance(setting, bool):
        return setting
    text = str(setting).strip().lower()
    if text == "auto":
        return None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise AnsibleFilterError(
        f"efa_kmod: efa_installer_skip_kmod must be auto, true or false, got {setting!r}"
    )


def container_kind(facts: Mapping[str, Any]) -> str | None:
    """The kind of container the host is ('systemd-nspawn', 'docker', ...), or None for a VM or bare metal."""
    missing = [key for key in ("virtualization_role", "virtualization_type") if key not in facts]
    if missing:
        raise AnsibleFilterError(
            f"efa_kmod: ansible_facts lacks {', '.join(missing)}; gather the 'virtual' fact subset first"
        )
    if facts["virtualization_role"] != "guest":
        return None
    kind = str(facts["virtualization_type"])
    guest_tech = [str(tech) for tech in facts.get("virtualization_tech_guest") or []]
    if kind not in CONTAINER_TYPES and "container" not in guest_tech:
        return None
    # /proc/1/environ's generic container=... gives type 'container'; the tech list may name the kind.
    named = sorted(tech for tech in guest_tech if tech in CONTAINER_TYPES and tech != "container")
    return kind if kind != "container" else (named[0] if named else kind)


def efa_kmod(setting: Any, facts: Mapping[str, Any]) -> dict[str, Any]:
    """{'skip': bool, 'reason': str}: whether to pass --skip-kmod, and why, for the setting `setting`."""
    explicit = _explicit(setting)
    if explicit is not None:
        return {
            "skip": explicit,
            "reason": f"efa_installer_skip_kmod is set to {str(explicit).lower()}",
        }
    if not isinstance(facts, Mapping):
        raise AnsibleFilterError("efa_kmod: the argument is ansible_facts, a dict")
    kind = container_kind(facts)
    if kind is not None:
        return {
            "skip": True,
            "reason": (
                f"this host is a {kind} container: it shares its host's kernel, so the EFA kernel module "
                "belongs to that host and the installer runs with --skip-kmod"
            ),
        }
    if facts["virtualization_role"] == "guest":
        where = f"a {facts['virtualization_type']} virtual machine"
    else:
        where = "not a guest (bare metal or a hypervisor host)"
    return {
        "skip": False,
        "reason": (
            f"this host is {where} with a kernel of its own: the installer installs the EFA kernel module"
        ),
    }


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict[str, Any]:
        return {"efa_kmod": efa_kmod}
