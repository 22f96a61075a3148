"""The node manifest, /etc/gpuforge/manifest.json, for the CLI: read the file, with its errors as UserError.

The reader, the tag format and the drift comparison live once, in the collection
(plugins/plugin_utils/manifest.py, installed with the wheel as ansible_collections.gpuforge.gpu);
the roles call the same code through the filters gpuforge.gpu.node_manifest (read_manifest.yml) and
gpuforge.gpu.manifest_drift (playbooks/drift.yml). The golden fast path's decision over a manifest
lives once too, in plugins/plugin_utils/fast_path.py. Who needs their names (NodeManifest,
INSTALL_REVISION, ...) imports them from there. The schema is documented in docs/manifest.md and in
the collection module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ansible_collections.gpuforge.gpu.plugins.plugin_utils import fast_path as _fast_path
from ansible_collections.gpuforge.gpu.plugins.plugin_utils import manifest as _manifest
from ansible_collections.gpuforge.gpu.plugins.plugin_utils.manifest import NodeManifest

from gpuforge.errors import UserError

PATH = Path("/etc/gpuforge/manifest.json")


def parse(data: Any, where: str = "manifest.json") -> NodeManifest:
    """A manifest from its JSON data; schema 1 (pins under 'components', no 'installed') is accepted."""
    try:
        return _manifest.parse(data, where)
    except _manifest.ManifestError as exc:
        raise UserError(str(exc)) from None


def load(path: Path = PATH) -> NodeManifest:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read node manifest {path}: {exc}") from exc
    return parse(data, str(path))


def fast_path(
    node: NodeManifest | None, versions_hash: str, instance_type: str, *, full_install: bool = False
) -> tuple[bool, str]:
    """Whether a node may skip the install phase (the golden fast path), and why or why not.

    `node` is None where the manifest is missing or unreadable. The decision is the collection's
    (plugins/plugin_utils/fast_path.py), the one the bake play makes through the filter
    gpuforge.gpu.fast_path.
    """
    return _fast_path.decide(
        None if node is None else node.as_dict(), versions_hash, instance_type, full_install=full_install
    )
