"""Security of the AMI build: IMDSv2 on the Packer builder instance (the real packer 1.6.6 amazon-ebs
builder against moto, the line gpuforge reads the instance id from, the in-guest check that is the
template's first provisioner) and the template's encrypted root volume.

Packer 1.6 rejects `metadata_options`, so `gpuforge bake` makes the builder IMDSv2-only itself
(gpuforge.ami.bake.BuilderImds). The end-to-end bake with a fake packer is in tests/test_ami_bake.py;
here the real binary proves that what gpuforge parses is what Packer prints, and that interrupting
Packer still cleans up the builder.
"""

from __future__ import annotations

import http.server
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from gpuforge.ami.bake import AWS_SOURCE, BuilderImds
from gpuforge.ami.packer import MODERN_MIN, MachineLine, Packer, launched_instance, write_var_file
from gpuforge.errors import ExternalError
from gpuforge_lab.moto import MotoServer, free_port

REPO = Path(__file__).resolve().parents[1]
CHECK_IMDSV2 = REPO / "packer" / "scripts" / "check-imdsv2.sh"
# Verbatim from `packer build -machine-readable` (Packer v1.6.6, amazon-ebs against moto_server).
REAL_LINE = "1796285384,,ui,message,    amazon-ebs.gpu: Instance ID: i-8db7e69dbc3a0b8e6\n"


def _line(text: str) -> MachineLine:
    parsed = MachineLine.parse(text)
    assert parsed is not None
    return parsed


def test_the_line_packer_prints_names_the_builder() -> None:
    assert launched_instance(_line(REAL_LINE), "amazon-ebs.gpu") == "i-8db7e69dbc3a0b8e6"


@pytest.mark.parametrize(
    "text",
    [
        # The same report from another build of the template.
        "1,,ui,message,    amazon-ebs.other: Instance ID: i-8db7e69dbc3a0b8e6",
        # The "say" that follows it: not the report itself.
        "1,,ui,say,==> amazon-ebs.gpu: Waiting for instance (i-8db7e69dbc3a0b8e6) to become ready...",
        # Something that is not an instance id.
        "1,,ui,message,    amazon-ebs.gpu: Instance ID: ami-0123456789abcdef0",
        "1,,ui,error,    amazon-ebs.gpu: Instance ID: i-8db7e69dbc3a0b8e6",
    ],
)
def test_other_lines_name_no_builder(text: str) -> None:
    assert launched_instance(_line(text), "amazon-ebs.gpu") is None


def test_only_the_first_report_is_the_builder(aws: MotoServer) -> None:
    """A later "Instance ID:" line (provisioner output, say) must not send gpuforge to another instance."""
    ec2 = boto3.client("ec2")
    ids = [
        ec2.run_instances(ImageId="ami-785db401", MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
        for _ in range(2)
    ]
    guard = BuilderImds(AWS_SOURCE, "us-east-1")
    for instance_id in ids:
        guard(_line(f"1,,ui,message,    {AWS_SOURCE}: Instance ID: {instance_id}"))
    assert guard.instance_id == ids[0]
    options = [_metadata_options(i)["HttpTokens"] for i in ids]
    assert options == ["required", "optional"]


def _metadata_options(instance_id: str) -> dict[str, Any]:
    reservations = boto3.client("ec2").describe_instances(InstanceIds=[instance_id])["Reservations"]
    return dict(reservations[0]["Instances"][0]["MetadataOptions"])


# --- the real packer binary -------------------------------------------------------------------------


def _packer_1_6() -> Packer | None:
    """Packer < 1.7 has the amazon builder built in; a modern one would need `packer init` (network)."""
    if shutil.which("packer") is None and not os.environ.get("GPUFORGE_PACKER"):
        return None
    packer = Packer.find()
    return packer if packer.version < MODERN_MIN else None


needs_packer_1_6 = pytest.mark.skipif(
    _packer_1_6() is None,
    reason="needs Packer 1.6 (Debian's package, as in CI), whose amazon builder is built in",
)

# The amazon-ebs source of packer/gpuforge.pkr.hcl reduced to what runs against moto: moto's EC2
# endpoint, no credential or region lookups, and a short SSH timeout (moto's instances never answer).
PROBE_TEMPLATE = """
source "amazon-ebs" "gpu" {
  region                     = "us-east-1"
  instance_type              = "g5.2xlarge"
  source_ami                 = "ami-785db401"
  ssh_username               = "ubuntu"
  ami_name                   = "gpuforge-imds-probe"
  custom_endpoint_ec2        = "ENDPOINT"
  skip_region_validation     = true
  skip_credential_validation = true
  skip_metadata_api_check    = true
  ssh_timeout                = "3s"
  run_tags = {
    "Name" = "gpuforge-imds-probe"
  }
}

build {
  sources = ["source.amazon-ebs.gpu"]

  provisioner "shell" {
    inline = ["echo provisioned"]
  }
}
"""


@pytest.fixture
def probe(aws: MotoServer, tmp_path: Path) -> Iterator[tuple[Packer, Path, Path]]:
    """(packer, template directory, var file) for a real amazon-ebs build against this test's moto."""
    packer = _packer_1_6()
    assert packer is not None
    template = tmp_path / "templates"
    template.mkdir()
    (template / "probe.pkr.hcl").write_text(PROBE_TEMPLATE.replace("ENDPOINT", aws.url))
    yield packer, template, write_var_file(tmp_path / "vars.json", {})


def _probe_instance() -> dict[str, Any]:
    pages = boto3.client("ec2").describe_instances(
        Filters=[{"Name": "tag:Name", "Values": ["gpuforge-imds-probe"]}]
    )
    (instance,) = [i for r in pages["Reservations"] for i in r["Instances"]]
    return dict(instance)


@pytest.mark.slow
@needs_packer_1_6
def test_real_packer_builder_is_made_imdsv2_only(probe: tuple[Packer, Path, Path], tmp_path: Path) -> None:
    """gpuforge recognises the builder in real Packer output and EC2 (moto) then requires IMDSv2 on it."""
    packer, template, var_file = probe
    guard = BuilderImds(AWS_SOURCE, "us-east-1")
    log = tmp_path / "packer.log"
    status = packer.build(template, var_file, log, only=[AWS_SOURCE], on_line=guard)
    # moto's instance never answers SSH, so this build ends at the SSH timeout, after the launch.
    assert status != 0 and "Timeout waiting for SSH" in log.read_text()
    instance = _probe_instance()
    assert guard.instance_id == instance["InstanceId"]
    assert instance["MetadataOptions"]["HttpTokens"] == "required"
    assert instance["MetadataOptions"]["HttpEndpoint"] == "enabled"


@pytest.mark.slow
@needs_packer_1_6
def test_real_packer_is_stopped_and_cleans_up_when_imdsv2_fails(
    probe: tuple[Packer, Path, Path], tmp_path: Path, imdsv2_refused: None
) -> None:
    """A refused ModifyInstanceMetadataOptions interrupts Packer, which still removes what it created."""
    packer, template, var_file = probe
    log = tmp_path / "packer.log"
    with pytest.raises(ExternalError, match=r"cannot require IMDSv2 on builder instance i-[0-9a-f]+"):
        packer.build(template, var_file, log, only=[AWS_SOURCE], on_line=BuilderImds(AWS_SOURCE, "us-east-1"))
    instance = _probe_instance()
    assert instance["MetadataOptions"]["HttpTokens"] != "required"
    # Packer's own cleanup ran: builder terminated, temporary key pair and security group deleted.
    assert instance["State"]["Name"] == "terminated"
    ec2 = boto3.client("ec2")
    assert [k for k in ec2.describe_key_pairs()["KeyPairs"] if k["KeyName"].startswith("packer_")] == []
    groups = ec2.describe_security_groups()["SecurityGroups"]
    assert [g for g in groups if g["GroupName"].startswith("packer_")] == []
    text = log.read_text()
    assert "Terminating the source AWS instance" in text
    assert "provisioned" not in text


# --- packer/scripts/check-imdsv2.sh, the in-guest check ---------------------------------------------


@pytest.fixture
def fake_imds() -> Iterator[tuple[str, list[int]]]:
    """A stand-in for IMDS: (its URL, the statuses it answers GETs with, in turn; the last one repeats)."""
    statuses = [200]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(statuses.pop(0) if len(statuses) > 1 else statuses[0])
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            """Keep the test output quiet."""

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", statuses
    server.shutdown()
    server.server_close()


def _check(url: str, wait_s: int) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "IMDS_URL": url, "IMDS_WAIT_S": str(wait_s)}
    return subprocess.run(
        ["bash", str(CHECK_IMDSV2)], env=env, capture_output=True, text=True, check=False, timeout=60
    )


def test_check_imdsv2_passes_when_imds_requires_a_token(fake_imds: tuple[str, list[int]]) -> None:
    url, statuses = fake_imds
    statuses[:] = [401]
    result = _check(url, 0)
    assert result.returncode == 0, result.stderr
    assert "IMDSv2 only" in result.stdout


def test_check_imdsv2_fails_while_imdsv1_answers(fake_imds: tuple[str, list[int]]) -> None:
    url, statuses = fake_imds
    statuses[:] = [200]
    result = _check(url, 0)
    assert result.returncode == 1
    assert "HTTP 200" in result.stderr and "allows IMDSv1" in result.stderr


def test_check_imdsv2_waits_for_the_change_to_apply(fake_imds: tuple[str, list[int]]) -> None:
    url, statuses = fake_imds
    statuses[:] = [200, 401]
    result = _check(url, 30)
    assert result.returncode == 0, result.stderr


def test_check_imdsv2_fails_without_an_answer() -> None:
    # A loopback port nothing listens on: curl reports 000, which is no proof of IMDSv2.
    result = _check(f"http://127.0.0.1:{free_port()}", 0)
    assert result.returncode == 1 and "HTTP 000" in result.stderr


def test_template_checks_imdsv2_first_and_only_on_the_ec2_builder() -> None:
    """check-imdsv2.sh is the build's first provisioner, limited to amazon-ebs.gpu (the lab has no IMDS)."""
    text = (REPO / "packer" / "gpuforge.pkr.hcl").read_text()
    build = text[text.index("\nbuild {") :]
    first = re.search(r'\n  provisioner "(\w+)" \{\n(.*?)\n  \}\n', build, re.S)
    assert first is not None
    kind, body = first.groups()
    assert kind == "shell"
    assert f'only   = ["{AWS_SOURCE}"]' in body
    assert "packer/scripts/check-imdsv2.sh" in body


def _amazon_ebs_source() -> str:
    text = (REPO / "packer" / "gpuforge.pkr.hcl").read_text()
    start = text.index('source "amazon-ebs" "gpu" {')
    return text[start : text.index("\n}\n", start)]


def test_template_encrypts_the_builder_volume_and_the_image() -> None:
    """The builder's root volume is encrypted from launch, so the AMI's snapshot is encrypted too and no
    unencrypted copy of the baked disk ever exists (kms_key_id empty: the AWS-managed EBS key).
    No encrypt_boot: its extra copy deletes an untagged intermediate image, which the pipeline's IAM
    policy does not allow."""
    source = _amazon_ebs_source()
    assert not re.search(r"^\s*encrypt_boot\s*=", source, re.M)
    mapping = source[source.index("launch_block_device_mappings {") :]
    mapping = mapping[: mapping.index("\n  }")]
    assert re.search(r"^    encrypted\s+= true$", mapping, re.M)
    assert re.search(r"^    kms_key_id\s+= var\.kms_key_id$", mapping, re.M)
