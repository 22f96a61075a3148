"""The efa role refuses a bad EFA installer download before anything changes, on a real lab host.

The installer served here is the signed TEST FIXTURE built by gpuforge_lab.artifacts.fixtures (a stand-in
efa_installer.sh signed by a throwaway key generated for this test run), served by the local
artifact server on the lab's bridge gateway. Needs root and systemd-nspawn (the lab).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import labtools
from gpuforge import versions
from gpuforge_lab.artifacts import fixtures, server
from labtools import gpuforge_lab

REPO = Path(__file__).resolve().parents[1]
LAB = labtools.lab_name("t-efa")
BIN = Path(sys.executable).parent

pytestmark = [
    pytest.mark.lab,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("systemd-nspawn") or not shutil.which("gpg"),
        reason="needs root, systemd-nspawn (the lab) and gnupg",
    ),
]

# What a refused download must leave untouched: the installer's tree, the scratch area, the
# settings the role writes after installing, and the package set.
SNAPSHOT = (
    "ls -A /opt/amazon 2>/dev/null; echo --; ls -A /var/tmp; echo --; "
    "ls -A /etc/sysctl.d /etc/security/limits.d; echo --; dpkg-query -W -f '${Package} ${Version}\\n'"
)


@pytest.fixture(scope="module")
def lab() -> Iterator[dict[str, Any]]:
    with labtools.lab(LAB, 1, ec2=False) as info:
        yield info


@pytest.fixture(scope="module")
def served(
    lab: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, fixtures.Fixtures]]:
    built = fixtures.build(tmp_path_factory.mktemp("artifacts"), versions.load().version("efa_installer"))
    srv = server.ArtifactServer(Path(built.root), f"{lab['subnet_prefix']}.1", 0).start()
    yield srv.url, built
    srv.stop()


def on_host(lab: dict[str, Any], command: str) -> str:
    # ssh joins its arguments into one remote shell line, so the command is quoted as one word.
    out = gpuforge_lab(
        "ssh", "--name", LAB, lab["hosts"][0]["name"], "--", f"sudo sh -c {shlex.quote(command)}"
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def run_play(
    lab: dict[str, Any], tmp_path: Path, tasks: list[dict[str, Any]]
) -> subprocess.CompletedProcess[str]:
    node = lab["hosts"][0]
    inventory = tmp_path / "inventory.json"
    host = {
        "ansible_host": node["ip"],
        "ansible_user": lab["ssh_user"],
        "ansible_ssh_private_key_file": lab["ssh_key"],
        "gpuforge_instance_type": "p5.48xlarge",
    }
    inventory.write_text(json.dumps({"all": {"hosts": {"efa-node": host}}}))
    playbook = tmp_path / "efa.json"
    playbook.write_text(
        json.dumps([{"hosts": "all", "become": True, "vars": {"_refused": {}}, "tasks": tasks}])
    )
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
    }
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inventory), str(playbook)],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env=env,
        timeout=600,
    )


def run_efa(lab: dict[str, Any], tmp_path: Path, extra: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return run_play(
        lab, tmp_path, [{"ansible.builtin.include_role": {"name": "gpuforge.gpu.efa"}, "vars": extra}]
    )


def good_vars(url: str, built: fixtures.Fixtures) -> dict[str, Any]:
    return {
        "efa_installer_url_base": f"{url}/efa",
        "efa_installer_sha256": built.efa_sha256,
        "efa_installer_gpg_fingerprint": built.efa_key_fingerprint,
        "efa_installer_skip_kmod": True,
    }


REFUSALS = {
    "wrong-checksum": ({"efa_installer_sha256": "0" * 64}, ["EFA installer checksum mismatch", "0" * 64]),
    "wrong-signature": ({"efa_installer_url_base": "{url}/efa-badsig"}, ["signature check failed", "BADSIG"]),
    "unpinned-key": (
        {"efa_installer_url_base": "{url}/efa-wrongkey"},
        ["EFA signing key mismatch", "{impostor}"],
    ),
    "unknown-version": ({"efa_installer_version": "latest"}, ['"latest" is not an EFA installer release']),
    "version-without-sha256": (
        {"efa_installer_version": "1.99.0", "efa_installer_sha256": ""},
        ["No valid sha256 is pinned for the EFA installer 1.99.0"],
    ),
}


@pytest.fixture(scope="module")
def refused(
    lab: dict[str, Any], served: tuple[str, fixtures.Fixtures], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """One play tries every bad case (each in a block whose rescue keeps the failure message)."""
    url, built = served
    tasks: list[dict[str, Any]] = []
    for case, (overrides, _) in REFUSALS.items():
        values = {k: v.format(url=url) if isinstance(v, str) else v for k, v in overrides.items()}
        tasks.append(
            {
                "name": f"Case {case}",
                "block": [
                    {
                        "ansible.builtin.include_role": {"name": "gpuforge.gpu.efa"},
                        "vars": {**good_vars(url, built), **values},
                    }
                ],
                "rescue": [
                    {
                        "ansible.builtin.set_fact": {
                            "_refused": "{{ _refused | combine({_case: _message}) }}"
                        },
                        "vars": {
                            "_case": case,
                            "_message": "{{ ansible_failed_result.msg | default('none') }}",
                        },
                    }
                ],
            }
        )
    out = tmp_path_factory.mktemp("refusals")
    tasks.append(
        {
            "name": "Keep the collected messages on the control host",
            "ansible.builtin.copy": {
                "content": "{{ _refused | to_json }}",
                "dest": str(out / "refused.json"),
                "mode": "0600",
            },
            "delegate_to": "localhost",
            "become": False,
        }
    )
    before = on_host(lab, SNAPSHOT)
    result = run_play(lab, out, tasks)
    after = on_host(lab, SNAPSHOT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    messages: dict[str, str] = json.loads((out / "refused.json").read_text())
    return {"messages": messages, "before": before, "after": after, "output": output, "built": built}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_download_fails_early_with_a_clear_message(refused: dict[str, Any], case: str) -> None:
    """Each bad input stops the role with a message naming the problem."""
    assert case in refused["messages"], f"{case} did not fail: {refused['output'][-3000:]}"
    for message in REFUSALS[case][1]:
        assert message.format(impostor=refused["built"].impostor_fingerprint) in refused["messages"][case]


def test_refused_downloads_changed_nothing(refused: dict[str, Any]) -> None:
    """No case extracted or ran the installer, left a scratch directory, wrote settings or packages."""
    assert "TASK [efa : Extract the verified installer]" not in refused["output"]
    assert "TASK [efa : Run the EFA installer" not in refused["output"]
    assert refused["after"] == refused["before"]
    assert "gpuforge-efa-" not in refused["after"]


def test_good_download_installs_once_then_skips(
    lab: dict[str, Any], served: tuple[str, fixtures.Fixtures], tmp_path: Path
) -> None:
    """The control case: the same host and server with the right pins do install, exactly once."""
    url, built = served
    first = run_efa(lab, tmp_path, good_vars(url, built))
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    record = json.loads(on_host(lab, "cat /opt/amazon/efa-fixture-install.json"))
    assert record["version"] == built.efa_version
    assert record["runs"] == 1
    assert record["skip_kmod"] is True
    second = run_efa(lab, tmp_path, good_vars(url, built))
    assert second.returncode == 0
    assert "is already installed: not downloading or running it" in second.stdout
    assert json.loads(on_host(lab, "cat /opt/amazon/efa-fixture-install.json"))["runs"] == 1
