"""One way to make boto3 clients: adaptive retries, and the endpoint from the environment.

boto3 itself honours AWS_ENDPOINT_URL (and AWS_ENDPOINT_URL_<SERVICE>), which is how the
lab points every client at moto_server; nothing here special-cases the lab.
"""

from __future__ import annotations

import os
from typing import Any

import boto3
from botocore.config import Config

# AWS_MAX_ATTEMPTS (botocore's own setting) may lower the attempts, e.g. where an unreachable endpoint
# should fail fast; adaptive retries stay.
_MAX_ATTEMPTS = 10


def _retry_config() -> Config:
    attempts = os.environ.get("AWS_MAX_ATTEMPTS", "")
    return Config(
        retries={"mode": "adaptive", "max_attempts": int(attempts) if attempts.isdigit() else _MAX_ATTEMPTS},
        user_agent_extra="gpuforge",
    )


DEFAULT_REGION = "us-east-1"


def region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or DEFAULT_REGION


def client(service: str, region_name: str | None = None) -> Any:
    """A boto3 client with adaptive retries (API throttling is retried, not fatal)."""
    return boto3.session.Session().client(
        service, region_name=region_name or region(), config=_retry_config()
    )


CREDENTIALS_HINT = (
    "provide AWS credentials: set AWS_PROFILE (after `aws configure` or `aws sso login`), or "
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or run on an instance with an IAM role; "
    'for the local lab: eval "$(gpuforge lab env)"'
)
