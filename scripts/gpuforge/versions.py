"""The versions manifest (versions.yml): load, validate, hash and turn into image tags."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpuforge import paths
from gpuforge.errors import UserError
from gpuforge.policy import SOURCES, compare

# A pin is an exact version: dotted numbers, optionally a "-suffix" (dcgm-exporter's "3.3.9-3.6.1").
# roles/gpuforge_common/tasks/load_data.yml applies the same pattern (a test keeps them equal).
VERSION_PATTERN = r"^[0-9]+([.][0-9]+)+(-[0-9A-Za-z.]+)?$"
_VERSION_RE = re.compile(VERSION_PATTERN)
TAG_PREFIX = "gpuforge:"
HASH_TAG = "gpuforge:versions-hash"


@dataclass(frozen=True)
class Manifest:
    """The parsed manifest: component name -> its pin fields (always including 'version')."""

    components: dict[str, dict[str, str]]

    @property
    def digest(self) -> str:
        """A stable hash of every pin; it changes exactly when a pinned field changes."""
        canonical = json.dumps(self.components, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def version(self, component: str) -> str:
        try:
            return self.components[component]["version"]
        except KeyError:
            raise UserError(f"versions.yml pins no component {component!r}") from None

    def image_tags(self) -> dict[str, str]:
        """Tags for a baked AMI: one per component version plus the manifest hash."""
        tags = {f"{TAG_PREFIX}{name}": pins["version"] for name, pins in sorted(self.components.items())}
        tags[HASH_TAG] = self.digest
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
    components: dict[str, dict[str, str]] = {}
    for name, pins in data["gpuforge_versions"].items():
        if not isinstance(pins, dict) or "version" not in pins:
            raise UserError(f"{path}: component {name!r} needs a 'version' field")
        fields = {str(k): str(v) for k, v in pins.items()}
        if not _VERSION_RE.match(fields["version"]):
            raise UserError(
                f"{path}: component {name!r} has version {fields['version']!r}; "
                "pin an exact version such as 1.2.3 (no 'latest', no ranges)"
            )
        _check_policy(path, str(name), fields)
        components[str(name)] = fields
    return Manifest(components)


def _check_policy(path: Path, name: str, fields: dict[str, str]) -> None:
    """Every component states its floor (an exact release, not above the pin), why, and who provides it.

    roles/gpuforge_common/tasks/load_data.yml asserts the same on hosts.
    """
    floor = fields.get("floor", "")
    if not _VERSION_RE.match(floor):
        raise UserError(f"{path}: component {name!r} needs a 'floor': the oldest acceptable exact release")
    if compare(floor, fields["version"]) > 0:
        raise UserError(f"{path}: component {name!r} has floor {floor} above its version {fields['version']}")
    if not fields.get("floor_reason", "").strip():
        raise UserError(f"{path}: component {name!r} needs a 'floor_reason' saying why {floor} is the floor")
    if fields.get("provided_by") not in SOURCES:
        raise UserError(f"{path}: component {name!r} needs 'provided_by': {' or '.join(SOURCES)}")
