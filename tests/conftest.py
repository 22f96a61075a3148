"""Shared fixtures. AWS is moto_server on loopback (a test double named as such)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuforge.lab.moto import MotoServer, free_port

REPO = Path(__file__).resolve().parents[1]


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
