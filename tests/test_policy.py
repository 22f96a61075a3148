"""The version policy, decided once (plugins/plugin_utils/policy.py): the module the CLI imports
(ansible_collections.gpuforge.gpu.plugins.plugin_utils.policy) and the roles' filter
gpuforge.gpu.version_decision (plugins/filter/version_policy.py) over the same cases: adopt, keep,
install, refuse to downgrade, and the one opt-in.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from ansible_collections.gpuforge.gpu.plugins.plugin_utils import policy

import sourcefile
from localplay import record, run_cases

version_policy = sourcefile.load("version_policy", "plugins/filter/version_policy.py")
REPO = Path(__file__).resolve().parents[1]

# case -> (installed, pin, floor, compatible, allow_downgrade, previous source, expected action)
CASES: dict[str, tuple[str, str, str, bool, bool, str, str]] = {
    "absent": ("", "2.0.1", "1.0.0", True, False, "", "install"),
    "same-as-pin": ("2.0.1", "2.0.1", "1.0.0", True, False, "", "keep"),
    "same-as-pin-gpuforge-installed": ("2.0.1", "2.0.1", "1.0.0", True, False, "gpuforge", "keep"),
    "newer-than-pin-adopted": ("3.1.0", "2.0.1", "1.0.0", True, False, "", "adopt"),
    "older-than-pin-above-floor-adopted": ("1.5.0", "2.0.1", "1.0.0", True, False, "", "adopt"),
    "at-floor-adopted": ("1.0.0", "2.0.1", "1.0.0", True, False, "", "adopt"),
    "below-floor-upgraded": ("0.9.9", "2.0.1", "1.0.0", True, False, "", "install"),
    "incompatible-older-upgraded": ("1.5.0", "2.0.1", "1.0.0", False, False, "", "install"),
    "incompatible-newer-refused": ("3.1.0", "2.0.1", "1.0.0", False, False, "", "refuse"),
    "incompatible-newer-opt-in": ("3.1.0", "2.0.1", "1.0.0", False, True, "", "downgrade"),
    "opt-in-changes-nothing-adoptable": ("3.1.0", "2.0.1", "1.0.0", True, True, "", "adopt"),
    # Numbers compare as numbers: the DLAMI's 580.105.08 is above the floor 580.65.06.
    "driver-numeric-not-lexical": ("580.105.08", "580.95.05", "580.65.06", True, False, "", "adopt"),
    "driver-r570-below-floor": ("570.195.03", "580.105.08", "580.65.06", True, False, "", "install"),
    # A Debian epoch is not a version number ("1:4.5.3" is DCGM 4.5.3).
    "epoch-ignored": ("1:4.5.3", "4.5.3", "4.0.0", True, False, "", "keep"),
    "dcgm3-below-dcgm4-floor": ("3.3.9", "4.5.3", "4.0.0", True, False, "", "install"),
    "exporter-style-versions": ("4.5.3-4.8.2", "4.5.3-4.8.2", "4.5.3-4.8.2", True, False, "", "keep"),
    # The pin already on the host is kept whatever `compatible` says: nccl_tests rebuilds a kept release
    # whose inputs changed, and nccl's pair_check.yml refuses a kept pin outside the plugin's range
    # (tests/test_ofi_nccl_range.py), as it refuses that pin on a fresh host.
    "same-as-pin-incompatible-kept": ("2.30.7", "2.30.7", "2.20.0", False, False, "", "keep"),
    # A Debian pre-release is older than its release: never adopted as newer than the pin.
    "pre-release-of-the-pin-upgraded": ("2.3~rc1", "2.3", "2.3", True, False, "", "install"),
    # Trailing zero components name the same release.
    "trailing-zero-same-as-pin": ("13.0", "13", "12", True, False, "", "keep"),
}


def _python(case: str) -> policy.Decision:
    installed, pin, floor, compatible, allow, previous, _ = CASES[case]
    return policy.decide(
        "component",
        installed,
        pin,
        floor,
        compatible=compatible,
        incompatible_reason="" if compatible else "outside the tested range",
        allow_downgrade=allow,
        previous_source=previous,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_python_decision(case: str) -> None:
    decision = _python(case)
    assert decision.action == CASES[case][-1]
    if decision.action in ("keep", "adopt"):
        assert decision.version == decision.installed
        assert decision.source == ("gpuforge" if CASES[case][5] == "gpuforge" else "base_image")
    elif decision.action in ("install", "downgrade"):
        assert (decision.version, decision.source) == (decision.pinned, "gpuforge")
        assert decision.changes_host
    else:
        assert decision.version == "" and not decision.changes_host


def test_refusal_names_both_releases_and_the_opt_in() -> None:
    message = _python("incompatible-newer-refused").message
    assert "installed 3.1.0" in message and "the pin 2.0.1 is older" in message
    assert policy.ALLOW_DOWNGRADE_VARIABLE in message


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("2.3~rc1", "2.3", -1),  # deb-version(7): a tilde sorts before anything, even the end
        ("2.3~rc1", "2.3~rc2", -1),
        ("2.3~rc1", "2.2", 1),
        ("13", "13.0", 0),
        ("13.0.0", "13", 0),
        ("13.0.1", "13", 1),
        ("1:2.3", "2.3", 0),  # the epoch is ignored: pins carry none
        ("4.7.0-4.9.0", "4.7.0-4.10.0", -1),  # dcgm-exporter <dcgm>-<exporter>: numbers, not text
        ("4.7.0-4.9.0", "4.8.0-4.8.0", -1),
        ("1.22.0amzn4.0", "1.22.0", 1),  # a letter suffix sorts after the end
        ("1.22.0amzn4.0", "1.22.1", -1),
        ("580.105.08", "580.95.05", 1),
        ("2.27.7-1+cuda12.9", "2.27.7-1+cuda13.0", -1),
        ("", "1.0", -1),
    ],
)
def test_versions_compare_in_debian_order(a: str, b: str, expected: int) -> None:
    assert policy.compare(a, b) == expected
    assert policy.compare(b, a) == -expected
    assert (policy.version_key(a) == policy.version_key(b)) is (expected == 0)


# Package versions as dpkg reports them (package_facts) -> the upstream release the pins name.
UPSTREAM = {
    "1:4.7.0-1": "4.7.0",  # datacenter-gpu-manager-4-core
    "1:4.5.3-1": "4.5.3",
    "1.17.8-1": "1.17.8",  # nvidia-container-toolkit
    "2.27.7-1+cuda12.9": "2.27.7",  # libnccl2
    "2.27.7-1+cuda13.0": "2.27.7",
    "4.7.0": "4.7.0",
    " 2.3~rc1-1 ": "2.3~rc1",
    "": "",
}


@pytest.mark.parametrize("version", list(UPSTREAM))
def test_upstream_version_drops_the_epoch_and_the_debian_revision(version: str) -> None:
    assert policy.upstream_version(version) == UPSTREAM[version]
    assert version_policy.FilterModule().filters()["upstream_version"](version) == UPSTREAM[version]


def test_upstream_version_is_the_collections_filter_in_a_play(tmp_path: Path) -> None:
    """The roles' expression (gpuforge.gpu.upstream_version, as the dcgm, nccl and
    nvidia_container_toolkit roles apply it to package_facts' versions) in a play on localhost."""
    cases = {
        f"v{i}": [record(f"v{i}", "{{ _version | default('') | gpuforge.gpu.upstream_version }}")]
        for i in range(len(UPSTREAM))
    }
    for i, version in enumerate(UPSTREAM):
        cases[f"v{i}"][0]["vars"]["_version"] = version
    got = run_cases(tmp_path, cases, {})
    assert [got[f"v{i}"] for i in range(len(UPSTREAM))] == list(UPSTREAM.values())


def test_upstream_version_filter_takes_none_and_refuses_a_list() -> None:
    upstream = version_policy.FilterModule().filters()["upstream_version"]
    assert upstream(None) == ""
    with pytest.raises(AnsibleFilterError, match="upstream_version: pass one package version"):
        upstream(["1:4.7.0-1"])


# The role tasks that read a dpkg version for the version policy, and the removed Jinja copies of
# the epoch/revision stripping each had (four different ones).
DPKG_READERS = (
    "roles/dcgm/tasks/install.yml",
    "roles/nccl/tasks/install_apt.yml",
    "roles/nvidia_container_toolkit/tasks/install.yml",
)


@pytest.mark.parametrize("path", DPKG_READERS)
def test_roles_take_the_upstream_release_through_the_filter(path: str) -> None:
    text = (REPO / path).read_text()
    assert "| gpuforge.gpu.upstream_version" in text
    assert not re.search(r"\.version \| default\(''\)\s*\|\s*regex_replace", text)


def test_the_wheel_decision_passes_the_compatibility_the_apt_one_passes() -> None:
    """Both NCCL install methods judge the installed NCCL against the aws-ofi-nccl in use."""
    calls = dict(_policy_calls())
    apt, wheel = calls["roles/nccl/tasks/install_apt.yml"], calls["roles/nccl/tasks/install_wheel.yml"]
    for argument in (
        "compatible=gpuforge_ofi_nccl_range.outside | length == 0",
        "incompatible_reason=gpuforge_ofi_nccl_range.outside",
    ):
        assert argument in apt and argument in wheel
    for path in ("roles/nccl/tasks/install_apt.yml", "roles/nccl/tasks/install_wheel.yml"):
        imported = [t.get("ansible.builtin.import_tasks") for t in yaml.safe_load((REPO / path).read_text())]
        assert imported.index("plugin_range.yml") < imported.index("pair_check.yml"), path


def _filter(case: str, reality: dict[str, Any] | None = None) -> dict[str, Any]:
    """The case through the roles' filter, with its values as a role passes them (templated strings)."""
    installed, pin, floor, compatible, allow, previous, _ = CASES[case]
    result: dict[str, Any] = version_policy.version_decision(
        reality or {},
        "component",
        installed,
        pin,
        floor,
        compatible=str(compatible),
        incompatible_reason="" if compatible else "outside the tested range",
        allow_downgrade=str(allow),
        previous_manifest={"installed": {"component": {"version": installed, "source": previous}}}
        if previous
        else {},
    )
    return result


@pytest.mark.parametrize("case", list(CASES))
def test_role_filter_records_the_decision(case: str) -> None:
    """The roles' filter records the policy's decision field by field; a refusal fails with its message."""
    expected = _python(case)
    if expected.action == "refuse":
        with pytest.raises(AnsibleFilterError) as refused:
            _filter(case)
        assert str(refused.value) == expected.message
        return
    assert _filter(case) == {"component": expected.record()}


def test_role_filter_keeps_the_other_components_records() -> None:
    earlier = {"nccl": {"action": "adopt", "version": "2.27.7"}, "component": {"action": "install"}}
    got = _filter("same-as-pin", earlier)
    assert got == {"nccl": earlier["nccl"], "component": _python("same-as-pin").record()}
    assert earlier["component"] == {"action": "install"}  # the input is not changed in place


@pytest.mark.parametrize(
    ("installed", "expected"), [(None, "install"), (" 2.0.1\n", "keep"), ("1:3.0.0", "adopt")]
)
def test_role_filter_takes_probe_output_as_the_roles_give_it(installed: Any, expected: str) -> None:
    got = version_policy.version_decision({}, "c", installed, "2.0.1", "1.0.0")
    assert got["c"]["action"] == expected


@pytest.mark.parametrize(("pin", "floor"), [("", "1.0.0"), ("2.0.1", None)])
def test_role_filter_refuses_a_missing_pin_or_floor(pin: str, floor: Any) -> None:
    with pytest.raises(AnsibleFilterError, match="the pin and the floor are required"):
        version_policy.version_decision({}, "c", "1.0.0", pin, floor)


def _policy_calls() -> list[tuple[str, str]]:
    """Every role task that records a version decision, with its template."""
    calls = []
    for path in sorted((REPO / "roles").glob("*/tasks/*.yml")):
        for task in yaml.safe_load(path.read_text()) or []:
            fact = (task.get("ansible.builtin.set_fact") or {}).get("gpuforge_reality", "")
            if "gpuforge.gpu.version_decision" in fact:
                calls.append((str(path.relative_to(REPO)), fact))
    return calls


def test_every_stack_role_decides_through_the_filter_with_the_opt_in() -> None:
    """The roles that used the Jinja copy now call the filter, each passing the opt-in and the manifest."""
    calls = _policy_calls()
    components = {c for _, fact in calls for c in re.findall(r"version_decision\('([a-z_]+)'", fact)}
    assert components == {
        "aws_ofi_nccl",
        "efa_installer",
        "dcgm",
        "nvidia_container_toolkit",
        "nccl",
        "nccl_tests",
        "nvidia_driver",
    }
    for path, fact in calls:
        assert f"allow_downgrade={policy.ALLOW_DOWNGRADE_VARIABLE}" in fact, path
        assert "previous_manifest=gpuforge_previous_manifest" in fact, path
    assert not (REPO / "roles/gpuforge_common/tasks/policy.yml").exists()


def test_the_opt_in_is_a_default_of_the_shared_role() -> None:
    defaults = (REPO / "roles/gpuforge_common/defaults/main.yml").read_text()
    assert f"{policy.ALLOW_DOWNGRADE_VARIABLE}: false" in defaults


@pytest.mark.parametrize(
    ("version", "minimum", "expected"),
    [
        ("1.21.1", "1.21.1", True),
        ("1.22.0", "1.21.1", True),
        ("1.9.1", "1.21.1", False),  # number by number, not as text
        ("1:4.7.0", "4.7.0", True),  # a Debian epoch is not a number of the release
        ("595.91.07", "580.65.06", True),
        ("", "580.65.06", False),
        (None, "1.0", False),
    ],
)
def test_version_at_least_compares_as_the_policy_does(version: Any, minimum: str, expected: bool) -> None:
    """The one comparison the roles and drift.yml use for floors (they had number-list Jinja copies)."""
    assert version_policy.version_at_least(version, minimum) is expected
    if version:
        assert (policy.compare(version, minimum) >= 0) is expected


def test_no_role_or_playbook_compares_versions_in_jinja() -> None:
    copies = re.compile(r"regex_findall\('\[0-9\]\+'\)\s*\|\s*map\('int'\)")
    root = Path(__file__).resolve().parents[1]
    found = [
        str(path.relative_to(root))
        for folder in ("roles", "playbooks")
        for path in sorted((root / folder).rglob("*.yml"))
        if copies.search(path.read_text())
    ]
    assert found == []


def test_the_decision_is_reported_in_one_line_per_component() -> None:
    """What each role prints after deciding (tests/test_twins.py reads it from a real bake)."""
    reality = version_policy.version_decision({}, "nvidia_container_toolkit", "1.17.0", "1.19.1", "1.17.8")
    assert version_policy.version_decision_message(reality, "nvidia_container_toolkit") == (
        "nvidia_container_toolkit: install 1.19.1 (gpuforge); "
        "installed before: 1.17.0, floor 1.17.8, pin 1.19.1; " + reality["nvidia_container_toolkit"]["reason"]
    )
    with pytest.raises(AnsibleFilterError, match="no decision recorded for 'dcgm'"):
        version_policy.version_decision_message(reality, "dcgm")
