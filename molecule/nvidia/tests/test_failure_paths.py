"""Failure paths on a lab host: a wrong key, a wrong signature, an unknown version and a wrong
checksum each stop the run early with a clear message and leave the host as it was.

The five cases run in ONE ansible-playbook run on the compute host (built by _failure_play): each
case includes its role with the bad input inside block/rescue, the rescue records the task that
failed and its message, and the host's state is read right after the case. Each test then
asserts on its own case. Five ansible-playbook runs did this before (264 task runs, five fact
gatherings); the one play runs 178. The roles' dependencies (gpuforge_common, nvidia_driver) run
once, in the toolkit case: Ansible runs a dependency once per play, so the dcgm case starts at
dcgm's own tasks. What they do on a converged host converge, idempotence and check proved.

The repositories and artifact are the TEST FIXTURES tests/fixtures/nvidia/prepare.yml built (with
files/build-fixture-repos.sh there); the impostor repository is signed by a second test-only key.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuforge import versions

SCENARIO = Path(__file__).resolve().parent.parent
FIXTURE = "file:///srv/gpuforge-fixture"
FIXTURE_FPR = "1BFC70D46F4EA877C7A9426A21D9BFD25F4C1F80"
IMPOSTOR_FPR = "C397662EE561D9E826AE3E993B265602F3675E67"
PINS = versions.load().components
# nvidia_driver_debian_package_version: the lab's stand-in packaging of the pin.
DEB_VERSION = PINS["nvidia_driver"]["version"] + "-1"
NEGATIVE_SOURCE = "/etc/apt/sources.list.d/gpuforge-negative.sources"
NEGATIVE_KEY = "/etc/apt/keyrings/gpuforge-negative.asc"
EXPORTER = "/usr/local/bin/dcgm-exporter"
PACKAGES = ["nvidia-container-toolkit", "nvidia-smi", "gpuforge-fixture-impostor"]


# The play runs under mitogen_linear (plugins/strategy, a dev dependency) when installed: one
# interpreter per host. The messages and the host's state are the roles' own, whatever the
# strategy; converge, idempotence and check above run under the default `linear`.
_STRATEGY = (
    {
        "ANSIBLE_STRATEGY": "mitogen_linear",
        "ANSIBLE_STRATEGY_PLUGINS": str(SCENARIO.parent.parent / "plugins" / "strategy"),
    }
    if importlib.util.find_spec("ansible_mitogen")
    else {}
)


def _negative_repo(uri: str, fingerprint: str) -> dict[str, str]:
    """nvidia_apt_repo's inputs for a repository the role must refuse."""
    return {
        "nvidia_apt_repo_name": "gpuforge-negative",
        "nvidia_apt_repo_uri": uri,
        "nvidia_apt_repo_key_url": f"{FIXTURE}/apt/fixture-repo-key.pub.asc",
        "nvidia_apt_repo_key_fingerprint": fingerprint,
        "nvidia_apt_repo_key_variable": "the test's key_fingerprint",
    }


# case: (role, the bad input on top of the lab's fixture variables), run in this order.
CASES: dict[str, tuple[str, dict[str, str]]] = {
    "wrong_key": ("gpuforge.gpu.nvidia_apt_repo", _negative_repo(f"{FIXTURE}/apt/cuda/", IMPOSTOR_FPR)),
    "wrong_signature": (
        "gpuforge.gpu.nvidia_apt_repo",
        _negative_repo(f"{FIXTURE}/apt/impostor/", FIXTURE_FPR),
    ),
    "unknown_toolkit": (
        "gpuforge.gpu.nvidia_container_toolkit",
        {
            "nvidia_container_toolkit_version": "1.99.0",
            "nvidia_container_toolkit_package_version": "1.99.0-1",
            "nvidia_container_toolkit_floor": "1.99.0",
        },
    ),
    "malformed_driver": ("gpuforge.gpu.nvidia_driver", {"nvidia_driver_version": "latest"}),
    # The binary method is opt-in (the lab runs the default package method): its fixture artifact
    # with a sha256 that is not the artifact's.
    "wrong_checksum": (
        "gpuforge.gpu.dcgm",
        {
            "dcgm_exporter_install_method": "binary",
            "dcgm_exporter_binary_url": f"{FIXTURE}/artifacts/dcgm-exporter",
            "dcgm_exporter_binary_sha256": "0" * 64,
        },
    ),
}


def _record(key: str, value: object) -> dict[str, Any]:
    """A task that stores `value` (templated) under `key` in the play's results."""
    return {
        "name": f"Record {key}",
        "ansible.builtin.set_fact": {
            "_negative_results": "{{ _negative_results | combine({_key: _value}) }}"
        },
        "vars": {"_key": key, "_value": value},
    }


def _read_state(key: str) -> list[dict[str, Any]]:
    """Tasks that record what the tests check on the host: files (with sha256) and packages."""
    return [
        {
            "name": f"Read the files ({key})",
            "ansible.builtin.stat": {"path": "{{ item }}", "checksum_algorithm": "sha256"},
            "loop": [NEGATIVE_SOURCE, NEGATIVE_KEY, EXPORTER],
            "register": "_negative_files",
        },
        {
            # As testinfra's Package reads them on Debian.
            "name": f"Read the packages ({key})",
            "ansible.builtin.command": {
                "argv": ["dpkg-query", "-f", "${Status}|${Version}", "-W", "{{ item }}"]
            },
            "loop": PACKAGES,
            "register": "_negative_packages",
            "changed_when": False,
            "failed_when": "_negative_packages.rc not in [0, 1]",
        },
        _record(
            key,
            {
                "files": "{{ dict(_negative_files.results | map(attribute='item')"
                " | zip(_negative_files.results | map(attribute='stat'))) }}",
                "packages": "{{ dict(_negative_packages.results | map(attribute='item')"
                " | zip(_negative_packages.results | map(attribute='rc')"
                " | zip(_negative_packages.results | map(attribute='stdout')))) }}",
            },
        ),
    ]


def _case(case: str, role: str, bad_input: dict[str, str]) -> list[dict[str, Any]]:
    tasks: list[dict[str, Any]] = [
        {
            "name": f"Case {case}",
            "block": [
                {
                    "name": f"Run {role} with the bad input",
                    "ansible.builtin.include_role": {"name": role},
                    "vars": bad_input,
                },
                _record(case, {"failed": False}),
            ],
            "rescue": [
                _record(
                    case,
                    {
                        "failed": True,
                        "task": "{{ ansible_failed_task.name }}",
                        "msg": "{{ ansible_failed_result.msg | default('') }}",
                    },
                )
            ],
        },
        *_read_state(f"{case}_after"),
    ]
    if case == "wrong_signature":
        # One index refresh, not ansible.builtin.apt's default five with backoff (about 35 s of
        # sleeps here): a repository signed by another key fails the same way every time, and the
        # role's rescue and message are what is under test (apt's own error is checked below).
        tasks[0]["module_defaults"] = {"ansible.builtin.apt": {"update_cache_retries": 1}}
        # The host's apt still works: nothing broken was left behind.
        tasks += [
            {
                "name": "Refresh apt after the refused repository",
                "ansible.builtin.command": {"argv": ["apt-get", "update", "-qq"]},
                "register": "_negative_apt_update",
                "changed_when": False,
                "failed_when": False,
            },
            _record("apt_update_rc", "{{ _negative_apt_update.rc }}"),
        ]
    return tasks


def _failure_play(results: Path) -> list[dict[str, Any]]:
    tasks: list[dict[str, Any]] = []
    for case, (role, bad_input) in CASES.items():
        tasks += _case(case, role, bad_input)
    tasks.append(
        {
            "name": "Write the results on the control host",
            "ansible.builtin.copy": {
                "content": "{{ _negative_results | to_json }}",
                "dest": str(results),
                "mode": "0600",
            },
            "delegate_to": "localhost",
            "become": False,
        }
    )
    return [
        {
            "name": "Run each failure path and record how it failed",
            "hosts": "nvidia-compute",
            "become": True,
            "vars_files": [str(SCENARIO.parent.parent / "inventory/group_vars/gpuforge_lab/artifacts.yml")],
            "vars": {"_negative_results": {}},
            "tasks": tasks,
        }
    ]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the failure play once on the compute host; what it recorded, by case."""
    out = tmp_path_factory.mktemp("failure-paths")
    (out / "play.yml").write_text(yaml.safe_dump(_failure_play(out / "results.json"), sort_keys=False))
    env = dict(os.environ, ANSIBLE_FORCE_COLOR="0", ANSIBLE_NOCOLOR="1", **_STRATEGY)
    result = subprocess.run(
        ["ansible-playbook", "-i", os.environ["MOLECULE_INVENTORY_FILE"], str(out / "play.yml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    recorded: dict[str, Any] = json.loads((out / "results.json").read_text())
    return recorded


def _failure(results: dict[str, Any], case: str) -> str:
    """The case failed; its message, whitespace collapsed (Ansible folds long messages)."""
    outcome = results[case]
    assert outcome["failed"], f"{case} did not fail"
    return " ".join(re.sub(r"\x1b\[[0-9;]*m", "", outcome["msg"]).split())


def _exists(results: dict[str, Any], key: str, path: str) -> bool:
    return bool(results[key]["files"][path]["exists"])


def _assert_repo_absent(results: dict[str, Any], key: str) -> None:
    assert not _exists(results, key, NEGATIVE_SOURCE)
    assert not _exists(results, key, NEGATIVE_KEY)


def _package(results: dict[str, Any], key: str, name: str) -> tuple[bool, str]:
    """(installed, version) as testinfra's Package says it on Debian."""
    rc, out = results[key]["packages"][name]
    status, _, version = out.partition("|")
    return rc == 0 and status.split()[2] == "installed", version


def test_wrong_key_fingerprint_stops_before_trusting(results: dict[str, Any]) -> None:
    """A key whose fingerprint is not the pin is refused; apt gets neither key nor source."""
    output = _failure(results, "wrong_key")
    assert f"expected {IMPOSTOR_FPR}" in output
    assert f"[{FIXTURE_FPR}]" in output
    assert "Nothing was trusted or installed" in output
    _assert_repo_absent(results, "wrong_key_after")


def test_wrong_signature_stops_and_removes_the_source(results: dict[str, Any]) -> None:
    """A repository signed by another key fails apt's check; the source and key are removed again."""
    output = _failure(results, "wrong_signature")
    assert "apt could not refresh" in output
    # Refused for the signature (apt names the impostor's key), not for an unreachable repository.
    assert f"NO_PUBKEY {IMPOSTOR_FPR[-16:]}" in output
    _assert_repo_absent(results, "wrong_signature_after")
    # The host's apt still works: nothing broken was left behind.
    assert int(results["apt_update_rc"]) == 0
    assert not _package(results, "wrong_signature_after", "gpuforge-fixture-impostor")[0]


def test_unknown_toolkit_version_fails_before_installing(results: dict[str, Any]) -> None:
    """A toolkit the policy must install (the floor raised above what is there) but the repository
    does not have fails with the versions it does have."""
    output = _failure(results, "unknown_toolkit")
    assert "nvidia-container-toolkit 1.99.0-1 is not in the configured apt" in output
    assert PINS["nvidia_container_toolkit"]["package_version"] in output
    pinned = PINS["nvidia_container_toolkit"]["package_version"]
    assert _package(results, "unknown_toolkit_after", "nvidia-container-toolkit") == (True, pinned)


def test_malformed_driver_version_fails_validation(results: dict[str, Any]) -> None:
    """A driver version that is not an exact release ('latest') fails in validation."""
    output = _failure(results, "malformed_driver")
    assert "is not a known driver version string" in output
    assert _package(results, "malformed_driver_after", "nvidia-smi") == (True, DEB_VERSION)


def test_wrong_exporter_checksum_installs_no_binary(results: dict[str, Any]) -> None:
    """A dcgm-exporter artifact (binary method, opt-in) whose sha256 differs from the pin is refused;
    no binary is written (the lab's default package method never had one there)."""
    assert not _exists(results, "malformed_driver_after", EXPORTER)
    output = _failure(results, "wrong_checksum")
    assert "checksum" in output.lower()
    assert not _exists(results, "wrong_checksum_after", EXPORTER)
