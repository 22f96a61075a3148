"""Failure paths on a lab host: a wrong key, a wrong signature, an unknown version and a wrong
checksum each stop the run early with a clear message and leave the host as it was.

Each test runs a playbook from molecule/nvidia/negative/ with ansible-playbook against the
scenario's inventory, then inspects the host. The repositories and artifact are the TEST FIXTURES
tests/fixtures/nvidia/prepare.yml built (with files/build-fixture-repos.sh there); the impostor
repository is signed by a second
test-only key.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

from gpuforge import versions

testinfra_hosts = ["nvidia-compute"]

SCENARIO = Path(__file__).resolve().parent.parent
FIXTURE = "file:///srv/gpuforge-fixture"
FIXTURE_FPR = "1BFC70D46F4EA877C7A9426A21D9BFD25F4C1F80"
IMPOSTOR_FPR = "C397662EE561D9E826AE3E993B265602F3675E67"
PINS = versions.load().components
# nvidia_driver_debian_package_version: the lab's stand-in packaging of the pin.
DEB_VERSION = PINS["nvidia_driver"]["version"] + "-1"


# Each failure path reruns its role's dependencies (gpuforge_common, nvidia_driver) up to the
# failing task, about 80 tasks; mitogen (plugins/strategy, a dev dependency) runs them in one
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


def _play(playbook: str, extra: dict[str, object]) -> str:
    """Run a failure-path playbook on the compute host; assert it failed; return its output.

    The output comes back with colours stripped and whitespace collapsed, so messages that
    Ansible wraps over several lines can be matched as one string.
    """
    env = dict(
        os.environ,
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_CALLBACK_RESULT_FORMAT="json",
        **_STRATEGY,
    )
    result = subprocess.run(
        [
            "ansible-playbook",
            "-i",
            os.environ["MOLECULE_INVENTORY_FILE"],
            "--limit",
            "nvidia-compute",
            str(SCENARIO / "negative" / playbook),
            "-e",
            json.dumps(extra),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode != 0, result.stdout[-2000:]
    output = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)
    return " ".join(output.split())


def _negative_repo(uri: str, fingerprint: str) -> dict[str, object]:
    return {
        "negative_repo": {
            "name": "gpuforge-negative",
            "uri": uri,
            "key_url": f"{FIXTURE}/apt/fixture-repo-key.pub.asc",
            "key_fingerprint": fingerprint,
            "key_variable": "the test's key_fingerprint",
        }
    }


def _assert_repo_absent(host) -> None:
    assert not host.file("/etc/apt/sources.list.d/gpuforge-negative.sources").exists
    assert not host.file("/etc/apt/keyrings/gpuforge-negative.asc").exists


def test_wrong_key_fingerprint_stops_before_trusting(host):
    """A key whose fingerprint is not the pin is refused; apt gets neither key nor source."""
    output = _play("apt_repo.yml", _negative_repo(f"{FIXTURE}/apt/cuda/", IMPOSTOR_FPR))
    assert f"expected {IMPOSTOR_FPR}" in output
    assert f"[{FIXTURE_FPR}]" in output
    assert "Nothing was trusted or installed" in output
    _assert_repo_absent(host)


def test_wrong_signature_stops_and_removes_the_source(host):
    """A repository signed by another key fails apt's check; the source and key are removed again."""
    output = _play("apt_repo.yml", _negative_repo(f"{FIXTURE}/apt/impostor/", FIXTURE_FPR))
    assert "apt could not refresh" in output
    _assert_repo_absent(host)
    # The host's apt still works: nothing broken was left behind.
    assert host.run("sudo apt-get update -qq").rc == 0
    assert not host.package("gpuforge-fixture-impostor").is_installed


def test_unknown_toolkit_version_fails_before_installing(host):
    """A toolkit the policy must install (the floor raised above what is there) but the repository
    does not have fails with the versions it does have."""
    output = _play(
        "role.yml",
        {
            "negative_role": "gpuforge.gpu.nvidia_container_toolkit",
            "nvidia_container_toolkit_version": "1.99.0",
            "nvidia_container_toolkit_package_version": "1.99.0-1",
            "nvidia_container_toolkit_floor": "1.99.0",
        },
    )
    assert "nvidia-container-toolkit 1.99.0-1 is not in the configured apt" in output
    assert PINS["nvidia_container_toolkit"]["package_version"] in output
    pinned = PINS["nvidia_container_toolkit"]["package_version"]
    assert host.package("nvidia-container-toolkit").version == pinned


def test_malformed_driver_version_fails_validation(host):
    """A driver version that is not an exact release ('latest') fails in validation."""
    output = _play(
        "role.yml", {"negative_role": "gpuforge.gpu.nvidia_driver", "nvidia_driver_version": "latest"}
    )
    assert "is not a known driver version string" in output
    assert host.package("nvidia-smi").version == DEB_VERSION


def test_wrong_exporter_checksum_keeps_the_verified_binary(host):
    """A dcgm-exporter artifact whose sha256 differs from the pin is refused; the binary is unchanged."""
    before = host.file("/usr/local/bin/dcgm-exporter").sha256sum
    output = _play(
        "role.yml", {"negative_role": "gpuforge.gpu.dcgm", "dcgm_exporter_binary_sha256": "0" * 64}
    )
    assert "checksum" in output.lower()
    assert host.file("/usr/local/bin/dcgm-exporter").sha256sum == before
