"""The versions manifest's rules (versions.yml): what an exact pin is, the policy every pin states,
and the digest of the pins that nodes, AMI tags and the CLI compare.

The one implementation: the roles call it through the filters gpuforge.gpu.versions_bad_pins and
gpuforge.gpu.versions_digest (plugins/filter/versions.py), the CLI through gpuforge.versions.

Pure Python (no Ansible import).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from ansible_collections.gpuforge.gpu.plugins.plugin_utils.policy import SOURCES, compare

# A pin is an exact version: dotted numbers, optionally a "-suffix" (dcgm-exporter's "3.3.9-3.6.1").
VERSION_PATTERN = r"^[0-9]+([.][0-9]+)+(-[0-9A-Za-z.]+)?$"
# The image tag carrying digest(): written by the CLI at bake time, read by the drift check.
VERSIONS_HASH_TAG = "gpuforge:versions-hash"
_VERSION_RE = re.compile(VERSION_PATTERN)


def is_exact(version: Any) -> bool:
    """Whether `version` is an exact release string (a YAML number such as 12.8 is not: quote it)."""
    return isinstance(version, str) and _VERSION_RE.match(version) is not None


def pin_problem(name: str, pin: Any) -> str | None:
    """What is wrong with one component's entry, or None: an exact version, an exact floor not above
    it, the floor's reason, and who provides the component (base_image or gpuforge)."""
    if not isinstance(pin, Mapping) or "version" not in pin:
        return f"component {name!r} needs a 'version' field"
    version = pin["version"]
    if not is_exact(version):
        return (
            f"component {name!r} has version {version!r}; "
            "pin an exact version such as 1.2.3 (no 'latest', no ranges)"
        )
    floor = pin.get("floor")
    if not isinstance(floor, str) or not is_exact(floor):
        return f"component {name!r} needs a 'floor': the oldest acceptable exact release"
    if compare(floor, version) > 0:
        return f"component {name!r} has floor {floor} above its version {version}"
    if not str(pin.get("floor_reason") or "").strip():
        return f"component {name!r} needs a 'floor_reason' saying why {floor} is the floor"
    if pin.get("provided_by") not in SOURCES:
        return f"component {name!r} needs 'provided_by': {' or '.join(SOURCES)}"
    return None


def bad_pins(components: Mapping[str, Any]) -> list[str]:
    """The components whose entry breaks a rule, sorted by name."""
    return [str(name) for name in sorted(components, key=str) if pin_problem(str(name), components[name])]


def canonical(components: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """The pins with every name and field as a string, as the CLI reads them."""
    return {str(name): {str(k): str(v) for k, v in pins.items()} for name, pins in components.items()}


def digest(components: Mapping[str, Mapping[str, Any]]) -> str:
    """A stable hash of every pin (sha256 of the sorted, compact JSON); it changes exactly when a pinned
    field changes."""
    text = json.dumps(canonical(components), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
