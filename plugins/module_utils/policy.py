"""The version policy: adopt what a host has, install the pin, or refuse to downgrade.

The one implementation: the roles call it through the filter gpuforge.gpu.version_decision
(plugins/filter/version_policy.py) and the CLI imports it (gpuforge.policy re-exports it).

For one component, given the release installed now (or none), the pin from versions.yml and its
floor:
- nothing installed                          -> install the pin
- installed == pin                           -> keep it (its source stays what it was)
- installed >= floor and compatible          -> adopt it, whatever the pin (never downgrade)
- otherwise (below the floor or incompatible) and pin >= installed -> install the pin (upgrade)
- otherwise (pin older than installed)       -> refuse, naming both releases, unless the user
  opted in with gpuforge_common_allow_downgrade (then: downgrade to the pin)

Pure Python (no Ansible import): the filter runs it on the controller, the CLI without Ansible.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Action = Literal["install", "keep", "adopt", "downgrade", "refuse"]
Source = Literal["base_image", "gpuforge"]
SOURCES: tuple[Source, ...] = ("base_image", "gpuforge")

# The one user opt-in for a downgrade (roles/gpuforge_common/defaults/main.yml).
ALLOW_DOWNGRADE_VARIABLE = "gpuforge_common_allow_downgrade"

_EPOCH = re.compile(r"^[0-9]+:")
_NUMBER = re.compile(r"[0-9]+")


def version_key(version: str) -> tuple[int, ...]:
    """Every number of a release in order, without a Debian epoch ("1:4.5.3" -> (4, 5, 3)).

    Readers pass upstream releases (no packaging revision), so numbers compare like for like.
    """
    return tuple(int(n) for n in _NUMBER.findall(_EPOCH.sub("", str(version).strip())))


def compare(a: str, b: str) -> int:
    """-1, 0 or 1 as release a is older than, the same as or newer than release b."""
    ka, kb = version_key(a), version_key(b)
    return (ka > kb) - (ka < kb)


@dataclass(frozen=True)
class Decision:
    """What a role does about one component and what the node records afterwards.

    The fields are those of one entry of gpuforge_reality / manifest.json's "installed" (plus the
    component's name).
    """

    component: str
    action: Action
    installed: str  # what was there before ('' when nothing)
    pinned: str
    floor: str
    version: str  # what is there afterwards ('' when refused)
    source: Source | Literal[""]
    reason: str  # why the installed release is replaced or kept out ('' when it is not)

    @property
    def changes_host(self) -> bool:
        return self.action in ("install", "downgrade")

    def record(self) -> dict[str, str]:
        """The entry the role records for this component in gpuforge_reality."""
        return {
            "action": self.action,
            "installed": self.installed,
            "pinned": self.pinned,
            "floor": self.floor,
            "version": self.version,
            "source": self.source,
            "reason": self.reason,
        }

    @property
    def message(self) -> str:
        if self.action == "refuse":
            return (
                f"{self.component}: installed {self.installed} is {self.reason}, "
                f"and the pin {self.pinned} is older; "
                f"gpuforge never downgrades. Pin a release at or above {self.installed}, or set "
                f"{ALLOW_DOWNGRADE_VARIABLE}=true to downgrade."
            )
        if self.action in ("keep", "adopt"):
            return f"{self.component}: {self.action} installed {self.installed} ({self.source})"
        over = f" over {self.installed} ({self.reason})" if self.installed else ""
        return f"{self.component}: {self.action} {self.version}{over}"


def decide(
    component: str,
    installed: str,
    pin: str,
    floor: str,
    *,
    compatible: bool = True,
    incompatible_reason: str = "",
    allow_downgrade: bool = False,
    previous_source: str = "",
) -> Decision:
    """The policy decision for one component (see the module docstring)."""
    installed = installed.strip()
    vs_pin = compare(installed, pin)
    vs_floor = compare(installed, floor)
    action: Action
    if not installed:
        action = "install"
    elif vs_pin == 0:
        action = "keep"
    elif vs_floor >= 0 and compatible:
        action = "adopt"
    elif vs_pin < 0:
        action = "install"
    elif allow_downgrade:
        action = "downgrade"
    else:
        action = "refuse"
    # A release this node already recorded as gpuforge's stays gpuforge's; anything else came with the image.
    kept: Source = "gpuforge" if previous_source == "gpuforge" else "base_image"
    why = (
        f"below the floor {floor}"
        if vs_floor < 0
        else f"incompatible: {incompatible_reason or 'see the role'}"
    )
    return Decision(
        component=component,
        action=action,
        installed=installed,
        pinned=pin,
        floor=floor,
        version="" if action == "refuse" else (installed if action in ("keep", "adopt") else pin),
        source="" if action == "refuse" else (kept if action in ("keep", "adopt") else "gpuforge"),
        reason=why if action in ("install", "downgrade", "refuse") and installed else "",
    )


def previous_source(manifest: Mapping[str, Any] | None, component: str) -> str:
    """Who provided `component` by the node's manifest as read back (schema 2; '' when not recorded)."""
    installed = (manifest or {}).get("installed") or {}
    entry = installed.get(component) if isinstance(installed, Mapping) else None
    return str(entry.get("source", "")) if isinstance(entry, Mapping) else ""
