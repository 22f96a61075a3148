"""Shared fixtures. AWS is moto_server on loopback (a test double named as such)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import botocore.client
import pytest
from botocore.exceptions import ClientError

import iamaudit
import labtools
from gpuforge import aws as gpuforge_aws
from gpuforge_lab.moto import MotoServer, free_port

REPO = Path(__file__).resolve().parents[1]

# The unit layer's marker and selection, and the per-test timings the CI schedule is made from.
pytest_plugins = ["timing_plugin"]

# No test may ever ask the EC2 instance metadata service (169.254.169.254) for credentials or
# a region: botocore would, whenever a test runs without credentials. Subprocesses inherit this.
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
FLEET_LAB = labtools.lab_name("pytest")

# Every AWS call any test makes through gpuforge.aws (in this process or a gpuforge subprocess)
# lands here; the session fails at the end if the pipeline made one its IAM policy does not grant.
AWS_CALL_LOG = Path(
    os.environ.setdefault(
        gpuforge_aws.CALL_LOG_ENV, str(Path(tempfile.mkdtemp(prefix="gpuforge-aws-calls-")) / "calls.jsonl")
    )
)


_UNGRANTED: list[str] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _UNGRANTED[:] = iamaudit.ungranted(iamaudit.recorded_actions(AWS_CALL_LOG), iamaudit.load_policy())
    if _UNGRANTED:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _UNGRANTED:
        terminalreporter.section("AWS calls the pipeline's IAM policy does not grant", red=True)
        terminalreporter.write_line("packer/iam/pipeline-policy.json lacks (the session fails):")
        for line in _UNGRANTED:
            terminalreporter.write_line(f"  {line}")


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


@pytest.fixture(scope="session")
def fleet_lab() -> Iterator[dict[str, str]]:
    """A 2-host lab with emulated EC2, shared by the tests that run playbooks on a fleet.

    Yields the environment (`gpuforge-lab env`) that points Ansible and boto3 at it.
    """
    if os.geteuid() != 0 or not shutil.which("systemd-nspawn"):
        pytest.skip("the lab needs root and systemd-nspawn (apt-get install systemd-container)")
    with labtools.lab(FLEET_LAB, 2) as info:
        yield info["env"]


PlaybookRunner = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="session")
def run_playbook() -> PlaybookRunner:
    """run_playbook(env, *args): ansible-playbook from the repository root against a lab environment."""
    return labtools.playbook


@pytest.fixture
def no_aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Fail any botocore API call (the test stays offline, not even moto); yields the calls tried."""
    calls: list[str] = []

    def refuse(self: Any, operation: str, params: Any) -> Any:
        calls.append(operation)
        raise AssertionError(f"called AWS: {operation}")

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", refuse)
    yield calls
    assert calls == []


def _refuse(monkeypatch: pytest.MonkeyPatch, service: str, operation: str, code: str) -> None:
    """Every gpuforge.aws client of `service` answers `operation` with a ClientError of `code`."""
    original = gpuforge_aws.client

    def denying_client(name: str, region_name: str | None = None) -> Any:
        client = original(name, region_name)

        def deny(**_: Any) -> None:
            error = {"Code": code, "Message": "You are not authorized to perform this"}
            raise ClientError({"Error": error}, operation)

        client.meta.events.register(f"before-call.{service}.{operation}", deny)
        return client

    monkeypatch.setattr(gpuforge_aws, "client", denying_client)


@pytest.fixture
def imdsv2_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """EC2 refuses ModifyInstanceMetadataOptions (as for a role without ec2:ModifyInstanceMetadataOptions)."""
    _refuse(monkeypatch, "ec2", "ModifyInstanceMetadataOptions", "UnauthorizedOperation")


@pytest.fixture
def refuse_aws(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str, str], None]:
    """refuse_aws(service, operation, code): gpuforge.aws clients answer that call with a ClientError."""
    return functools.partial(_refuse, monkeypatch)
