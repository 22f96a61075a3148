"""The Packer wrapper's version gate (issue 28) and the bake's check of customer-key region copies."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

from gpuforge.ami.bake import BakeOptions
from gpuforge.ami.packer import (
    MODERN_MIN,
    MODERN_PLUGINS_FILE,
    Packer,
    emulated_ec2,
    require_for_aws,
)
from gpuforge.errors import UserError

PACKER_DIR = Path(__file__).resolve().parents[1] / "packer"


def _fake_packer(tmp_path: Path, version: str) -> Packer:
    exe = tmp_path / "packer"
    exe.write_text(f"#!/bin/sh\necho 'Packer v{version}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return Packer(str(exe))


def test_modern_minimum_is_what_the_plugin_file_requires() -> None:
    """The wrapper stages the plugin file only for a Packer that file accepts."""
    text = (PACKER_DIR / MODERN_PLUGINS_FILE).read_text()
    match = re.search(r'required_version\s*=\s*">=\s*(\d+)\.(\d+)\.(\d+)', text)
    assert match is not None, text
    assert tuple(int(g) for g in match.groups()) == MODERN_MIN


@pytest.mark.parametrize(("version", "modern"), [("1.6.6", False), ("1.10.0", True), ("1.11.2", True)])
def test_packer_generation(tmp_path: Path, version: str, modern: bool) -> None:
    assert _fake_packer(tmp_path, version).modern is modern


@pytest.mark.parametrize("version", ["1.7.0", "1.8.7", "1.9.5"])
def test_packer_between_legacy_and_modern_is_refused(tmp_path: Path, version: str) -> None:
    """1.7 to 1.9 reject the plugin file's required_version, so they must not get the modern staging."""
    with pytest.raises(
        UserError, match=rf"packer {re.escape(version)} .* is not supported: use Packer >= 1\.10\.0"
    ):
        _fake_packer(tmp_path, version).stage(PACKER_DIR, tmp_path / "work")


def test_customer_key_copies_need_a_key_per_region() -> None:
    """gpuforge copies the image itself (issue 34), with the key given for each region, on any Packer."""
    kms = "arn:aws:kms:us-east-1:111122223333:key/abc"
    with pytest.raises(UserError, match=r"no key is given for the copy region\(s\) eu-west-1, us-west-2"):
        BakeOptions(region="us-east-1", kms_key_id=kms, ami_regions=("eu-west-1", "us-west-2"))
    partial = {"eu-west-1": "arn:aws:kms:eu-west-1:111122223333:key/def"}
    with pytest.raises(UserError, match=r"copy region\(s\) us-west-2,"):
        BakeOptions(
            region="us-east-1",
            kms_key_id=kms,
            ami_regions=("eu-west-1", "us-west-2"),
            copy_region_kms_keys=partial,
        )
    keys = {"eu-west-1": "arn:aws:kms:eu-west-1:1:key/d", "us-west-2": "arn:aws:kms:us-west-2:1:key/e"}
    BakeOptions(
        region="us-east-1", kms_key_id=kms, ami_regions=("eu-west-1", "us-west-2"), copy_region_kms_keys=keys
    )


@pytest.mark.parametrize(("kms", "regions"), [("", ("eu-west-1",)), ("alias/gpuforge", ())])
def test_default_key_or_no_copies_need_nothing(kms: str, regions: tuple[str, ...]) -> None:
    BakeOptions(region="us-east-1", kms_key_id=kms, ami_regions=regions)


AWS = "https://ec2.us-east-1.amazonaws.com"


@pytest.mark.parametrize(
    ("environ", "emulated"),
    [
        ({}, False),
        ({"AWS_ENDPOINT_URL": "http://127.0.0.1:5000"}, True),
        ({"AWS_ENDPOINT_URL": "http://localhost:5000"}, True),
        ({"AWS_ENDPOINT_URL": "http://[::1]:5000"}, True),
        ({"AWS_ENDPOINT_URL": "http://10.0.0.5:5000"}, False),
        ({"AWS_ENDPOINT_URL": AWS}, False),
        # The service-specific variable wins, as in boto3.
        ({"AWS_ENDPOINT_URL": "http://127.0.0.1:5000", "AWS_ENDPOINT_URL_EC2": AWS}, False),
        ({"AWS_ENDPOINT_URL": AWS, "AWS_ENDPOINT_URL_EC2": "http://127.0.0.2:5000"}, True),
    ],
)
def test_an_emulated_ec2_is_one_on_loopback(environ: dict[str, str], emulated: bool) -> None:
    assert emulated_ec2(environ) is emulated


def test_aws_bakes_need_packer_1_10_unless_ec2_is_emulated(tmp_path: Path) -> None:
    legacy = _fake_packer(tmp_path, "1.6.6")
    with pytest.raises(
        UserError, match=r"packer 1\.6\.6 .*cannot bake on AWS.*build id.*CreateImage.*>= 1\.10\.0"
    ):
        require_for_aws(legacy, environ={})
    require_for_aws(legacy, environ={"AWS_ENDPOINT_URL": "http://127.0.0.1:5000"})
    (tmp_path / "modern").mkdir()
    require_for_aws(_fake_packer(tmp_path / "modern", "1.11.2"), environ={})
