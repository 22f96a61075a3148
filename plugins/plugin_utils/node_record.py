"""The node record (docs/architecture.md#reality): one entry per component, written in one place.

A stack role says what it knows about its component (what is installed, the pin, the floor, whether
the installed release is compatible, what gpuforge itself already put in place) and `record` decides
through the version policy (policy.py), adds the entry to the record and says the one line a run
prints about it. The action plugin gpuforge.gpu.component (plugins/action/component.py) is its only
caller: it passes the record, the previous manifest and the downgrade opt-in from the play, so no
role passes them (or can forget one).

Pure Python (no Ansible import).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ansible_collections.gpuforge.gpu.plugins.plugin_utils.policy import (
    Decision,
    compare,
    decide,
    previous_source,
)

# What the role does after the decision:
# - installed: the installed release stays (kept at the pin or adopted);
# - ours: gpuforge's own earlier install of the pin stays (kept, gpuforge's);
# - install: the role installs the pin (an install or, opted in, a downgrade);
# - none: the pin would be installed but this host cannot take it: nothing is recorded.
# A refusal is no outcome: the task fails with the policy's message.
Outcome = Literal["installed", "ours", "install", "none"]


@dataclass(frozen=True)
class Recorded:
    """What one component's decision did to the record."""

    record: dict[str, Any]  # the whole record afterwards
    outcome: Outcome | Literal[""]  # '' on a refusal
    entry: dict[str, Any]  # the component's entry ({} when none is recorded)
    message: str  # the one line a run prints; on a refusal, the policy's message
    refused: bool = False
    decision: Decision | None = field(default=None, repr=False)


def line(component: str, entry: Mapping[str, Any]) -> str:
    """The one line about a component's entry (tests/test_twins.py reads it from a real bake)."""
    reason = entry.get("reason") or ""
    return (
        f"{component}: {entry.get('action')} {entry.get('version')} ({entry.get('source')}); "
        f"installed before: {entry.get('installed') or 'nothing'}, "
        f"floor {entry.get('floor')}, pin {entry.get('pinned')}" + (f"; {reason}" if reason else "")
    )


def record(
    current: Mapping[str, Any] | None,
    component: str,
    *,
    installed: str,
    pin: str,
    floor: str,
    compatible: bool = True,
    incompatible_reason: str = "",
    ours: str = "",
    installable: bool = True,
    details: Mapping[str, Any] | None = None,
    kept_details: Mapping[str, Any] | None = None,
    allow_downgrade: bool = False,
    previous_manifest: Mapping[str, Any] | None = None,
) -> Recorded:
    """Decide about `component` and record it in `current` (never changed in place).

    `ours`: the release gpuforge itself put in place and finds there (its own build under its own
    prefix, the exporter it pins exactly), '' when none. Where the policy would install the pin over
    `installed` and `ours` is the pin, the pin is already there: kept, as gpuforge's.
    `installable`: whether the role can install the pin on this host; where it cannot (and `ours`
    does not stand in), nothing is recorded, so the manifest never lists a release the node lacks.
    `details` go into the entry whatever the decision (a digest, why a release found was not offered);
    `kept_details` only when the installed release stays (where it lives).
    """
    if not pin.strip() or not floor.strip():
        raise ValueError(f"{component}: the pin and the floor are required")
    before = dict(current or {})
    decision = decide(
        component,
        installed,
        pin,
        floor,
        compatible=compatible,
        incompatible_reason=incompatible_reason,
        allow_downgrade=allow_downgrade,
        previous_source=previous_source(previous_manifest, component),
    )
    if decision.action == "refuse":
        return Recorded(before, "", {}, decision.message, refused=True, decision=decision)
    outcome: Outcome
    if decision.action in ("keep", "adopt"):
        outcome = "installed"
    elif ours.strip() and compare(ours, pin) == 0:
        decision = decide(component, ours, pin, floor, previous_source="gpuforge")
        outcome = "ours"
    elif installable:
        outcome = "install"
    else:
        without = {name: entry for name, entry in before.items() if name != component}
        wanted = decision.record()
        message = (
            f"{component}: {decision.action} {pin} wanted, but this host cannot install it: "
            "nothing recorded; "
            f"installed before: {wanted['installed'] or 'nothing'}, floor {floor}, pin {pin}"
        )
        return Recorded(without, "none", {}, message, decision=decision)
    entry = {
        **decision.record(),
        **dict(details or {}),
        **(dict(kept_details or {}) if outcome == "installed" else {}),
    }
    return Recorded({**before, component: entry}, outcome, entry, line(component, entry), decision=decision)
