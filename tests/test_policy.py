"""The version policy, decided by the Python module (gpuforge.policy) and by the roles' tasks file
(roles/gpuforge_common/tasks/policy.yml) over the same cases: adopt, keep, install, refuse to
downgrade, and the one opt-in. The role side runs in one check-mode play on the control host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuforge import policy
from localplay import record, run_cases

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


@pytest.fixture(scope="module")
def role_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cases: dict[str, list[dict[str, Any]]] = {}
    for case, (installed, pin, floor, compatible, allow, previous, _) in CASES.items():
        cases[case] = [
            {
                "ansible.builtin.include_role": {
                    "name": "gpuforge.gpu.gpuforge_common",
                    "tasks_from": "policy.yml",
                },
                "vars": {
                    "gpuforge_common_policy_component": "component",
                    "gpuforge_common_policy_installed": installed,
                    "gpuforge_common_policy_pin": pin,
                    "gpuforge_common_policy_floor": floor,
                    "gpuforge_common_policy_compatible": compatible,
                    "gpuforge_common_policy_incompatible_reason": ""
                    if compatible
                    else "outside the tested range",
                    "gpuforge_common_allow_downgrade": allow,
                    "gpuforge_previous_manifest": {
                        "installed": {"component": {"version": installed, "source": previous}}
                    }
                    if previous
                    else {},
                },
            },
            record(case, "{{ gpuforge_reality.component }}"),
        ]
    return run_cases(tmp_path_factory.mktemp("policy-play"), cases, {})


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_role_decides_as_python(role_results: dict[str, Any], case: str) -> None:
    """The role's record equals the Python decision field by field; a refusal fails with the same message."""
    got = role_results[case]
    expected = _python(case)
    if expected.action == "refuse":
        assert isinstance(got, str), f"{case} did not fail: {got}"
        assert " ".join(got.split()) == expected.message
        return
    assert got == expected.record()


def test_policy_file_and_module_name_the_same_opt_in() -> None:
    task = (Path(__file__).resolve().parents[1] / "roles/gpuforge_common/tasks/policy.yml").read_text()
    assert f"{policy.ALLOW_DOWNGRADE_VARIABLE}=true" in task
    defaults = (Path(__file__).resolve().parents[1] / "roles/gpuforge_common/defaults/main.yml").read_text()
    assert f"{policy.ALLOW_DOWNGRADE_VARIABLE}: false" in defaults
