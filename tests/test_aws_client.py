"""gpuforge.aws.client: each client reads credentials and endpoints afresh, but the API models are
parsed once per process; and a gpuforge command starts without the plotting libraries."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import botocore.loaders
import pytest

from gpuforge import aws


def _signing_key(client: Any) -> str:
    return str(client._request_signer._credentials.get_frozen_credentials().access_key)


def test_clients_share_the_parsed_models_and_read_settings_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_DATA_PATH", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFIRSTFIRSTFIRST0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "first")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    first = aws.client("ec2")
    loader = aws._LOADERS[None]
    paths = list(loader.search_paths)

    parsed: list[str] = []
    load_file = botocore.loaders.JSONFileLoader.load_file

    def counting(self: Any, file_path: str) -> Any:
        parsed.append(file_path)
        return load_file(self, file_path)

    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file", counting)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIASECONDSECONDSECO")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "second")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:2")
    second = aws.client("ec2", "eu-west-1")
    aws.client("ec2")
    # EC2's model (and the endpoints, paginators, waiters) were not read again...
    assert parsed == []
    # ...but the new credentials, endpoint and region were.
    assert _signing_key(first) == "AKIAFIRSTFIRSTFIRST0"
    assert _signing_key(second) == "AKIASECONDSECONDSECO"
    assert (first.meta.endpoint_url, second.meta.endpoint_url) == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert second.meta.region_name == "eu-west-1"
    # boto3 adds its data directory to the loader for every session: it is there once.
    assert loader.search_paths == paths
    assert len(set(paths)) == len(paths)


def test_a_command_starts_without_matplotlib() -> None:
    """matplotlib and numpy load only when `gpuforge nccl-report` draws its plots (tests/test_nccl.py)."""
    # build_parser imports every subcommand's module, as each command does before it runs.
    code = (
        "import sys\nfrom gpuforge import cli\ncli.build_parser()\n"
        "print(sorted({'matplotlib', 'numpy'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
