"""Shared fixtures. AWS is moto_server on loopback (a test double named as such)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuforge.lab import core as lab_core
from gpuforge.lab.moto import MotoServer, free_port

REPO = Path(__file__).resolve().parents[1]

# No test may ever ask the EC2 instance metadata service (169.254.169.254) for credentials or
# a region: botocore would, whenever a test runs without credentials. Subprocesses inherit this.
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
FLEET_LAB = "pytest"


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto_server process for the whole session (starting one costs ~1 s)."""
    server = MotoServer(port=free_port(), log_path=tmp_path_factory.mktemp("moto") / "moto.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def aws(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoServer]:
    """Point boto3 at a freshly reset moto_server for one test."""
    moto_server.reset()
    for key, value in moto_server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield moto_server


def _gpuforge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["gpuforge", *args], capture_output=True, text=True, check=False, cwd=REPO, timeout=600
    )


@pytest.fixture(scope="session")
def fleet_lab() -> Iterator[dict[str, str]]:
    """A 2-host lab with emulated EC2, shared by the tests that run playbooks on a fleet.

    Yields the environment (`gpuforge lab env`) that points Ansible and boto3 at it.
    """
    if os.geteuid() != 0 or not shutil.which("systemd-nspawn"):
        pytest.skip("the lab needs root and systemd-nspawn (apt-get install systemd-container)")
    _gpuforge("lab", "down", "--name", FLEET_LAB)
    up = _gpuforge("lab", "up", "--name", FLEET_LAB, "--nodes", "2", "--moto-port", str(free_port()))
    assert up.returncode == 0, up.stderr
    yield lab_core.env_exports(FLEET_LAB)
    _gpuforge("lab", "down", "--name", FLEET_LAB)


def _run_playbook(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ansible-playbook", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={**os.environ, **env, "ANSIBLE_FORCE_COLOR": "0"},
        timeout=1200,
    )


PlaybookRunner = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="session")
def run_playbook() -> PlaybookRunner:
    """run_playbook(env, *args): ansible-playbook from the repository root against a lab environment."""
    return _run_playbook
