"""The node manifest, /etc/gpuforge/manifest.json: read it, and turn it into image tags.

One writer (roles/gpuforge_common/tasks/manifest.yml), one reader per language: this module and
roles/gpuforge_common/tasks/read_manifest.yml (tests/test_node_manifest.py keeps them equal). The
golden fast path's decision over a manifest lives once, in plugins/module_utils/fast_path.py.
The schema is documented in docs/manifest.md:

    {"schema": 2,
     "versions_hash": "<sha256 of versions.yml's pins, as gpuforge.versions.Manifest.digest>",
     "pins": {"<component>": {"version": ..., "floor": ..., ...}},       # versions.yml as baked
     "installed": {"<component>": {"version": "580.105.08", "source": "base_image" | "gpuforge",
                                   "digest": "sha256:..."}},   # digest: only for what has one
     "targets": ["p5.48xlarge", ...],                          # the instance types it is for
     "completed": {"versions_hash": "...", "targets": [...]}}  # the last install phase run to its end


Other keys may be added by later schema versions' writers; readers ignore what they do not know.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ansible_collections.gpuforge.gpu.plugins.module_utils import fast_path as _fast_path

from gpuforge.errors import UserError
from gpuforge.policy import SOURCES

SCHEMA = 2
PATH = Path("/etc/gpuforge/manifest.json")
# One AMI tag per installed component: "gpuforge:installed:<component>" = "<version>/<source>[@<digest>]".
INSTALLED_TAG_PREFIX = "gpuforge:installed:"
# What the install phase covers beyond the pinned components (completed.install_revision): defined
# once, with the fast-path decision that compares it, in the collection.
INSTALL_REVISION = _fast_path.INSTALL_REVISION


@dataclass(frozen=True)
class Installed:
    version: str
    source: str  # base_image or gpuforge
    digest: str = ""  # the content digest where the component has one (the dcgm-exporter image)

    @property
    def tag_value(self) -> str:
        """The AMI tag value; playbooks/drift.yml formats the node's side the same way."""
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


def parse(data: Any, where: str = "manifest.json") -> NodeManifest:
    """A manifest from its JSON data; schema 1 (pins under 'components', no 'installed') is accepted."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a JSON object")
    schema = data.get("schema", 1)
    if not isinstance(schema, int) or schema < 1:
        raise UserError(f"{where}: bad schema {schema!r}")
    if schema == 1:
        return NodeManifest(
            versions_hash=str(data.get("versions_hash", "")),
            pins=_pins(data.get("components", {}), where),
            installed={},
            schema=SCHEMA,
        )
    installed: dict[str, Installed] = {}
    raw = data.get("installed", {})
    if not isinstance(raw, dict):
        raise UserError(f"{where}: 'installed' must be an object")
    for name, item in raw.items():
        if not isinstance(item, dict) or not item.get("version") or item.get("source") not in SOURCES:
            raise UserError(
                f"{where}: installed.{name} needs a version and a source "
                f"({' or '.join(SOURCES)}), got {item!r}"
            )
        installed[str(name)] = Installed(
            str(item["version"]), str(item["source"]), str(item.get("digest", ""))
        )
    return NodeManifest(
        versions_hash=str(data.get("versions_hash", "")),
        pins=_pins(data.get("pins", {}), where),
        installed=installed,
        schema=schema,
        targets=_names(data.get("targets", []), f"{where}: targets"),
        completed=_completed(data.get("completed"), where),
    )


def _names(raw: Any, what: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(n, str) for n in raw):
        raise UserError(f"{what} must be a list of instance type names")
    return tuple(raw)


def _completed(raw: Any, where: str) -> Completed | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("versions_hash"), str):
        raise UserError(f"{where}: completed needs a versions_hash and targets, got {raw!r}")
    revision = raw.get("install_revision", 1)
    if not isinstance(revision, int) or isinstance(revision, bool) or revision < 1:
        raise UserError(f"{where}: completed.install_revision must be a positive integer, got {revision!r}")
    return Completed(
        raw["versions_hash"], _names(raw.get("targets", []), f"{where}: completed.targets"), revision
    )


def _pins(raw: Any, where: str) -> dict[str, dict[str, str]]:
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise UserError(f"{where}: pins must map each component to its fields")
    return {str(k): {str(f): str(x) for f, x in v.items()} for k, v in raw.items()}


def load(path: Path = PATH) -> NodeManifest:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read node manifest {path}: {exc}") from exc
    return parse(data, str(path))


def differences(node: NodeManifest, expected: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Components whose installed release differs from `expected` (component -> version).

    Returns name -> (on the node, expected).

    The drift check's comparison of actual versions: what the image recorded against what the node has now.
    """
    out: dict[str, tuple[str, str]] = {}
    for name in sorted(set(node.installed) | set(expected)):
        have = node.installed[name].version if name in node.installed else ""
        want = expected.get(name, "")
        if have != want:
            out[name] = (have, want)
    return out


def fast_path(
    node: NodeManifest | None, versions_hash: str, instance_type: str, *, full_install: bool = False
) -> tuple[bool, str]:
    """Whether a node may skip the install phase (the golden fast path), and why or why not.

    `node` is None where the manifest is missing or unreadable. The decision is the collection's
    (plugins/module_utils/fast_path.py), the one the bake play makes through the filter
    gpuforge.gpu.fast_path.
    """
    return _fast_path.decide(
        None if node is None else node.as_dict(), versions_hash, instance_type, full_install=full_install
    )
