"""Check packer/iam/pipeline-policy.json against the AWS calls the pipeline code makes.

Two views of "the calls", which must agree with the policy's Gpuforge* statements:
- static: every boto3 operation, paginator and waiter named in the pipeline's source
  (gpuforge.ami and gpuforge.pcluster), so a code path no test exercises still needs its grant;
- recorded: every call the tests really made, from the GPUFORGE_AWS_CALL_LOG that gpuforge.aws
  writes (botocore before-call hooks), attributed to the gpuforge module that made it.
The Packer* statements come from Packer's documented minimal policy (PACKER_DOCUMENTED below).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import boto3

REPO = Path(__file__).resolve().parents[1]
POLICY = REPO / "packer" / "iam" / "pipeline-policy.json"
# The code the pipeline role runs: bake, rebuild, publish, prune (and set-ami, which publish calls).
PIPELINE_PACKAGES = ("gpuforge.ami", "gpuforge.pcluster")
PIPELINE_SOURCES = (REPO / "scripts" / "gpuforge" / "ami", REPO / "scripts" / "gpuforge" / "pcluster")

# The amazon plugin's "minimal set of permissions" (packer-plugin-amazon docs/builders/index.mdx,
# "IAM Task or Instance Role"), plus iam:PassRole/iam:GetInstanceProfile from its troubleshooting
# section for an instance profile. The policy may grant a subset (what amazon-ebs with this
# template uses), never anything outside it.
PACKER_DOCUMENTED = frozenset(
    {
        "ec2:AttachVolume",
        "ec2:AuthorizeSecurityGroupIngress",
        "ec2:CopyImage",
        "ec2:CreateImage",
        "ec2:CreateKeyPair",
        "ec2:CreateSecurityGroup",
        "ec2:CreateSnapshot",
        "ec2:CreateTags",
        "ec2:CreateVolume",
        "ec2:DeleteKeyPair",
        "ec2:DeleteSecurityGroup",
        "ec2:DeleteSnapshot",
        "ec2:DeleteVolume",
        "ec2:DeregisterImage",
        "ec2:DescribeImageAttribute",
        "ec2:DescribeImages",
        "ec2:DescribeInstances",
        "ec2:DescribeInstanceStatus",
        "ec2:DescribeRegions",
        "ec2:DescribeSecurityGroups",
        "ec2:DescribeSnapshots",
        "ec2:DescribeSubnets",
        "ec2:DescribeTags",
        "ec2:DescribeVolumes",
        "ec2:DetachVolume",
        "ec2:GetPasswordData",
        "ec2:ModifyImageAttribute",
        "ec2:ModifyInstanceAttribute",
        "ec2:ModifySnapshotAttribute",
        "ec2:RegisterImage",
        "ec2:RunInstances",
        "ec2:StopInstances",
        "ec2:TerminateInstances",
        "iam:PassRole",
        "iam:GetInstanceProfile",
    }
)
# Actions IAM authorizes besides the one an operation is named after, for the way gpuforge calls it:
# S3 authorizes GetObject with a VersionId as s3:GetObjectVersion (prune reads the config version a
# ParallelCluster stack names).
IMPLIED = {"s3:GetObject": ("s3:GetObjectVersion",)}
# Verbs that change or destroy what exists: never granted on every resource.
DESTRUCTIVE_VERBS = ("Delete", "Deregister", "Terminate", "Stop", "Put", "Modify", "Pass")


def load_policy(path: Path = POLICY) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def granted(policy: dict[str, Any], sid_prefix: str = "") -> set[str]:
    """Actions the policy's statements (those whose Sid starts with sid_prefix) allow."""
    actions: set[str] = set()
    for statement in policy["Statement"]:
        if statement["Effect"] == "Allow" and statement.get("Sid", "").startswith(sid_prefix):
            value = statement["Action"]
            actions.update([value] if isinstance(value, str) else value)
    return actions


@cache
def _operations(service: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """IAM prefix, snake_case method -> API name, waiter -> the API name it polls."""
    made = boto3.session.Session().client(
        service, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    waiters = {name: made.get_waiter(name).config.operation for name in made.waiter_names}
    return made.meta.service_model.signing_name, dict(made.meta.method_to_api_mapping), waiters


def static_actions(sources: Iterable[Path] = PIPELINE_SOURCES) -> dict[str, set[str]]:
    """IAM action -> the files that name it, for every boto3 call in the sources.

    A module's services are the string literals passed to a `client(...)` call in it; its
    operations are the attribute calls, paginators and waiters those services know.
    """
    found: dict[str, set[str]] = {}
    files = [f for s in sources for f in ([s] if s.is_file() else sorted(s.rglob("*.py")))]
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        services: set[str] = set()
        methods: set[str] = set()
        named: set[str] = set()  # get_paginator("x") / get_waiter("x") arguments
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            literal = (
                node.args[0].value
                if node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                else None
            )
            if name == "client" and literal:
                services.add(literal)
            elif name in ("get_paginator", "get_waiter") and literal:
                named.add(f"{name}:{literal}")
            else:
                methods.add(name)
        for service in services:
            prefix, mapping, waiters = _operations(service)
            apis = {mapping[m] for m in methods if m in mapping}
            for kind, _, arg in (n.partition(":") for n in named):
                if kind == "get_paginator" and arg in mapping:
                    apis.add(mapping[arg])
                elif kind == "get_waiter" and arg in waiters:
                    apis.add(waiters[arg])
            for api in apis:
                found.setdefault(f"{prefix}:{api}", set()).add(path.name)
    for action, also in IMPLIED.items():
        for extra in also if action in found else ():
            found.setdefault(extra, set()).update(found[action])
    return found


def recorded_actions(log: Path, packages: tuple[str, ...] = PIPELINE_PACKAGES) -> dict[str, set[str]]:
    """IAM action -> the modules that called it, from a GPUFORGE_AWS_CALL_LOG file."""
    calls: dict[str, set[str]] = {}
    if not log.is_file():
        return calls
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        if entry["caller"].startswith(packages):
            calls.setdefault(entry["action"], set()).add(entry["caller"])
    return calls


def ungranted(calls: dict[str, set[str]], policy: dict[str, Any]) -> list[str]:
    """One line per called action the policy does not allow."""
    allowed = granted(policy)
    return [
        f"{action} (called by {', '.join(sorted(by))})"
        for action, by in sorted(calls.items())
        if action not in allowed
    ]
