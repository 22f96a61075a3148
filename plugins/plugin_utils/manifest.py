"""The node manifest, /etc/gpuforge/manifest.json: read it, turn it into image tags, and compare it
with its image and the current pins (the drift check), once.

One writer (roles/gpuforge_common/tasks/manifest.yml); one reader, this module: the roles call it
through the filters of plugins/filter/manifest.py (read_manifest.yml: gpuforge.gpu.node_manifest,
playbooks/drift.yml: gpuforge.gpu.manifest_drift), the CLI imports it through gpuforge.node_manifest.
The schema is documented in docs/manifest.md:

    {"schema": 2,
     "versions_hash": "<sha256 of versions.yml's pins, as gpuforge.versions.Manifest.digest>",
     "pins": {"<component>": {"version": ..., "floor": ..., ...}},       # versions.yml as baked
     "installed": {"<component>": {"version": "580.105.08", "source": "base_image" | "gpuforge",
                                   "digest": "sha256:..."}},   # digest: only for what has one
     "targets": ["p5.48xlarge", ...],                          # the instance types it is for
     "completed": {"versions_hash": "...", "targets": [...]}}  # the last install phase run to its end

Other keys may be added by later schema versions' writers; readers ignore what they do not know.
Pure Python (no Ansible import): errors are ManifestError (a ValueError), which the filters turn
into AnsibleFilterError and the CLI into its UserError.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Releases compare as the version policy compares them (the drift check's "below the floor").
from ansible_collections.gpuforge.gpu.plugins.plugin_utils.policy import SOURCES, compare
from ansible_collections.gpuforge.gpu.plugins.plugin_utils.versions import VERSIONS_HASH_TAG

SCHEMA = 2
# One AMI tag per installed component: "gpuforge:installed:<component>" = "<version>/<source>[@<digest>]".
INSTALLED_TAG_PREFIX = "gpuforge:installed:"


class ManifestError(ValueError):
    """A manifest that is not one: the message names the file and what is wrong."""


@dataclass(frozen=True)
class Installed:
    version: str
    source: str  # base_image or gpuforge
    digest: str = ""  # the content digest where the component has one (the dcgm-exporter image)

    @property
    def tag_value(self) -> str:
        """The AMI tag value, and the node's side of the drift check's comparison with it."""
        return f"{self.version}/{self.source}" + (f"@{self.digest}" if self.digest else "")

    def as_dict(self) -> dict[str, str]:
        out = {"version": self.version, "source": self.source}
        if self.digest:
            out["digest"] = self.digest
        return out


@dataclass(frozen=True)
class Completed:
    """What the last install phase that ran to its end installed for: the pins' hash and the targets.

    Written only by playbooks/bake.yml's last task, so an install phase that stopped half-way (the
    first write of the manifest already carries the new pins) never makes a node look golden.
    """

    versions_hash: str
    targets: tuple[str, ...]
    # What that install phase covered beyond the pins (INSTALL_REVISION); 1 where not recorded.
    install_revision: int = 1


@dataclass(frozen=True)
class NodeManifest:
    versions_hash: str
    pins: dict[str, dict[str, str]] = field(default_factory=dict)
    installed: dict[str, Installed] = field(default_factory=dict)
    schema: int = SCHEMA
    targets: tuple[str, ...] = ()
    completed: Completed | None = None

    def image_tags(self) -> dict[str, str]:
        """What an image baked from this node carries besides the pins: each component's actual release."""
        return {
            f"{INSTALLED_TAG_PREFIX}{name}": item.tag_value for name, item in sorted(self.installed.items())
        }

    def as_dict(self) -> dict[str, Any]:
        """The schema-2 form, as read_manifest.yml sets gpuforge_previous_manifest."""
        out: dict[str, Any] = {
            "schema": self.schema,
            "versions_hash": self.versions_hash,
            "pins": self.pins,
            "installed": {n: i.as_dict() for n, i in self.installed.items()},
        }
        if self.targets:
            out["targets"] = list(self.targets)
        if self.completed is not None:
            out["completed"] = {
                "versions_hash": self.completed.versions_hash,
                "targets": list(self.completed.targets),
                "install_revision": self.completed.install_revision,
            }
        return out


def loads(text: str, where: str = "manifest.json") -> NodeManifest:
    """A manifest from the file's text (see parse)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{where}: not JSON ({exc})") from None
    return parse(data, where)


def parse(data: Any, where: str = "manifest.json") -> NodeManifest:
    """A manifest from its JSON data; schema 1 (pins under 'components', no 'installed') is accepted."""
    if not isinstance(data, Mapping):
        raise ManifestError(f"{where}: expected a JSON object")
    schema = data.get("schema", 1)
    if not isinstance(schema, int) or schema < 1:
        raise ManifestError(f"{where}: bad schema {schema!r}")
    if schema == 1:
        return NodeManifest(
            versions_hash=str(data.get("versions_hash", "")),
            pins=_pins(data.get("components", {}), where),
            installed={},
            schema=SCHEMA,
        )
    return NodeManifest(
        versions_hash=str(data.get("versions_hash", "")),
        pins=_pins(data.get("pins", {}), where),
        installed=_installed(data.get("installed", {}), where),
        schema=schema,
        targets=_names(data.get("targets", []), f"{where}: targets"),
        completed=_completed(data.get("completed"), where),
    )


def _installed(raw: Any, where: str) -> dict[str, Installed]:
    if not isinstance(raw, Mapping):
        raise ManifestError(f"{where}: 'installed' must be an object")
    installed: dict[str, Installed] = {}
    for name, item in raw.items():
        if not isinstance(item, Mapping) or not item.get("version") or item.get("source") not in SOURCES:
            raise ManifestError(
                f"{where}: installed.{name} needs a version and a source "
                f"({' or '.join(SOURCES)}), got {item!r}"
            )
        installed[str(name)] = Installed(
            str(item["version"]), str(item["source"]), str(item.get("digest", ""))
        )
    return installed


def _names(raw: Any, what: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(n, str) for n in raw):
        raise ManifestError(f"{what} must be a list of instance type names")
    return tuple(raw)


def _completed(raw: Any, where: str) -> Completed | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not isinstance(raw.get("versions_hash"), str):
        raise ManifestError(f"{where}: completed needs a versions_hash and targets, got {raw!r}")
    revision = raw.get("install_revision", 1)
    if not isinstance(revision, int) or isinstance(revision, bool) or revision < 1:
        raise ManifestError(
            f"{where}: completed.install_revision must be a positive integer, got {revision!r}"
        )
    return Completed(
        raw["versions_hash"], _names(raw.get("targets", []), f"{where}: completed.targets"), revision
    )


def _pins(raw: Any, where: str) -> dict[str, dict[str, str]]:
    if not isinstance(raw, Mapping) or not all(isinstance(v, Mapping) for v in raw.values()):
        raise ManifestError(f"{where}: pins must map each component to its fields")
    return {str(k): {str(f): str(x) for f, x in v.items()} for k, v in raw.items()}


def differences(node: NodeManifest, expected: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Components whose installed release differs from `expected` (component -> version).

    Returns name -> (on the node, expected): what the image recorded against what the node has now.
    """
    out: dict[str, tuple[str, str]] = {}
    for name in sorted(set(node.installed) | set(expected)):
        have = node.installed[name].version if name in node.installed else ""
        want = expected.get(name, "")
        if have != want:
            out[name] = (have, want)
    return out


def installed_vs_image(node: NodeManifest | None, image_tags: Mapping[str, str]) -> list[str]:
    """Each component the image recorded (gpuforge:installed:<name>) that the node has otherwise:
    "<name> <version>/<source>[@<digest>] (image <tag>)", or "<name> absent (image <tag>)"."""
    installed = node.installed if node is not None else {}
    out = []
    for key, tag in image_tags.items():
        if not key.startswith(INSTALLED_TAG_PREFIX):
            continue
        name = key[len(INSTALLED_TAG_PREFIX) :]
        now = installed[name].tag_value if name in installed else "absent"
        if now != str(tag):
            out.append(f"{name} {now} (image {tag})")
    return out


def below_floor(node: NodeManifest | None, pins: Mapping[str, Any]) -> list[str]:
    """Each installed component with a pin whose release is below that pin's floor (the version
    policy would replace it): "<name> <version> < floor <floor>". A pin without a floor has its
    version as floor, as the roles default it."""
    out = []
    for name, have in (node.installed if node is not None else {}).items():
        pin = pins.get(name)
        if not isinstance(pin, Mapping):
            continue
        floor = str(pin.get("floor") or pin.get("version") or "")
        if compare(have.version, floor) < 0:
            out.append(f"{name} {have.version} < floor {floor}")
    return out


def drift(
    node: NodeManifest | None, image_tags: Mapping[str, str], pins: Mapping[str, Any], pins_hash: str
) -> dict[str, Any]:
    """The drift check's comparison of the node's manifest (None: none), its image's tags and the
    current pins (versions.yml's components and their hash), as playbooks/drift.yml reports it."""
    node_hash = node.versions_hash if node is not None else ""
    image_hash = str(image_tags.get(VERSIONS_HASH_TAG) or "")
    return {
        "node": node_hash or "missing",
        "image": image_hash or "untagged",
        "current": pins_hash,
        "node_matches_image": node_hash == image_hash,
        "node_matches_current": node_hash == pins_hash,
        "installed_vs_image": installed_vs_image(node, image_tags),
        "below_floor": below_floor(node, pins),
    }
