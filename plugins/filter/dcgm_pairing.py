"""Ansible filter: whether the pinned dcgm-exporter can work with the host's DCGM.

The dcgm role adopts a base image's DCGM at or above the floor and never downgrades it, so the DCGM
on a node may differ from the release the exporter was paired with. NVIDIA states which DCGM releases
an exporter release is tested with, and that some DCGM releases only talk to a libdcgm of their own
release (the versions.yml dcgm_exporter block records both, with sources). The decision lives here,
once; roles/dcgm/tasks/exporter.yml asserts on its result:

    _pairing: "{{ host_dcgm | gpuforge.gpu.dcgm_exporter_pairing(gpuforge_versions.dcgm_exporter, method) }}"

Which libdcgm talks to the host engine depends on the install method: the package and the binary load
the host's libdcgm (the same release as its nv-hostengine); the container carries the libdcgm of the
DCGM release in its tag.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped]
from ansible_collections.gpuforge.gpu.plugins.plugin_utils.policy import (
    compare,
    upstream_version,
    version_key,
)

METHODS = ("package", "container", "binary")
_RELEASE = re.compile(r"^[0-9]+(?:[.][0-9]+)+$")


def _release(text: Any, what: str) -> str:
    """ "4.7.0" from "4.7.0", "1:4.7.0" or "1:4.7.0-1" (Debian epoch and revision dropped); the
    releases compare as the version policy compares them (policy.compare)."""
    bare = upstream_version(str(text))
    if not _RELEASE.match(bare):
        raise AnsibleFilterError(
            f"dcgm_exporter_pairing: {what} {text!r} is not a DCGM release such as 4.7.0"
        )
    return bare


def dcgm_exporter_pairing(host_dcgm: Any, pins: Any, method: Any) -> dict[str, Any]:
    """Whether the exporter pinned in `pins` (versions.yml dcgm_exporter) works with DCGM `host_dcgm`
    installed on the node when run by `method`; `reason` says why not and what to do."""
    if not isinstance(pins, Mapping):
        raise AnsibleFilterError("dcgm_exporter_pairing: pins must be versions.yml's dcgm_exporter mapping")
    if method not in METHODS:
        raise AnsibleFilterError(
            f"dcgm_exporter_pairing: method {method!r} is not one of {', '.join(METHODS)}"
        )
    exporter = str(pins.get("version", ""))
    paired_text, _dash, exporter_release = exporter.partition("-")
    if not exporter_release:
        raise AnsibleFilterError(
            f"dcgm_exporter_pairing: dcgm_exporter version {exporter!r} is not <dcgm>-<exporter> "
            "(e.g. 4.7.0-4.9.0)"
        )
    paired = _release(paired_text, "the DCGM release in the exporter version")
    lowest = _release(pins.get("dcgm_tested_min", ""), "dcgm_exporter.dcgm_tested_min")
    highest = _release(pins.get("dcgm_tested_max", ""), "dcgm_exporter.dcgm_tested_max")
    strict_from = _release(pins.get("dcgm_same_release_from", ""), "dcgm_exporter.dcgm_same_release_from")
    if compare(paired, lowest) < 0 or compare(paired, highest) > 0:
        raise AnsibleFilterError(
            f"dcgm_exporter_pairing: versions.yml pairs dcgm-exporter {exporter} with DCGM {paired}, "
            f"outside the DCGM {lowest} to {highest} it records as tested"
        )
    host = _release(host_dcgm, "the host's DCGM")
    # The package and the binary load the host's own libdcgm; the image carries its tag's DCGM.
    libdcgm = paired if method == "container" else host
    tested = f"{lowest} to {highest}"
    result: dict[str, Any] = {
        "ok": True,
        "reason": "",
        "host_dcgm": host,
        "libdcgm": libdcgm,
        "tested": tested,
    }
    if compare(host, lowest) < 0:
        result["ok"] = False
        result["reason"] = (
            f"the host's DCGM {host} is older than dcgm-exporter {exporter} is tested with "
            f"(DCGM {tested}, versions.yml dcgm_exporter): raise dcgm_floor to {lowest} or more "
            f"so the pin replaces it, or pin an exporter release paired with DCGM {host}"
        )
    elif compare(host, highest) > 0:
        result["ok"] = False
        result["reason"] = (
            f"the host's DCGM {host} is newer than dcgm-exporter {exporter} is tested with "
            f"(DCGM {tested}, versions.yml dcgm_exporter), and gpuforge never downgrades DCGM: pin the "
            f"dcgm-exporter release NVIDIA pairs with DCGM {host} in versions.yml, or set "
            "dcgm_exporter_enabled=false"
        )
    elif compare(libdcgm, host) != 0 and compare(max(libdcgm, host, key=version_key), strict_from) >= 0:
        result["ok"] = False
        result["reason"] = (
            f"the {method} method's libdcgm {libdcgm} cannot talk to the host's nv-hostengine "
            f"{host}: from DCGM {strict_from} on both must be the same release "
            "(versions.yml dcgm_exporter.dcgm_same_release_from); use dcgm_exporter_install_method=package, "
            "whose exporter uses the host's libdcgm"
        )
    return result


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict[str, Any]:
        return {
            "dcgm_exporter_pairing": dcgm_exporter_pairing,
        }
