"""The golden fast path's decision: may a node skip the install phase?

The one implementation (docs/architecture.md#the-golden-fast-path): the bake
play calls it through the filter gpuforge.gpu.fast_path (plugins/filter/fast_path.py) and the CLI
through gpuforge.node_manifest.fast_path.

A node is golden when the last install phase that ran to its end on it (its manifest's `completed`,
written only by playbooks/bake.yml's last task) was for the current pins' hash, for an install phase
at least as complete as this one, and for targets that include the node's own instance type.
A package changed by hand on a node whose manifest matches is drift, not a reason to reinstall:
playbooks/drift.yml reports it (docs/manifest.md "Golden fast path").

Pure Python (no Ansible import).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# What the install phase (playbooks/bake.yml) covers beyond the pinned components, recorded as the
# manifest's completed.install_revision; bumped whenever it starts baking something versions.yml does
# not pin, so an image baked before that change takes the full install. Defined here only: the
# manifest's writer (roles/gpuforge_common/templates/etc/gpuforge/manifest.json.j2) records it through
# the filter gpuforge.gpu.completed_install; decide() below compares with it, for the CLI too.
# Each revision after the first, and what it started baking (the message of a refused fast path
# names what an older image lacks); add the new revision's entry when bumping INSTALL_REVISION.
REVISIONS: dict[int, str] = {
    2: "munge and the Slurm daemons",  # the slurm role's install part
}
INSTALL_REVISION = max(REVISIONS)


def _revision(value: Any) -> int:
    """A recorded install revision; 1 where none is recorded, 0 where it is not a number."""
    if value is None:
        return 1
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def missing_since(revision: int, install_revision: int = INSTALL_REVISION) -> str:
    """What the install phases after `revision`, up to `install_revision`, added (joined by '; ')."""
    return "; ".join(REVISIONS[r] for r in sorted(REVISIONS) if revision < r <= install_revision)


def completed(versions_hash: str, targets: list[str]) -> dict[str, Any]:
    """The manifest's `completed` entry of an install phase that ran to its end for these pins and
    targets, at this install revision (docs/manifest.md)."""
    return {"versions_hash": versions_hash, "targets": list(targets), "install_revision": INSTALL_REVISION}


def decide(
    manifest: Mapping[str, Any] | None,
    versions_hash: str,
    instance_type: str,
    *,
    full_install: bool = False,
    install_revision: int = INSTALL_REVISION,
) -> tuple[bool, str]:
    """Whether the node may skip the install phase, and why or why not.

    `manifest` is the node's manifest in its schema-2 form (gpuforge.node_manifest's as_dict, the role
    side's gpuforge_previous_manifest); None or {} where it is missing or unreadable.
    """
    if full_install:
        return False, "full install asked for (gpuforge_full_install=true)"
    if not manifest:
        return False, "no readable /etc/gpuforge/manifest.json (never baked by gpuforge)"
    done = manifest.get("completed")
    if not isinstance(done, Mapping):
        return False, "the manifest records no install phase run to its end"
    done_hash = str(done.get("versions_hash") or "")
    if done_hash != versions_hash:
        if str(manifest.get("versions_hash") or "") == versions_hash:
            return False, f"the last install phase for pins {versions_hash[:12]} did not finish"
        return False, f"pins changed: the node has {done_hash[:12]}, versions.yml {versions_hash[:12]}"
    revision = _revision(done.get("install_revision"))
    if revision < install_revision:
        missing = missing_since(revision, install_revision)
        return False, (
            f"the image's install phase is revision {revision}, gpuforge's is {install_revision}"
            + (f" (it did not bake {missing})" if missing else "")
        )
    node_type = (instance_type or "").strip()
    if node_type in ("", "unknown"):
        return False, "this node's instance type is unknown (the inventory sets no gpuforge_instance_type)"
    recorded = done.get("targets", [])
    if not isinstance(recorded, list):
        # A string would be read character by character; whatever wrote it, the record cannot be trusted.
        return False, (
            f"the manifest's completed.targets is {recorded!r}, not a list of instance types "
            "(a malformed manifest)"
        )
    targets = [str(t) for t in recorded]
    if node_type not in targets:
        return False, f"{node_type} is not among the image's targets ({', '.join(targets) or 'none'})"
    return True, f"golden: pins {versions_hash[:12]} installed for {', '.join(targets)}"
