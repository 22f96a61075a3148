"""The lab page's commands (docs/lab.md), pasted as they are into a fresh root shell in the checkout.

The after-demo block runs on a lab of its own (named `demo`, plus GPUFORGE_TEST_LAB_SUFFIX when
several checkouts share the machine) in `env -i bash -e`: nothing of this test's environment (no
activated venv, no lab variables) reaches it.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import labtools

REPO = Path(__file__).resolve().parents[1]
LAB_DOC = (REPO / "docs" / "lab.md").read_text()
FRESH_ENV = {
    "HOME": os.environ.get("HOME", "/root"),
    "USER": "root",
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "TERM": "dumb",
    "LANG": "C.UTF-8",
}


def block_after(marker: str) -> str:
    """The first ```sh block after the paragraph that starts with marker."""
    start = LAB_DOC.index(marker)
    match = re.search(r"```sh\n(.*?)```", LAB_DOC[start:], re.DOTALL)
    assert match is not None, f"no sh block after {marker!r}"
    return match.group(1)


AFTER_DEMO = block_after("After `make demo` the lab stays up")


def fresh_shell(script: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            "env",
            "-i",
            *(f"{k}={v}" for k, v in {**FRESH_ENV, **(extra_env or {})}.items()),
            "bash",
            "-e",
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        timeout=900,
    )


def test_a_failed_lab_env_stops_the_block() -> None:
    """Without the venv, or for a lab that is not up, the env line fails visibly (no silent empty eval)."""
    line = next(line for line in AFTER_DEMO.splitlines() if "gpuforge-lab env" in line)
    without_venv = fresh_shell(line)
    assert without_venv.returncode != 0
    assert "gpuforge-lab: command not found" in without_venv.stderr
    no_lab = fresh_shell("source .venv/bin/activate\n" + line.replace("--name demo", "--name nosuchlab"))
    assert no_lab.returncode != 0
    assert "gpuforge-lab: error: lab 'nosuchlab' is not up" in no_lab.stderr


@pytest.fixture(scope="module")
def demo_lab() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("the lab needs root")
    name = labtools.lab_name("demo")
    with labtools.lab(name, 2):
        yield name


SSHD_DOWN = block_after("A host whose `sshd` is down")


def test_the_sshd_down_block_enters_the_namespaces_the_lab_uses() -> None:
    """The page's nsenter line is the lab's own way in (gpuforge_lab.host.inside)."""
    from gpuforge_lab import host

    flags = " ".join(host.inside("PID")[3:])
    assert 'nsenter --target "$(cut -d' in SSHD_DOWN and flags in SSHD_DOWN


@pytest.mark.lab
def test_the_sshd_down_block_brings_a_host_back(demo_lab: str) -> None:
    """Runs before the after-demo block, which takes the lab down at its end."""
    stop = labtools.gpuforge_lab(
        "ssh", "--name", demo_lab, "gpu-st-p5-48xlarge-1", "--", "sudo systemctl stop ssh"
    )
    assert stop.returncode in (0, 255), stop.stderr
    down = labtools.gpuforge_lab("ssh", "--name", demo_lab, "gpu-st-p5-48xlarge-1", "--", "true")
    assert down.returncode != 0
    result = fresh_shell(
        "source .venv/bin/activate\n" + SSHD_DOWN.replace("--name demo", f"--name {demo_lab}")
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    back = labtools.gpuforge_lab("ssh", "--name", demo_lab, "gpu-st-p5-48xlarge-1", "--", "true")
    assert back.returncode == 0, back.stderr


@pytest.mark.lab
def test_the_after_demo_block_runs_verbatim(demo_lab: str) -> None:
    script = AFTER_DEMO.replace("--name demo", f"--name {demo_lab}")
    # make lab-down takes the lab named by DEMO_LAB (the Makefile's default: demo).
    result = fresh_shell(script, {"DEMO_LAB": demo_lab})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "@all:" in result.stdout and "|--@cluster_" in result.stdout
    assert result.stdout.count("SUCCESS") == 2
    assert "gpu-st-p5-48xlarge-1" in result.stdout
    # make lab-down at the end of the block took the lab down.
    assert labtools.gpuforge_lab("status", "--name", demo_lab).returncode != 0
