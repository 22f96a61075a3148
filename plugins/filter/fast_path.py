"""Ansible filter gpuforge.gpu.fast_path: may this node skip the install phase (the golden fast path)?

playbooks/bake.yml's first play reads the node's manifest and asks:

    "{{ gpuforge_previous_manifest | gpuforge.gpu.fast_path(gpuforge_versions_hash, gpuforge_instance_type,
        full_install=gpuforge_full_install) }}"  ->  [golden (bool), why]

The decision is plugins/plugin_utils/fast_path.py, which the CLI imports too. Its install revision
is recorded by the manifest's writer through gpuforge.gpu.completed_install, so it is defined once:

    {{ gpuforge_versions_hash | gpuforge.gpu.completed_install(gpuforge_targets) }}
      ->  {"versions_hash": ..., "targets": [...], "install_revision": INSTALL_REVISION}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible.module_utils.parsing.convert_bool import boolean
from ansible_collections.gpuforge.gpu.plugins.plugin_utils.fast_path import completed, decide


def fast_path(
    manifest: Any, versions_hash: Any, instance_type: Any = "", full_install: Any = False
) -> list[Any]:
    """[whether the node is golden, why or why not]."""
    if manifest is not None and not isinstance(manifest, Mapping):
        raise AnsibleFilterError("fast_path: pass the node's manifest as read back ({} when there is none)")
    if not isinstance(versions_hash, str) or not versions_hash:
        raise AnsibleFilterError("fast_path: pass the current pins' hash (gpuforge_versions_hash)")
    golden, why = decide(
        manifest,
        versions_hash,
        "" if instance_type is None else str(instance_type),
        full_install=boolean(full_install, strict=False),
    )
    return [golden, why]


def completed_install(versions_hash: Any, targets: Any) -> dict[str, Any]:
    """The manifest's `completed` entry for an install phase run to its end (with the install revision
    of plugins/plugin_utils/fast_path.py)."""
    if not isinstance(versions_hash, str) or not versions_hash:
        raise AnsibleFilterError("completed_install: pass the current pins' hash (gpuforge_versions_hash)")
    if not isinstance(targets, list):
        raise AnsibleFilterError(
            "completed_install: pass the targets as a list of instance types (gpuforge_targets), "
            f"not {targets!r}"
        )
    return completed(versions_hash, [str(name) for name in targets])


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict[str, Any]:
        return {"fast_path": fast_path, "completed_install": completed_install}
