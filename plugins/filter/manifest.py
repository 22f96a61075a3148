"""Ansible filters over the node manifest, /etc/gpuforge/manifest.json (plugins/plugin_utils/manifest.py,
which the CLI's gpuforge.node_manifest imports too); documented in node_manifest.yml and
manifest_drift.yml beside this file.

gpuforge.gpu.node_manifest: the manifest as read back, from what ansible.builtin.slurp returned
(roles/gpuforge_common/tasks/read_manifest.yml sets gpuforge_previous_manifest with it):

    "{{ _gpuforge_common_manifest_raw | gpuforge.gpu.node_manifest(where=path) }}"
      ->  the schema-2 form ({schema, versions_hash, pins, installed, ...}), {} when there is no file

gpuforge.gpu.manifest_drift: playbooks/drift.yml's comparison of that manifest with the node's image
tags and the current pins:

    "{{ gpuforge_previous_manifest
        | gpuforge.gpu.manifest_drift(tags, gpuforge_versions, gpuforge_versions_hash) }}"
      ->  {node, image, current, node_matches_image, node_matches_current, installed_vs_image, below_floor}
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.gpuforge.gpu.plugins.plugin_utils import manifest


def _fix(where: str) -> str:
    return f"fix or remove {where} (the next bake writes it again)"


def node_manifest(slurped: Any, where: str = "manifest.json") -> dict[str, Any]:
    """The manifest ansible.builtin.slurp read, in its schema-2 form; {} when it read none (no file,
    or one it could not read: a node never baked by gpuforge). A file that is not a manifest fails."""
    if not isinstance(slurped, Mapping):
        raise AnsibleFilterError("node_manifest: pass what ansible.builtin.slurp registered for the manifest")
    content = slurped.get("content")
    if content is None:
        return {}
    try:
        text = base64.b64decode(str(content), validate=True).decode("utf-8")
        return manifest.loads(text, str(where)).as_dict()
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise AnsibleFilterError(
            f"node_manifest: {where}: unreadable content ({exc}); {_fix(str(where))}"
        ) from None
    except manifest.ManifestError as exc:
        raise AnsibleFilterError(f"node_manifest: {exc}; {_fix(str(where))}") from None


def manifest_drift(node: Any, image_tags: Any, pins: Any, pins_hash: Any) -> dict[str, Any]:
    """The drift report of the node's manifest as read back ({} for none) against its image's tags
    ({} for no image) and the current pins (gpuforge_versions, gpuforge_versions_hash)."""
    if not isinstance(node, Mapping):
        raise AnsibleFilterError("manifest_drift: pass gpuforge_previous_manifest ({} when there is none)")
    if not isinstance(image_tags, Mapping) or not isinstance(pins, Mapping):
        raise AnsibleFilterError("manifest_drift: pass the image's tags ({} for none) and gpuforge_versions")
    if not isinstance(pins_hash, str) or not pins_hash:
        raise AnsibleFilterError("manifest_drift: pass the current pins' hash (gpuforge_versions_hash)")
    try:
        parsed = manifest.parse(node, "gpuforge_previous_manifest") if node else None
    except manifest.ManifestError as exc:
        raise AnsibleFilterError(f"manifest_drift: {exc}; read it with gpuforge.gpu.node_manifest") from None
    return manifest.drift(parsed, {str(k): str(v) for k, v in image_tags.items()}, pins, pins_hash)


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict[str, Any]:
        return {"node_manifest": node_manifest, "manifest_drift": manifest_drift}
