"""Record the real amazon-ebs builder's AWS calls: Debian's Packer 1.6.6 against moto, through awsrecorder.

The template is packer/gpuforge.pkr.hcl's amazon-ebs source with what a build against moto needs
(moto's endpoint, no credential, region or IMDS lookups) and `communicator = "none"`: moto's instance
is no host, so nothing can be provisioned; every EC2 call Packer makes before and after the
provisioners is unchanged. Its tag blocks are the real template's (tests check that they agree).
Packer 1.6.6 still creates (and deletes) its temporary key pair and security group with no communicator.

Regenerate the committed recordings (tests/fixtures/packer/packer-1.6.6-*.json) with:
    .venv/bin/python tests/packerrecord.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures" / "packer"
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(REPO / "scripts"))

import awsrecorder  # noqa: E402
from gpuforge.ami.packer import Packer, write_var_file  # noqa: E402
from gpuforge_lab.moto import TEST_ENV, MotoServer, free_port  # noqa: E402

BUILD_ID = "20261206-record"
REGION = "us-east-1"
COPY_REGION = "us-west-2"
# A customer-managed key ARN: moto does not check that it exists, the policy's KMS grants are judged
# from it (iamaudit.implied_kms_requests).
KMS_KEY = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"

TEMPLATE = """
source "amazon-ebs" "gpu" {
  region                     = "REGION"
  instance_type              = "g5.2xlarge"
  source_ami                 = "SOURCE_AMI"
  COMMUNICATOR
  ami_name                   = "gpuforge-dlami-record-BUILD_ID"
  ami_description            = "gpuforge dlami GPU image built from record"
  ami_virtualization_type    = "hvm"
  ena_support                = true
  ami_regions                = AMI_REGIONS
  custom_endpoint_ec2        = "ENDPOINT"
  skip_region_validation     = true
  skip_credential_validation = true
  skip_metadata_api_check    = true

  launch_block_device_mappings {
    device_name           = "/dev/sda1"
    volume_size           = 100
    volume_type           = "gp3"
    iops                  = 3000
    throughput            = 250
    encrypted             = true
    kms_key_id            = "KMS_KEY"
    delete_on_termination = true
  }

  tags = {
    "Name"              = "gpuforge-dlami-record"
    "gpuforge:flavor"   = "dlami"
    "gpuforge:build-id" = "BUILD_ID"
  }
  snapshot_tags = {
    "Name"              = "gpuforge-dlami-record"
    "gpuforge:flavor"   = "dlami"
    "gpuforge:build-id" = "BUILD_ID"
  }
  run_tags = {
    "Name"              = "gpuforge-bake-BUILD_ID"
    "gpuforge:build-id" = "BUILD_ID"
  }
  run_volume_tags = {
    "Name"              = "gpuforge-bake-BUILD_ID"
    "gpuforge:build-id" = "BUILD_ID"
  }
}

build {
  sources = ["source.amazon-ebs.gpu"]
}
"""
NO_COMMUNICATOR = 'communicator               = "none"'


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    communicator: str
    copy_regions: tuple[str, ...] = ()
    refuse: frozenset[str] = frozenset()


SCENARIOS = (
    Scenario("success", "a successful bake with one region copy", NO_COMMUNICATOR, (COPY_REGION,)),
    Scenario(
        "fail-after-create-image",
        "ModifyImageAttribute refused as IAM would (UnauthorizedOperation) after CreateImage and the "
        "region copy: Packer's cleanup on error",
        NO_COMMUNICATOR,
        (COPY_REGION,),
        frozenset({"ModifyImageAttribute"}),
    ),
)


def _source_ami(moto_url: str) -> str:
    """One of moto's own images (a stand-in for the DLAMI), tagged as nothing."""
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=moto_url, **_keys())
    images = ec2.describe_images(Owners=["amazon"])["Images"]
    return str(sorted(i["ImageId"] for i in images if i.get("RootDeviceType") == "ebs")[0])


def _keys() -> dict[str, str]:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


def record(scenario: Scenario, moto: MotoServer, work: Path) -> dict[str, Any]:
    """Run one scenario; return {about, calls}."""
    moto.reset()
    packer = Packer.find()
    with awsrecorder.recording(moto.url, set(scenario.refuse)) as (proxy, recorder):
        text = (
            TEMPLATE.replace("COMMUNICATOR", scenario.communicator)
            .replace("AMI_REGIONS", json.dumps(list(scenario.copy_regions)))
            .replace("ENDPOINT", proxy)
            .replace("SOURCE_AMI", _source_ami(moto.url))
            .replace("KMS_KEY", KMS_KEY)
            .replace("BUILD_ID", BUILD_ID)
            .replace("REGION", REGION)
        )
        templates = work / scenario.name
        templates.mkdir(parents=True)
        (templates / "record.pkr.hcl").write_text(text)
        env = {**TEST_ENV, "PACKER_NO_COLOR": "1", "CHECKPOINT_DISABLE": "1"}
        status = packer.build(
            templates,
            write_var_file(work / f"{scenario.name}.json", {}),
            work / f"{scenario.name}.log",
            env=env,
        )
    version = ".".join(map(str, packer.version))
    return {
        "about": {
            "packer": version,
            "scenario": scenario.name,
            "what": scenario.what,
            "exit_status": status,
            "refused": sorted(scenario.refuse),
            "build_id": BUILD_ID,
            "recorded_by": "tests/packerrecord.py (awsrecorder in front of moto)",
        },
        "calls": recorder.calls,
    }


def fixture_path(scenario: Scenario, version: str) -> Path:
    return FIXTURES / f"packer-{version}-{scenario.name}.json"


def main() -> int:
    moto = MotoServer(port=free_port(), log_path=Path(tempfile.mkdtemp()) / "moto.log")
    moto.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for scenario in SCENARIOS:
                result = record(scenario, moto, Path(tmp))
                path = fixture_path(scenario, result["about"]["packer"])
                path.parent.mkdir(parents=True, exist_ok=True)
                awsrecorder.write(path, result["calls"], result["about"])
                about = result["about"]
                print(f"{path.relative_to(REPO)}: {len(result['calls'])} calls, exit {about['exit_status']}")
    finally:
        moto.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
