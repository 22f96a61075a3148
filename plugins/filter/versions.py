"""Ansible filters gpuforge.gpu.versions_bad_pins and gpuforge.gpu.versions_digest: the versions
manifest's rules and its digest, for gpuforge_common's load_data.yml:

    that: gpuforge_versions | gpuforge.gpu.versions_bad_pins | length == 0
    gpuforge_versions_hash: "{{ gpuforge_versions | gpuforge.gpu.versions_digest }}"

The rules are plugins/plugin_utils/versions.py, which the CLI imports too (gpuforge.versions), so
nodes, AMI tags and the CLI compute the same hash.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.gpuforge.gpu.plugins.plugin_utils.versions import bad_pins, digest


def _components(versions: Any, who: str) -> Mapping[str, Any]:
    if not isinstance(versions, Mapping):
        raise AnsibleFilterError(f"{who}: pass gpuforge_versions (component -> its pin fields)")
    return versions


def versions_bad_pins(versions: Any) -> list[str]:
    """The components whose pin breaks a rule of the versions manifest."""
    return bad_pins(_components(versions, "versions_bad_pins"))


def versions_digest(versions: Any) -> str:
    """The pins' sha256, as gpuforge.versions.Manifest.digest."""
    components = _components(versions, "versions_digest")
    if not all(isinstance(pins, Mapping) for pins in components.values()):
        raise AnsibleFilterError("versions_digest: every component needs its pin fields (a mapping)")
    return digest(components)


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict[str, Any]:
        return {"versions_bad_pins": versions_bad_pins, "versions_digest": versions_digest}
