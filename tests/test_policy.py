"""The version policy, decided once (plugins/plugin_utils/policy.py): the module the CLI imports
(ansible_collections.gpuforge.gpu.plugins.plugin_utils.policy) and the roles' action
gpuforge.gpu.component (plugins/action/component.py over plugins/plugin_utils/node_record.py), the one
writer of the node record, over the same cases: adopt, keep, install, refuse to downgrade, and the one
opt-in.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from ansible_collections.gpuforge.gpu.plugins.plugin_utils import node_record, policy

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


def _component_calls() -> dict[str, dict[str, Any]]:
    """Every role task that calls gpuforge.gpu.component, by file and component, with its arguments."""
    calls: dict[str, dict[str, Any]] = {}
    for path in sorted((REPO / "roles").glob("*/tasks/*.yml")):
        for task in yaml.safe_load(path.read_text()) or []:
            args = task.get("gpuforge.gpu.component")
            if isinstance(args, dict) and "component" in args:
                calls[f"{path.relative_to(REPO)}:{args['component']}"] = args
    return calls


def test_the_wheel_decision_passes_the_compatibility_the_apt_one_passes() -> None:
    """Both NCCL install methods judge the installed NCCL against the aws-ofi-nccl in use."""
    calls = _component_calls()
    apt, wheel = (
        calls["roles/nccl/tasks/install_apt.yml:nccl"],
        calls["roles/nccl/tasks/install_wheel.yml:nccl"],
    )
    for argument in ("compatible", "incompatible_reason"):
        assert "_nccl_ofi_range.outside" in apt[argument] and apt[argument] == wheel[argument]
    for path in ("roles/nccl/tasks/install_apt.yml", "roles/nccl/tasks/install_wheel.yml"):
        imported = [t.get("ansible.builtin.import_tasks") for t in yaml.safe_load((REPO / path).read_text())]
        assert imported.index("plugin_range.yml") < imported.index("pair_check.yml"), path


def _record(case: str, current: dict[str, Any] | None = None) -> node_record.Recorded:
    """The case through the node record's writer, as gpuforge.gpu.component calls it."""
    installed, pin, floor, compatible, allow, previous, _ = CASES[case]
    return node_record.record(
        current or {},
        "component",
        installed=installed,
        pin=pin,
        floor=floor,
        compatible=compatible,
        incompatible_reason="" if compatible else "outside the tested range",
        allow_downgrade=allow,
        previous_manifest={"installed": {"component": {"version": installed, "source": previous}}}
        if previous
        else {},
    )


@pytest.mark.parametrize("case", list(CASES))
def test_the_record_holds_the_policys_decision(case: str) -> None:
    """The node record's entry is the policy's decision field by field; a refusal records nothing and
    says the policy's message."""
    expected = _python(case)
    got = _record(case)
    if expected.action == "refuse":
        assert got.refused and got.message == expected.message and got.record == {}
        return
    assert got.record == {"component": expected.record()}
    assert got.outcome == ("installed" if expected.action in ("keep", "adopt") else "install")
    assert got.message == node_record.line("component", expected.record())


def test_the_record_keeps_the_other_components_entries() -> None:
    earlier = {"nccl": {"action": "adopt", "version": "2.27.7"}, "component": {"action": "install"}}
    got = _record("same-as-pin", earlier)
    assert got.record == {"nccl": earlier["nccl"], "component": _python("same-as-pin").record()}
    assert earlier["component"] == {"action": "install"}  # the input is not changed in place


@pytest.mark.parametrize(("pin", "floor"), [("", "1.0.0"), ("2.0.1", " ")])
def test_the_record_refuses_a_missing_pin_or_floor(pin: str, floor: str) -> None:
    with pytest.raises(ValueError, match="the pin and the floor are required"):
        node_record.record({}, "c", installed="1.0.0", pin=pin, floor=floor)


# What gpuforge itself already put in place (`ours`) and whether the role can install the pin
# (`installable`): case -> (installed, ours, installable, "<outcome> <action> <installed> <source>", or
# "none" when nothing is recorded). Pin 2.0.1, floor 2.0.0.
OURS_CASES: dict[str, tuple[str, str, bool, str]] = {
    # aws_ofi_nccl's earlier build of the pin beside an older bundle: kept, as gpuforge's (the role
    # forged a previous manifest to get this answer).
    "own-build-beside-an-older-bundle": ("1.9.1", "2.0.1", True, "ours keep 2.0.1 gpuforge"),
    "own-build-nothing-else": ("", "2.0.1", False, "ours keep 2.0.1 gpuforge"),
    # A bundle at or above the floor wins over an own build: the policy never replaces it.
    "adopted-bundle-wins": ("2.1.0", "2.0.1", True, "installed adopt 2.1.0 base_image"),
    # An own build of another release is no stand-in for the pin.
    "own-build-of-another-release": ("", "1.9.9", True, "install install '' gpuforge"),
    "nothing-installable": ("1.9.1", "", False, "none"),
    "fresh-install": ("", "", True, "install install '' gpuforge"),
}


@pytest.mark.parametrize("case", list(OURS_CASES))
def test_what_gpuforge_put_in_place_and_what_it_can_install(case: str) -> None:
    installed, ours, installable, expected = OURS_CASES[case]
    earlier = {"component": {"action": "install", "version": "2.0.1"}, "other": {"action": "keep"}}
    got = node_record.record(
        earlier,
        "component",
        installed=installed,
        pin="2.0.1",
        floor="2.0.0",
        ours=ours,
        installable=installable,
    )
    if expected == "none":
        assert (got.outcome, got.record, got.entry) == ("none", {"other": {"action": "keep"}}, {})
        assert "cannot install it: nothing recorded" in got.message
        return
    entry = got.record["component"]
    assert f"{got.outcome} {entry['action']} {entry['installed'] or repr('')} {entry['source']}" == expected
    assert entry["version"] == (installed if got.outcome == "installed" else "2.0.1")


def test_details_go_into_the_entry_and_kept_details_only_when_the_installed_release_stays() -> None:
    kept = node_record.record(
        {},
        "c",
        installed="2.0.1",
        pin="2.0.1",
        floor="1.0",
        details={"digest": "d"},
        kept_details={"dir": "/x"},
    )
    installing = node_record.record(
        {},
        "c",
        installed="0.9",
        pin="2.0.1",
        floor="1.0",
        details={"reason": "why"},
        kept_details={"dir": "/x"},
    )
    assert (kept.entry["digest"], kept.entry["dir"]) == ("d", "/x")
    assert installing.entry["reason"] == "why" and "dir" not in installing.entry


def test_every_stack_role_decides_through_the_action() -> None:
    """Each stack component is decided by gpuforge.gpu.component, and no role writes the node record
    itself (the action reads the opt-in and the previous manifest from the play: no role passes them)."""
    components = {name.split(":")[1] for name in _component_calls()}
    assert components == {
        "aws_ofi_nccl",
        "efa_installer",
        "dcgm",
        "dcgm_exporter",
        "nvidia_container_toolkit",
        "nccl",
        "nccl_tests",
        "nvidia_driver",
    }
    writers = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "roles").rglob("*.yml"))
        if re.search(r"^\s+gpuforge_reality:", path.read_text(), re.MULTILINE)
    ]
    assert writers == []
    assert not (REPO / "plugins/filter/version_decision.yml").exists()


# The action in a play (plugins/action/component.py): the record as a fact, started empty, the opt-in
# and the previous manifest read from the play, the one line printed, a refusal failing the task.
def test_the_action_records_reads_the_play_and_fails_on_a_refusal(tmp_path: Path) -> None:
    def call(**args: Any) -> dict[str, Any]:
        return {"gpuforge.gpu.component": args, "register": "_got"}

    included = tmp_path / "one-component.yml"
    included.write_text(yaml.safe_dump([call(component="{{ name }}", pin="1.0", floor="1.0")]))
    cases = {
        "kept-as-recorded": [
            {"gpuforge.gpu.component": {"begin": True}},
            call(component="c", installed=" 2.0.1\n", pin="2.0.1", floor="1.0.0"),
            record("kept-as-recorded", "{{ [ansible_facts.gpuforge_reality, _got.msg, _got.outcome] }}"),
        ],
        "refused": [
            call(component="d", installed="3.1.0", pin="2.0.1", floor="1.0.0", compatible=False),
            record("refused", "not refused"),
        ],
        "opted-in": [
            call(component="d", installed="3.1.0", pin="2.0.1", floor="1.0.0", compatible=False),
            record(
                "opted-in", "{{ ansible_facts.gpuforge_reality | dict2items | map(attribute='key') | list }}"
            ),
        ],
        "started-again": [
            {"gpuforge.gpu.component": {"begin": True}},
            record("started-again", "{{ ansible_facts.gpuforge_reality }}"),
        ],
        "missing-floor": [call(component="e", pin="1.0"), record("missing-floor", "not refused")],
        "looped": [
            {**call(component="{{ item }}", pin="1.0", floor="1.0"), "loop": ["f", "g"]},
            record("looped", "not refused"),
        ],
        "looped-with": [
            {**call(component="{{ item }}", pin="1.0", floor="1.0"), "with_items": ["f", "g"]},
            record("looped-with", "not refused"),
        ],
        "run-once": [
            {**call(component="h", pin="1.0", floor="1.0"), "run_once": True},
            record("run-once", "not refused"),
        ],
        # A role (here: tasks) included in a loop, as playbooks/rolling_update.yml includes its roles:
        # each item's call is one call on its host, and is recorded.
        "in-a-looped-include": [
            {
                "ansible.builtin.include_tasks": str(included),
                "loop": ["i", "j"],
                "loop_control": {"loop_var": "name"},
            },
            record("in-a-looped-include", "{{ ansible_facts.gpuforge_reality.keys() | sort }}"),
        ],
    }
    cases["opted-in"][0]["vars"] = {policy.ALLOW_DOWNGRADE_VARIABLE: True}
    play_vars = {
        "gpuforge_previous_manifest": {"installed": {"c": {"version": "2.0.1", "source": "gpuforge"}}}
    }
    got = run_cases(tmp_path, cases, play_vars)
    expected = policy.decide("c", "2.0.1", "2.0.1", "1.0.0", previous_source="gpuforge").record()
    assert got["kept-as-recorded"] == [{"c": expected}, node_record.line("c", expected), "installed"]
    assert got["refused"] == _refusal_message()
    assert got["opted-in"] == ["c", "d"]
    assert got["started-again"] == {}
    assert "missing parameter(s) required by 'component': floor" in got["missing-floor"]
    # A loop keeps only its last item's facts, run_once gives one host's to all: refused, not half-recorded.
    assert got["looped"] == "One or more items failed"  # each item with the message below
    assert got["looped-with"] == "One or more items failed"
    assert "once per component on the host it decides for" in got["run-once"]
    assert got["in-a-looped-include"] == ["i", "j"]


def _refusal_message() -> str:
    return policy.decide("d", "3.1.0", "2.0.1", "1.0.0", compatible=False, incompatible_reason="").message


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
    """What gpuforge.gpu.component prints (tests/test_twins.py reads it from a real bake)."""
    got = node_record.record({}, "nvidia_container_toolkit", installed="1.17.0", pin="1.19.1", floor="1.17.8")
    assert got.message == (
        "nvidia_container_toolkit: install 1.19.1 (gpuforge); "
        "installed before: 1.17.0, floor 1.17.8, pin 1.19.1; " + got.entry["reason"]
    )
