"""Reliability: AWS API throttling is retried, not fatal.

AWS is moto_server (the test double), and throttling is a second test double: a loopback
proxy (gpuforge_lab.bench.throttle) that answers the first N requests with the errors AWS sends
when it rate-limits (`RequestLimitExceeded` for EC2, `ThrottlingException` for SSM) and
forwards the rest to moto. gpuforge.aws.client (adaptive retries) must get through; a client
without retries must fail on the first throttle.
"""

from __future__ import annotations

from collections.abc import Iterator

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from gpuforge import aws as gpuforge_aws
from gpuforge import cli
from gpuforge_lab.bench.throttle import ThrottlingProxy
from gpuforge_lab.moto import MotoServer

THROTTLES = 3
# total_max_attempts counts the first try (max_attempts counts only retries).
NO_RETRIES = Config(retries={"mode": "standard", "total_max_attempts": 1})


@pytest.fixture
def throttled(aws: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[ThrottlingProxy]:
    """A proxy that throttles the first THROTTLES requests; boto3 is pointed at it, not at moto."""
    proxy = ThrottlingProxy(aws.url, throttle_first=THROTTLES).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    yield proxy
    proxy.stop()


def _seed_instances(moto: MotoServer, count: int) -> list[str]:
    """Create instances straight on moto (bypassing the proxy), so setup uses up no throttles."""
    ec2 = boto3.client("ec2", endpoint_url=moto.url, region_name="us-east-1")
    image = ec2.describe_images(Owners=["amazon"], MaxResults=5)["Images"][0]["ImageId"]
    made = ec2.run_instances(ImageId=image, InstanceType="p5.48xlarge", MinCount=count, MaxCount=count)
    return sorted(i["InstanceId"] for i in made["Instances"])


def test_adaptive_retries_ride_out_ec2_request_limit_exceeded(
    aws: MotoServer, throttled: ThrottlingProxy
) -> None:
    expected = _seed_instances(aws, 4)
    paginator = gpuforge_aws.client("ec2").get_paginator("describe_instances")
    found = sorted(
        i["InstanceId"] for page in paginator.paginate() for r in page["Reservations"] for i in r["Instances"]
    )
    assert found == expected
    assert throttled.counts.throttled == THROTTLES
    assert throttled.counts.forwarded >= 1


def test_adaptive_retries_ride_out_ssm_throttling_exception(
    aws: MotoServer, throttled: ThrottlingProxy
) -> None:
    boto3.client("ssm", endpoint_url=aws.url, region_name="us-east-1").put_parameter(
        Name="/gpuforge/ami/dlami/latest", Value="ami-12345678", Type="String"
    )
    value = gpuforge_aws.client("ssm").get_parameter(Name="/gpuforge/ami/dlami/latest")["Parameter"]["Value"]
    assert value == "ami-12345678"
    assert throttled.counts.throttled == THROTTLES


@pytest.mark.parametrize(
    ("service", "call", "code"),
    [
        ("ec2", lambda c: c.describe_instances(), "RequestLimitExceeded"),
        ("ssm", lambda c: c.get_parameter(Name="/none"), "ThrottlingException"),
    ],
)
def test_without_retries_the_first_throttle_is_fatal(
    throttled: ThrottlingProxy, service: str, call: object, code: str
) -> None:
    """The control case: the proxy really throttles, so the retrying client above really retried."""
    client = boto3.client(service, region_name="us-east-1", config=NO_RETRIES)
    assert callable(call)
    with pytest.raises(ClientError) as caught:
        call(client)
    assert caught.value.response["Error"]["Code"] == code
    assert throttled.counts.throttled == 1
    assert throttled.counts.forwarded == 0


def test_gpuforge_cli_succeeds_through_throttling(
    aws: MotoServer, throttled: ThrottlingProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    """A whole CLI command (prune --dry-run: describe images, parameters, instances) under throttling."""
    assert cli.main(["prune", "--keep", "2", "--dry-run"]) == 0
    assert throttled.counts.throttled == THROTTLES
    assert throttled.counts.forwarded >= 1
