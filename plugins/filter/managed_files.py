"""Ansible filters for managed files checked in one round trip per role.

A configure role used to template or create each of its files in a task of its own: on a rerun that
changes nothing each one still costs a round trip to the host (two for a template: a stat, then the
file module for its attributes). The configure roles instead describe their files once, rendered on
the controller, and pass them to roles/gpuforge_common/tasks/managed_files.yml, which reads their
state with one ansible.builtin.find (get_checksum) and writes only the entries that differ:

    gpuforge_common_managed_files: [{path, state: file|directory, content (files), owner, group, mode,
                                     validate (optional), notify (optional)}, ...]
    find: {paths: "{{ managed | gpuforge.gpu.managed_parents }}",
           patterns: "{{ managed | gpuforge.gpu.managed_names }}", file_type: any, get_checksum: true}
    loop: "{{ managed | gpuforge.gpu.managed_differ(found.files) }}"

An entry differs when the path is missing, is of the other type, has another owner, group or mode,
or (a file) has other content (SHA-1, find's default checksum and the one the copy module compares).
"""

from __future__ import annotations

import hashlib
import posixpath
from typing import Any

from ansible.errors import AnsibleFilterError


def _entries(managed: Any) -> list[dict[str, Any]]:
    """The entries, checked, with the optional keys filled in (state file, notify false) so the tasks
    that write them can select on every key."""
    if not isinstance(managed, list) or not all(isinstance(e, dict) and "path" in e for e in managed):
        raise AnsibleFilterError("managed files: a list of entries with a path, state, owner, group and mode")
    entries = [{"state": "file", "notify": False, **entry} for entry in managed]
    for entry in entries:
        if entry["state"] not in ("file", "directory"):
            raise AnsibleFilterError(f"managed files: {entry['path']}: state must be file or directory")
        if entry["state"] == "file" and not isinstance(entry.get("content"), str):
            raise AnsibleFilterError(f"managed files: {entry['path']}: a file needs its content as a string")
    return entries


def managed_parents(managed: Any) -> list[str]:
    """The directories holding the managed paths: find's `paths`."""
    return sorted({posixpath.dirname(str(e["path"]).rstrip("/")) or "/" for e in _entries(managed)})


def managed_names(managed: Any) -> list[str]:
    """The managed paths' base names: find's `patterns` (matches elsewhere are ignored)."""
    return sorted({posixpath.basename(str(e["path"]).rstrip("/")) for e in _entries(managed)})


def _differs(entry: dict[str, Any], found: dict[str, Any] | None) -> bool:
    if found is None:
        return True
    directory = entry["state"] == "directory"
    if bool(found.get("isdir")) != directory or (not directory and not found.get("isreg")):
        return True
    if (found.get("pw_name"), found.get("gr_name")) != (entry.get("owner"), entry.get("group")):
        return True
    if int(str(found.get("mode", "0")), 8) != int(str(entry.get("mode", "0")), 8):
        return True
    if directory:
        return False
    return found.get("checksum") != hashlib.sha1(str(entry["content"]).encode()).hexdigest()  # noqa: S324


def managed_differ(managed: Any, found_files: Any) -> list[dict[str, Any]]:
    """The managed entries whose path, type, owner, group, mode or content differ from find's files
    (with state and notify filled in)."""
    if not isinstance(found_files, list):
        raise AnsibleFilterError("managed_differ: pass the find result's files list")
    found = {str(f.get("path", "")).rstrip("/"): f for f in found_files if isinstance(f, dict)}
    return [e for e in _entries(managed) if _differs(e, found.get(str(e["path"]).rstrip("/")))]


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict[str, Any]:
        return {
            "managed_parents": managed_parents,
            "managed_names": managed_names,
            "managed_differ": managed_differ,
        }
