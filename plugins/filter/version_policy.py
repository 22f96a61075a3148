"""Ansible filters gpuforge.gpu.version_at_least and gpuforge.gpu.upstream_version: the version policy's
comparison and its reading of a Debian package version, for the roles and drift.yml.

The decision itself (adopt, keep, install, refuse) is the action gpuforge.gpu.component
(plugins/action/component.py), the one writer of the node record; the rules are
plugins/plugin_utils/policy.py, which the CLI imports too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.gpuforge.gpu.plugins.plugin_utils.policy import compare, upstream_version


def _text(value: Any) -> str:
    """A release as the probes give it ('' for none), without surrounding blanks."""
    return "" if value is None else str(value).strip()


def version_at_least(version: Any, minimum: Any) -> bool:
    """Whether release `version` is `minimum` or newer, compared as the version policy compares
    (Debian's order, a Debian epoch ignored); an empty version is never at least anything."""
    text = _text(version)
    if not text:
        return False
    return compare(text, _text(minimum)) >= 0


def upstream_version_filter(version: Any) -> str:
    """The upstream release of a Debian package version as dpkg reports it ("1:4.7.0-1" -> "4.7.0");
    '' for none (an absent package). The roles' probes pass dpkg's versions through it."""
    if isinstance(version, (Mapping, list)):
        raise AnsibleFilterError(
            f"upstream_version: pass one package version such as 1:4.7.0-1 (a string), not {version!r}"
        )
    return upstream_version(_text(version))


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict[str, Any]:
        return {
            "version_at_least": version_at_least,
            "upstream_version": upstream_version_filter,
        }
