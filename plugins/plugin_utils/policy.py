"""The version policy: adopt what a host has, install the pin, or refuse to downgrade.

The one implementation: the roles call it through the action gpuforge.gpu.component
(plugins/action/component.py, over node_record.py) and the CLI imports it
(ansible_collections.gpuforge.gpu.plugins.plugin_utils.policy).

For one component, given the release installed now (or none), the pin from versions.yml and its
floor:
- nothing installed                          -> install the pin
- installed == pin                           -> keep it (its source stays what it was); whether the pin
  itself suits the host is the role's to check (nccl's pair_check.yml; nccl_tests rebuilds a kept
  release whose inputs changed, so `compatible` cannot refuse it here)
- installed >= floor and compatible          -> adopt it, whatever the pin (never downgrade)
- otherwise (below the floor or incompatible) and pin >= installed -> install the pin (upgrade)
- otherwise (pin older than installed)       -> refuse, naming both releases, unless the user
  opted in with gpuforge_common_allow_downgrade (then: downgrade to the pin)

Pure Python (no Ansible import): the action runs it on the controller, the CLI without Ansible.
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
# The leading dotted number of an upstream release ("1.22.0" of "1.22.0amzn4.0", "2.3" of "2.3~rc1").
_RELEASE = re.compile(r"^[0-9]+(?:[.][0-9]+)*")
_PART = re.compile(r"([^0-9]*)([0-9]*)")

# A version's sort key: per half (upstream, then Debian revision) the release numbers without
# trailing zeros, then the rest in dpkg's order. Tuples of ints compare like for like.
VersionKey = tuple[tuple[int, ...], tuple[tuple[int, ...], ...], tuple[int, ...], tuple[tuple[int, ...], ...]]
# dpkg's order of characters in the non-digit parts: '~' before the end of the part, the end before
# letters, letters before everything else (dpkg lib/dpkg/version.c, order() and verrevcmp();
# deb-version(7): "The tilde sorts before anything, even the end of a part").
_END = 0
_TILDE = -1
# The end of the whole text: the same weight as the end of a part, and no number after it.
_SENTINEL: tuple[int, ...] = (_END,)


def _weight(char: str) -> int:
    if char == "~":
        return _TILDE
    return ord(char) if char.isalpha() else ord(char) + 256


def _dpkg_key(text: str) -> tuple[tuple[int, ...], ...]:
    """`text` in dpkg's order: each non-digit part (its characters' weights, then its end) and
    the number after it, with the end of the text last, so "~rc1" sorts before "" and "" before
    "amzn4"."""
    parts: list[tuple[int, ...]] = []
    for letters, digits in _PART.findall(text):
        if not letters and not digits:
            continue
        parts.append((*(_weight(c) for c in letters), _END, int(digits or 0)))
    return (*parts, _SENTINEL)


def _half_key(text: str) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The key of an upstream release or a Debian revision: its leading dotted number without
    trailing zeros ("13" and "13.0" are one release), then what follows it in dpkg's order."""
    match = _RELEASE.match(text)
    head = match.group(0) if match else ""
    numbers = [int(n) for n in head.split(".")] if head else []
    while numbers and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers), _dpkg_key(text[len(head) :])


def upstream_version(version: str) -> str:
    """The upstream release of a Debian package version: its epoch and Debian revision (the last
    '-' and what follows) dropped ("1:4.7.0-1" -> "4.7.0", "2.27.7-1+cuda12.9" -> "2.27.7");
    '' for none. deb-version(7): [epoch:]upstream_version[-debian_revision]."""
    bare = _EPOCH.sub("", str(version or "").strip())
    return bare.rpartition("-")[0] if "-" in bare else bare


def version_key(version: str) -> VersionKey:
    """The sort key of a release, in Debian's order where it matters here (deb-version(7)):
    the epoch ignored ("1:4.5.3" is 4.5.3: versions.yml pins carry none); the upstream release
    first, then the Debian revision after the last '-' (so "4.7.0-4.9.0", a dcgm-exporter pin of
    <dcgm>-<exporter>, sorts below "4.7.0-4.10.0"); a '~' pre-release below its release
    ("2.3~rc1" < "2.3"); trailing zero components of the leading release equal ("13" == "13.0",
    but "1+cuda13.0" > "1+cuda13", as dpkg has it).

    Never pass a dcgm-exporter pin through upstream_version: "4.7.0-4.9.0" is <dcgm>-<exporter>,
    not a Debian revision, and would lose its exporter half.

    Readers of dpkg give the upstream release (upstream_version), so a pin compares like for like.
    """
    bare = _EPOCH.sub("", str(version).strip())
    upstream, _dash, revision = bare.rpartition("-") if "-" in bare else (bare, "", "")
    return (*_half_key(upstream), *_half_key(revision))


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
