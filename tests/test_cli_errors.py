"""The CLI's last line of defence: botocore exceptions end as one `gpuforge: error:` line, and verbose
output (-v, and -vv with botocore's wire log) never shows credentials, signatures or session tokens.

The secret scan runs the installed `gpuforge` against moto (the test double for AWS) with credentials
shaped like real ones (an AKIA key id, a 40-character secret, a long session token), then searches
everything it printed for them and for any SigV4 signature.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import string
import subprocess
import sys
from pathlib import Path

import pytest

from gpuforge import aws as gpuforge_aws
from gpuforge import cli, logsafe
from gpuforge_lab.moto import MotoServer

BIN = Path(sys.executable).parent
_UPPER = string.ascii_uppercase + string.digits


def _credentials() -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": "AKIA" + "".join(secrets.choice(_UPPER) for _ in range(16)),
        "AWS_SECRET_ACCESS_KEY": secrets.token_urlsafe(30)[:40],
        "AWS_SESSION_TOKEN": "IQoJb3JpZ2luX2VjE" + secrets.token_urlsafe(300),
    }


def _run(moto: MotoServer, credentials: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(moto.env())
    env.update(credentials)
    return subprocess.run(
        [str(BIN / "gpuforge"), *argv], capture_output=True, text=True, env=env, timeout=300, check=False
    )


# A SigV4 signature is 64 hex digits; nothing else gpuforge prints is that long and hexadecimal.
_SIGNATURE = re.compile(r"\b[0-9a-f]{64}\b")


@pytest.mark.parametrize("verbosity", ["-v", "-vv"])
def test_verbose_output_shows_no_credentials(aws: MotoServer, verbosity: str) -> None:
    credentials = _credentials()
    runs = [
        _run(aws, credentials, verbosity, "publish", "--ami", "ami-0123456789abcdef0"),
        _run(aws, credentials, verbosity, "prune", "--keep", "1", "--allow-missing", "--dry-run"),
    ]
    output = "".join(r.stdout + r.stderr for r in runs)
    if verbosity == "-vv":
        # The wire log is really there (so the scan below has something to find), redacted.
        assert "Making request for OperationModel" in output, output[-3000:]
        assert logsafe.MARK in output
    for name, value in credentials.items():
        assert value not in output, f"{name} printed"
        assert value[:20] not in output, f"part of {name} printed"
    assert not _SIGNATURE.findall(output), "a request signature was printed"
    assert "Signature=" not in output.replace(f"Signature={logsafe.MARK}", "")


def test_canary_without_redaction_the_wire_log_shows_them(aws: MotoServer) -> None:
    """The same -vv run through an unredacted formatter prints the key id and token: the scan is real."""
    credentials = _credentials()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | aws.env() | credentials
    code = (
        "import logging, sys\n"
        "from gpuforge import cli, logsafe\n"
        "logsafe.redact = lambda text: text\n"
        "sys.exit(cli.main(['-vv', 'publish', '--ami', 'ami-0123456789abcdef0']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    output = result.stdout + result.stderr
    assert credentials["AWS_ACCESS_KEY_ID"] in output
    assert credentials["AWS_SESSION_TOKEN"] in output


@pytest.mark.parametrize(
    "line",
    [
        "Authorization': b'AWS4-HMAC-SHA256 Credential=AKIAABCDEFGHIJKLMNOP/20261204/us-east-1/ssm/"
        "aws4_request, "
        "SignedHeaders=host;x-amz-date, Signature=" + "a" * 64 + "'",
        "'X-Amz-Security-Token': b'IQoJb3JpZ2luX2VjEXAMPLETOKENVALUE'",
        "CanonicalRequest:\nPOST\n/\n\nhost:ssm.us-east-1.amazonaws.com\nx-amz-security-token:IQoJb3JpZ2luX2VjEXAMPLE",
        "Signature:\n" + "b" * 64,
        "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIAABCDEFGHIJKLMNOP%2F2026&X-Amz-Signature="
        + "c" * 64,
        'Response body: b\'{"Credentials":{"AccessKeyId":"ASIAABCDEFGHIJKLMNOP",'
        '"SecretAccessKey":"wJalrXUtnFEMI'
        'K7MDENGbPxRfiCYEXAMPLEKEY","SessionToken":"IQoJb3JpZ2luX2VjEXAMPLE"}}\'',
        "<SecretAccessKey>wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY</SecretAccessKey>",
    ],
)
def test_redact_removes_what_botocore_logs(line: str) -> None:
    redacted = logsafe.redact(line)
    for secret in ("AKIAABCDEFGHIJKLMNOP", "ASIAABCDEFGHIJKLMNOP", "IQoJb3JpZ2luX2Vj", "wJalrXUtnFEMI"):
        assert secret not in redacted, redacted
    assert not _SIGNATURE.search(redacted), redacted


def test_redact_removes_the_environments_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "an-unusual/secret+value-1234567890")
    assert logsafe.redact("x an-unusual/secret+value-1234567890 y") == f"x {logsafe.MARK} y"


def _handler_calling(call: str) -> cli.Handler:
    def handler(args: argparse.Namespace) -> int:
        client = gpuforge_aws.client("ssm")
        if call == "empty-name":
            client.get_parameter(Name="")
        return 0

    return handler


def test_param_validation_error_is_one_line_exit_2(
    aws: MotoServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """botocore's client-side check of a request (here: an empty parameter name) is the user's input."""
    from gpuforge.commands import ami as ami_commands

    monkeypatch.setattr(ami_commands.Publish, "execute", staticmethod(_handler_calling("empty-name")))
    assert cli.main(["publish", "--ami", "ami-0123456789abcdef0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpuforge: error: Parameter validation failed: ")


def test_client_error_outside_gpuforge_handling_is_one_line_exit_1(
    aws: MotoServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuforge.commands import ami as ami_commands

    def handler(args: argparse.Namespace) -> int:
        gpuforge_aws.client("ec2").describe_images(ImageIds=["ami-0123456789abcdef0"])
        return 0

    monkeypatch.setattr(ami_commands.Publish, "execute", staticmethod(handler))
    assert cli.main(["publish", "--ami", "ami-0123456789abcdef0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "gpuforge: error: An error occurred (InvalidAMIID.NotFound)"
    )
