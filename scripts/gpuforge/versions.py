"""The versions manifest (versions.yml): load, validate, hash and turn into image tags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from ansible_collections.gpuforge.gpu.plugins.plugin_utils import versions as _rules

from gpuforge import paths
from gpuforge.errors import UserError

# The rules, the digest and its tag (VERSIONS_HASH_TAG) live once, in the collection
# (plugins/plugin_utils/versions.py), which roles/gpuforge_common/tasks/load_data.yml applies through
# the collection's filters; who needs them imports them from there.
TAG_PREFIX = "gpuforge:"


@dataclass(frozen=True)
class Manifest:
    """The parsed manifest: component name -> its pin fields (always including 'version')."""

    components: dict[str, dict[str, str]]

    @property
    def digest(self) -> str:
        """A stable hash of every pin; it changes exactly when a pinned field changes."""
        return _rules.digest(self.components)

    def version(self, component: str) -> str:
        try:
            return self.components[component]["version"]
        except KeyError:
            raise UserError(f"versions.yml pins no component {component!r}") from None

    def image_tags(self) -> dict[str, str]:
        """Tags for a baked AMI: one per component version plus the manifest hash."""
        tags = {f"{TAG_PREFIX}{name}": pins["version"] for name, pins in sorted(self.components.items())}
        tags[_rules.VERSIONS_HASH_TAG] = self.digest
        return tags

    def node_manifest(self) -> dict[str, Any]:
        """What a node records in /etc/gpuforge/manifest.json for the drift check."""
        return {"versions_hash": self.digest, "components": self.components}


def load(path: Path | None = None) -> Manifest:
    """Read and validate versions.yml; raise UserError naming the bad entry."""
    path = path or paths.versions_file()
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"cannot read versions manifest {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("gpuforge_versions"), dict):
        raise UserError(f"{path}: expected a mapping 'gpuforge_versions: {{component: {{version: ...}}}}'")
    for name, pins in data["gpuforge_versions"].items():
        problem = _rules.pin_problem(str(name), pins)
        if problem is not None:
            raise UserError(f"{path}: {problem}")
    return Manifest(_rules.canonical(data["gpuforge_versions"]))
