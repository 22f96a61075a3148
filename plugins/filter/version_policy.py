"""Ansible filter gpuforge.gpu.version_decision: the version policy for one component, recorded.

Each stack role probes what the host has, then records the decision in the play-wide reality record:

    gpuforge_reality: >-
      {{ gpuforge_reality | default({}) | gpuforge.gpu.version_decision('nccl', _nccl_installed,
         nccl_version, nccl_floor, compatible=..., incompatible_reason=...,
         allow_downgrade=gpuforge_common_allow_downgrade,
         previous_manifest=gpuforge_previous_manifest | default({})) }}

and acts on gpuforge_reality[component].action (install / downgrade: install the pin; keep / adopt:
leave the host as it is). A refusal fails the task with the policy's message. The decision itself is
plugins/plugin_utils/policy.py, which the CLI imports too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible.module_utils.parsing.convert_bool import boolean
from ansible_collections.gpuforge.gpu.plugins.plugin_utils.policy import (
    compare,
    decide,
    previous_source,
    upstream_version,
)


def _text(value: Any) -> str:
    """A release as the probes give it ('' for none), without surrounding blanks."""
    return "" if value is None else str(value).strip()


def version_decision(
    reality: Any,
    component: str,
    installed: Any,
    pin: Any,
    floor: Any,
    compatible: Any = True,
    incompatible_reason: Any = "",
    allow_downgrade: Any = False,
    previous_manifest: Any = None,
) -> dict[str, Any]:
    """`reality` with `component`'s decision added; raises with the refusal's message on a refusal."""
    if not isinstance(reality, Mapping):
        raise AnsibleFilterError("version_decision: pass gpuforge_reality (a mapping, {} when empty)")
    if not _text(pin) or not _text(floor):
        raise AnsibleFilterError(f"version_decision: {component}: the pin and the floor are required")
    decision = decide(
        str(component),
        _text(installed),
        _text(pin),
        _text(floor),
        compatible=boolean(compatible, strict=False),
        incompatible_reason=_text(incompatible_reason),
        allow_downgrade=boolean(allow_downgrade, strict=False),
        previous_source=previous_source(
            previous_manifest if isinstance(previous_manifest, Mapping) else None, str(component)
        ),
    )
    if decision.action == "refuse":
        raise AnsibleFilterError(decision.message)
    return {**reality, decision.component: decision.record()}


def version_decision_message(reality: Any, component: str) -> str:
    """One line saying what the version policy decided for `component` (the record in `reality`)."""
    entry = (reality or {}).get(component)
    if not isinstance(entry, Mapping):
        raise AnsibleFilterError(f"version_decision_message: no decision recorded for {component!r}")
    reason = entry.get("reason") or ""
    return (
        f"{component}: {entry.get('action')} {entry.get('version')} ({entry.get('source')}); "
        f"installed before: {entry.get('installed') or 'nothing'}, "
        f"floor {entry.get('floor')}, pin {entry.get('pinned')}" + (f"; {reason}" if reason else "")
    )


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
            "version_decision": version_decision,
            "version_decision_message": version_decision_message,
            "version_at_least": version_at_least,
            "upstream_version": upstream_version_filter,
        }
