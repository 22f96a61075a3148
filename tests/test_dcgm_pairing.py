"""The gpuforge.gpu.dcgm_exporter_pairing and dcgm_exporter_package_version filters
(plugins/filter/dcgm_pairing.py): which host DCGM the pinned dcgm-exporter works with, per install
method, and which package build of the pinned release the dcgm role installs."""

from __future__ import annotations

import re
from typing import Any

import pytest
from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped]

import sourcefile
from gpuforge import versions

pairing = sourcefile.load("dcgm_pairing", "plugins/filter/dcgm_pairing.py")

# The pairing NVIDIA states for dcgm-exporter 4.9.0 (versions.yml records it with its sources).
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
    """The pairing compares as plugins/module_utils/policy.py does (it had its own tuple comparison,
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
    """versions.yml's DCGM pin works with its exporter pin (the DLAMI's DCGM 4.7.0 is adopted as it is)."""
    pins = versions.load().components
    for method in pairing.METHODS:
        result = pairing.dcgm_exporter_pairing(pins["dcgm"]["version"], pins["dcgm_exporter"], method)
        assert result["ok"], result["reason"]
    assert pins["dcgm"]["floor"] == pins["dcgm_exporter"]["dcgm_tested_min"]


_REPO = "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64  Packages"
MADISON = "".join(
    f"datacenter-gpu-manager-exporter | {version} | {_REPO}\n"
    for version in ("4.9.0-1", "4.8.4.3955-1", "4.8.2-1")
)


def test_the_one_build_of_the_pinned_release_is_chosen() -> None:
    assert pairing.dcgm_exporter_package_version(MADISON, "4.9.0") == "4.9.0-1"
    assert pairing.dcgm_exporter_package_version(MADISON, "4.8.4") == "4.8.4.3955-1"
    with_epoch = MADISON.replace("| 4.9.0-1 |", "| 1:4.9.0-1 |")
    assert pairing.dcgm_exporter_package_version(with_epoch, "4.9.0") == "1:4.9.0-1"


def test_the_installed_build_of_the_release_is_kept() -> None:
    """A rerun keeps what the first run installed and held, even when another build appears."""
    more = MADISON + "datacenter-gpu-manager-exporter | 4.9.0.4100-1 | https://x  Packages\n"
    assert pairing.dcgm_exporter_package_version(more, "4.9.0", "4.9.0-1") == "4.9.0-1"
    # An installed build of another release is not kept.
    assert pairing.dcgm_exporter_package_version(MADISON, "4.9.0", "4.8.2-1") == "4.9.0-1"


@pytest.mark.parametrize(
    ("madison", "words"),
    [
        ("", "no build of dcgm-exporter 4.9.0"),
        (MADISON.replace("4.9.0-1", "4.9.1-1"), "no build of dcgm-exporter 4.9.0"),
        (
            MADISON + "datacenter-gpu-manager-exporter | 4.9.0.4100-1 | https://x  Packages\n",
            "4.9.0-1, 4.9.0.4100-1",
        ),
    ],
    ids=["nothing-offered", "other-release-only", "two-builds"],
)
def test_no_build_or_several_builds_are_refused(madison: str, words: str) -> None:
    with pytest.raises(AnsibleFilterError) as caught:
        pairing.dcgm_exporter_package_version(madison, "4.9.0")
    assert words in str(caught.value)
    assert "dcgm_exporter_package_version" in str(caught.value)
