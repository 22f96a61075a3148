"""The gpuforge.gpu.dcgm_exporter_pairing filter (plugins/filter/dcgm_pairing.py): which host DCGM the
pinned dcgm-exporter works with, per install method. (The exact package the dcgm role installs is
versions.yml's, checked against the repository: test_dcgm_exporter_available.py.)"""

from __future__ import annotations

import re
from typing import Any

import pytest
from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped]

import sourcefile
from gpuforge import versions

pairing = sourcefile.load("dcgm_pairing", "plugins/filter/dcgm_pairing.py")

# The pairing NVIDIA states for dcgm-exporter 4.9.0 (tested with DCGM 4.7.0 and 4.7.1, 4.7.1 only with
# a libdcgm of its own release): a range of two releases exercises every branch of the filter.
PINS = {
    "version": "4.7.0-4.9.0",
    "dcgm_tested_min": "4.7.0",
    "dcgm_tested_max": "4.7.1",
    "dcgm_same_release_from": "4.7.1",
}


# host DCGM, method -> works
@pytest.mark.parametrize(
    ("host", "method", "ok"),
    [
        ("4.7.0", "package", True),
        ("1:4.7.0-1", "package", True),
        ("4.7.1", "package", True),
        ("4.7.1", "binary", True),
        ("4.7.0", "container", True),
        # The image's libdcgm 4.7.0 against a 4.7.1 host engine: the API mismatch NVIDIA describes.
        ("4.7.1", "container", False),
        ("4.6.1", "package", False),
        ("4.5.3", "container", False),
        ("4.8.0", "package", False),
        ("4.7.2", "binary", False),
    ],
)
def test_host_dcgm_outside_nvidias_pairing_is_refused(host: str, method: str, ok: bool) -> None:
    result = pairing.dcgm_exporter_pairing(host, PINS, method)
    assert result["ok"] is ok
    assert (result["reason"] == "") is ok


def test_the_refusal_names_both_versions_and_what_to_do() -> None:
    newer = pairing.dcgm_exporter_pairing("4.8.0", PINS, "package")["reason"]
    assert "4.8.0" in newer and "4.7.0-4.9.0" in newer and "never downgrades" in newer
    assert "dcgm_exporter_enabled=false" in newer
    older = pairing.dcgm_exporter_pairing("4.6.1", PINS, "package")["reason"]
    assert "4.6.1" in older and "older" in older and "dcgm_floor" in older
    mismatch = pairing.dcgm_exporter_pairing("4.7.1", PINS, "container")
    assert mismatch["libdcgm"] == "4.7.0" and mismatch["host_dcgm"] == "4.7.1"
    assert "dcgm_exporter_install_method=package" in mismatch["reason"]


def test_releases_compare_as_the_version_policy_compares() -> None:
    """The pairing compares as plugins/plugin_utils/policy.py does (it had its own tuple comparison,
    under which 4.7 was older than 4.7.0 and not the same release)."""
    same = pairing.dcgm_exporter_pairing("1:4.7-1", PINS, "container")
    assert same["ok"], same["reason"]
    assert same["host_dcgm"] == "4.7"
    newer = pairing.dcgm_exporter_pairing("4.7.1", {**PINS, "dcgm_tested_max": "4.7.1.0"}, "package")
    assert newer["ok"], newer["reason"]


def test_package_and_binary_use_the_hosts_libdcgm_the_container_its_own() -> None:
    assert pairing.dcgm_exporter_pairing("4.7.1", PINS, "package")["libdcgm"] == "4.7.1"
    assert pairing.dcgm_exporter_pairing("4.7.1", PINS, "binary")["libdcgm"] == "4.7.1"
    assert pairing.dcgm_exporter_pairing("4.7.0", PINS, "container")["libdcgm"] == "4.7.0"


@pytest.mark.parametrize(
    ("host", "pins", "method", "words"),
    [
        ("latest", PINS, "package", "not a DCGM release"),
        ("", PINS, "package", "not a DCGM release"),
        ("4.7.0", {**PINS, "version": "4.9.0"}, "package", "<dcgm>-<exporter>"),
        ("4.7.0", {**PINS, "dcgm_tested_max": ""}, "package", "dcgm_tested_max"),
        ("4.7.0", {**PINS, "version": "4.6.1-4.8.4"}, "package", "outside the DCGM 4.7.0 to 4.7.1"),
        ("4.7.0", PINS, "docker", "not one of package, container, binary"),
        ("4.7.0", "4.7.0-4.9.0", "package", "mapping"),
    ],
)
def test_bad_inputs_are_refused_rather_than_guessed(host: Any, pins: Any, method: str, words: str) -> None:
    with pytest.raises(AnsibleFilterError, match=re.escape(words)):
        pairing.dcgm_exporter_pairing(host, pins, method)


def test_the_pinned_pairing_in_versions_yml_accepts_its_own_dcgm_pin_by_every_method() -> None:
    """versions.yml's DCGM pin works with its exporter pin, and is the DCGM NVIDIA ships that exporter
    with (dcgm-exporter 4.10.0 "ships with DCGM 4.8.0", release 4.10.0)."""
    pins = versions.load().components
    for method in pairing.METHODS:
        result = pairing.dcgm_exporter_pairing(pins["dcgm"]["version"], pins["dcgm_exporter"], method)
        assert result["ok"], result["reason"]
    assert pins["dcgm"]["floor"] == pins["dcgm_exporter"]["dcgm_tested_min"]
    assert pins["dcgm_exporter"]["version"] == f"{pins['dcgm']['version']}-4.10.0"
    assert pins["dcgm"]["package_version"] == f"1:{pins['dcgm']['version']}-1"
    # The exact package version the role installs and checks, of the exporter release the pair names.
    release = pins["dcgm_exporter"]["version"].split("-", 1)[1]
    assert re.fullmatch(re.escape(release) + r"([.][0-9]+)?-[0-9]+", pins["dcgm_exporter"]["package_version"])
