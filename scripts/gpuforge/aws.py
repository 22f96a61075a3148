"""One way to make boto3 clients: adaptive retries, and the endpoint from the environment.

boto3 itself honours AWS_ENDPOINT_URL (and AWS_ENDPOINT_URL_<SERVICE>), which is how the
lab points every client at moto_server; nothing here special-cases the lab.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import boto3
import botocore.loaders
import botocore.session
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


# When set, every API call a gpuforge client makes is appended to this file as one JSON line
# {"action": "ec2:DescribeImages", "caller": "gpuforge.ami.prune"}: the audit trail the IAM policy
# test (tests/test_iam_policy.py) checks packer/iam/pipeline-policy.json against, and a way for
# operators to see which permissions a command needs before they grant them.
CALL_LOG_ENV = "GPUFORGE_AWS_CALL_LOG"


# One botocore data loader per AWS_DATA_PATH for the whole process (see _session).
_LOADERS: dict[str | None, Any] = {}


def _session() -> boto3.session.Session:
    """A fresh session (credentials, profile and endpoints read again) that shares the API models.

    Every botocore session has its own data loader, which reads and parses a service's JSON model
    the first time a client of it is made. EC2's model is large, and one `gpuforge bake` makes a
    dozen EC2 clients (the image, its copies, the builder's metadata options): with a loader of
    its own each one parsed it again. The loader caches what it parsed per instance and holds
    nothing but the files' contents, so one shared loader parses each model once per process.
    """
    core = botocore.session.get_session()
    data_path = core.get_config_variable("data_path")
    loader = _LOADERS.get(data_path)
    if loader is None:
        loader = _LOADERS[data_path] = botocore.loaders.create_loader(data_path)
    core.register_component("data_loader", loader)
    session = boto3.session.Session(botocore_session=core)
    # boto3 appends its resource models' directory to the loader's search path for every session.
    paths = loader.search_paths
    while len(paths) > 1 and paths[-1] in paths[:-1]:
        paths.pop()
    return session


def client(service: str, region_name: str | None = None) -> Any:
    """A boto3 client with adaptive retries (API throttling is retried, not fatal)."""
    made = _session().client(service, region_name=region_name or region(), config=_retry_config())
    log_path = os.environ.get(CALL_LOG_ENV)
    if log_path:
        _record_calls(made, log_path)
    return made


def _record_calls(made: Any, log_path: str) -> None:
    # IAM action prefixes are the services' signing names (ec2, ssm, servicequotas, ...).
    prefix = made.meta.service_model.signing_name

    def before_call(model: Any, **_: Any) -> None:
        # before-call fires once per HTTP request, so paginator pages and waiter polls are seen too.
        line = json.dumps({"action": f"{prefix}:{model.name}", "caller": _caller_module()})
        with Path(log_path).open("a", encoding="utf-8") as log:
            log.write(line + "\n")

    made.meta.events.register("before-call", before_call)


def _caller_module() -> str:
    """The gpuforge module that made the call (the first frame outside this one and botocore)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if name.startswith("gpuforge.") and name != __name__:
            return name
        frame = frame.f_back  # type: ignore[assignment]
    return "unknown"


CREDENTIALS_HINT = (
    "provide AWS credentials: set AWS_PROFILE (after `aws configure` or `aws sso login`), or "
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or run on an instance with an IAM role; "
    # The lab `make demo` starts is named demo (Makefile DEMO_LAB); `gpuforge-lab env` alone means the lab
    # named default, which make demo never starts.
    'for the local lab: eval "$(gpuforge-lab env --name demo)" (demo: the lab `make demo` starts; '
    "another lab: its --name)"
)
