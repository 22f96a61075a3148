"""Check packer/iam/pipeline-policy.json against the AWS calls the pipeline code makes.

Two views of "the calls", which must agree with the policy's Gpuforge* statements:
- static: every boto3 operation, paginator and waiter named in the pipeline's source
  (gpuforge.ami, gpuforge.pcluster and the gpuforge modules they import), so a code path no
  test exercises still needs its grant;
- recorded: every call the tests really made, from the GPUFORGE_AWS_CALL_LOG that gpuforge.aws
  writes (botocore before-call hooks), attributed to the gpuforge module that made it.
The Packer* statements come from Packer's documented minimal policy (PACKER_DOCUMENTED below).
"""

from __future__ import annotations

import ast
import fnmatch
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import boto3

REPO = Path(__file__).resolve().parents[1]
POLICY = REPO / "packer" / "iam" / "pipeline-policy.json"
SOURCE_ROOT = REPO / "scripts"
# The code the pipeline role runs: bake, rebuild, publish, prune (and set-ami, which publish calls),
# with every gpuforge module those packages import (gpuforge.image, gpuforge.amiid, ...): a helper
# moved out of gpuforge.ami still makes the pipeline's calls.
PIPELINE_ROOTS = ("gpuforge.ami",)


def _module_file(module: str) -> Path | None:
    base = SOURCE_ROOT.joinpath(*module.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The gpuforge modules `path` imports (absolute or relative), as dotted names."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "gpuforge" or name.startswith("gpuforge.")}


@cache
def pipeline_files() -> tuple[Path, ...]:
    """The source files of PIPELINE_ROOTS and of every gpuforge module they import, transitively."""
    roots = [SOURCE_ROOT.joinpath(*root.split(".")) for root in PIPELINE_ROOTS]
    todo = [f for root in roots for f in sorted(root.rglob("*.py"))]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(f for name in _imports(path) if (f := _module_file(name)) is not None)
    return tuple(sorted(seen))


def pipeline_packages() -> tuple[str, ...]:
    return tuple(sorted(_module_name(path) for path in pipeline_files()))


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
# What the amazon-ebs builder's Session Manager path adds (ssh_interface = "session_manager", the
# template's default), which its documented minimal policy above does not list: StartSession with the
# document AWS-StartPortForwardingSession and TerminateSession of that session (packer-plugin-amazon
# v1.8.2, 3896533, common/ssm/session.go:42,57,97), and the data channel the session-manager-plugin it
# runs (session.go:155) opens, which AWS's Session Manager quickstart end-user policies grant as
# ssmmessages:OpenDataChannel (docs.aws.amazon.com/systems-manager/latest/userguide/
# getting-started-restrict-access-quickstart.html).
PACKER_SESSION_MANAGER = frozenset(
    {"ssm:StartSession", "ssm:TerminateSession", "ssmmessages:OpenDataChannel"}
)
# Actions IAM authorizes besides the one an operation is named after, for the way gpuforge calls it:
# S3 authorizes GetObject with a VersionId as s3:GetObjectVersion (prune reads the config version a
# ParallelCluster stack names); RunInstances with an instance profile (the canary always passes one) is
# also authorized as iam:PassRole of its role (Service Authorization Reference for Amazon EC2,
# RunInstances' dependent actions; https://docs.aws.amazon.com/IAM/latest/UserGuide/
# id_roles_use_passrole.html).
IMPLIED = {"s3:GetObject": ("s3:GetObjectVersion",), "ec2:RunInstances": ("iam:PassRole",)}
# Verbs that change or destroy what exists: never granted on every resource.
DESTRUCTIVE_VERBS = ("Delete", "Deregister", "Terminate", "Stop", "Put", "Modify", "Pass")


# The canary's grants (gpuforge canary): a second managed policy on the same roles, since the pipeline
# policy is near IAM's 6,144-character limit (gpuforge.ami.iam attaches both).
CANARY_POLICY = REPO / "packer" / "iam" / "canary-policy.json"


def load_policy(path: Path = POLICY, canary: bool = True) -> dict[str, Any]:
    """The pipeline role's grants: the pipeline policy and, unless canary is False, the canary's."""
    policy = dict(json.loads(path.read_text()))
    if path == POLICY and canary:
        policy["Statement"] = [*policy["Statement"], *json.loads(CANARY_POLICY.read_text())["Statement"]]
    return policy


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


def _literal_arg(node: ast.Call) -> str | None:
    first = node.args[0] if node.args else None
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
        return node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
    return None


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> imported name, for `from x import name as local`."""
    return {
        alias.asname: alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname
    }


def _client_factories(trees: dict[Path, ast.Module]) -> dict[str, set[str]]:
    """Function name -> the services it makes clients for: a function that calls `client("ec2")`, or
    calls such a function (gpuforge.image.ec2_client, and whoever wraps it), is a client factory."""
    factories: dict[str, set[str]] = {}
    changed = True
    while changed:
        changed = False
        for tree in trees.values():
            aliases = _aliases(tree)
            for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
                services: set[str] = set()
                for node in ast.walk(func):
                    name = _call_name(node)
                    if name == "client" and isinstance(node, ast.Call) and (literal := _literal_arg(node)):
                        services.add(literal)
                    elif name is not None:
                        services |= factories.get(aliases.get(name, name), set())
                if services - factories.get(func.name, set()):
                    factories.setdefault(func.name, set()).update(services)
                    changed = True
    return factories


def static_actions(sources: Iterable[Path] | None = None) -> dict[str, set[str]]:
    """IAM action -> the files that name it, for every boto3 call in the sources.

    A module's services are the string literals passed to a `client(...)` call in it, and those of
    the client factories it calls; its operations are the attribute calls, paginators and waiters
    those services know.
    """
    found: dict[str, set[str]] = {}
    sources = pipeline_files() if sources is None else sources
    files = [f for s in sources for f in ([s] if s.is_file() else sorted(s.rglob("*.py")))]
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in files}
    factories = _client_factories(trees)
    for path, tree in trees.items():
        aliases = _aliases(tree)
        services: set[str] = set()
        methods: set[str] = set()
        named: set[str] = set()  # get_paginator("x") / get_waiter("x") arguments
        for node in ast.walk(tree):
            name = _call_name(node)
            if name is None or not isinstance(node, ast.Call):
                continue
            literal = _literal_arg(node)
            if name == "client" and literal:
                services.add(literal)
            elif name in ("get_paginator", "get_waiter") and literal:
                named.add(f"{name}:{literal}")
            else:
                services |= factories.get(aliases.get(name, name), set())
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


def recorded_actions(log: Path, packages: tuple[str, ...] | None = None) -> dict[str, set[str]]:
    """IAM action -> the modules that called it, from a GPUFORGE_AWS_CALL_LOG file."""
    calls: dict[str, set[str]] = {}
    packages = pipeline_packages() if packages is None else packages
    if not log.is_file():
        return calls
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        caller = entry["caller"]
        if caller in packages or caller.startswith(tuple(f"{root}." for root in PIPELINE_ROOTS)):
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


# --- a policy evaluator for recorded calls --------------------------------------------------------------
#
# IAM's documented evaluation logic, reduced to one identity policy and no boundaries or SCPs
# (https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_evaluation-logic.html): an explicit
# Deny wins, then any Allow, else the request is implicitly denied. Condition operators as documented in
# https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_elements_condition_operators.html:
# a missing key makes a positive operator false and a negated one true; ForAllValues is true for a
# missing key, ForAnyValue false; several keys or operators in one block must all hold.

ACCOUNT = "123456789012"  # moto's account; the evaluated ARNs carry it.
# The pipeline role's aws:userid as an assumed role: role-id:role-session-name (IAM policy variables,
# https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_variables.html#principaltable).
# A recorded call may name another (principal_userid), e.g. a session somebody else started.
CALLER_USERID = "AROA0GPUFORGE0PIPELINE0:gpuforge-bake"
Context = dict[str, list[str]]
_VARIABLE = re.compile(r"\$\{([^}]+)\}")


def substitute(value: str, context: Context) -> str | None:
    """A policy variable (${aws:userid}) replaced by the request's value; None when the request has no
    such key, which IAM treats as no match (IAM policy elements: Variables and tags, "Specifying
    default values" and the note on missing keys)."""
    missing = False

    def one(match: re.Match[str]) -> str:
        nonlocal missing
        key = match.group(1)
        values = next((v for k, v in context.items() if k.lower() == key.lower()), None)
        if not values:
            missing = True
            return ""
        return values[0]

    result = _VARIABLE.sub(one, value)
    return None if missing else result


@dataclass(frozen=True)
class Request:
    """One authorization IAM makes: an action on one resource with its context keys."""

    action: str
    resource: str
    context: Context
    why: str = ""


def _like(pattern: str, value: str, case: bool = True) -> bool:
    return fnmatch.fnmatchcase(value if case else value.lower(), pattern if case else pattern.lower())


def _listed(value: Any) -> list[str]:
    if isinstance(value, bool):
        return [str(value).lower()]
    return (
        [str(v).lower() if isinstance(v, bool) else str(v) for v in value]
        if isinstance(value, list)
        else [str(value)]
    )


def _compare(base: str, wanted: list[str], have: str) -> bool:
    if base in ("StringEquals", "Bool"):
        return have in wanted
    if base == "StringEqualsIgnoreCase":
        return have.lower() in [w.lower() for w in wanted]
    if base == "StringLike":
        return any(_like(w, have) for w in wanted)
    if base == "ArnLike":
        return any(_like(w, have) for w in wanted)
    raise ValueError(f"condition operator {base} is not modelled by iamaudit")


_NEGATED = {"StringNotEquals": "StringEquals", "StringNotLike": "StringLike", "ArnNotLike": "ArnLike"}


def condition_holds(operator: str, key: str, wanted_raw: Any, context: Context) -> bool:
    """One operator/key pair of a Condition block against the request context."""
    wanted = [w for w in (substitute(v, context) for v in _listed(wanted_raw)) if w is not None]
    values = next((v for k, v in context.items() if k.lower() == key.lower()), None)
    qualifier, _, base = operator.rpartition(":")
    if_exists = base.endswith("IfExists")
    base = base.removesuffix("IfExists")
    if base == "Null":
        return (values is None) == (wanted[0] == "true")
    negated = base in _NEGATED
    base = _NEGATED.get(base, base)
    if values is None:
        if qualifier == "ForAllValues" or if_exists:
            return True
        return negated and qualifier != "ForAnyValue"
    if qualifier == "ForAllValues":
        result = all(_compare(base, wanted, v) for v in values)
    elif qualifier == "ForAnyValue":
        result = any(_compare(base, wanted, v) for v in values)
    else:
        if len(values) != 1:
            raise ValueError(f"{key} has several values; a single-valued operator {operator} cannot test it")
        result = _compare(base, wanted, values[0])
    return not result if negated else result


def _matches(statement: dict[str, Any], request: Request) -> bool:
    if "Action" in statement:
        acted = any(_like(a, request.action, case=False) for a in _listed(statement["Action"]))
    else:
        acted = not any(_like(a, request.action, case=False) for a in _listed(statement["NotAction"]))
    if not acted:
        return False
    if "Resource" in statement:
        patterns = [substitute(r, request.context) for r in _listed(statement["Resource"])]
        placed = any(r is not None and _like(r, request.resource) for r in patterns)
    else:
        placed = not any(_like(r, request.resource) for r in _listed(statement["NotResource"]))
    if not placed:
        return False
    return all(
        condition_holds(operator, key, wanted, request.context)
        for operator, block in statement.get("Condition", {}).items()
        for key, wanted in block.items()
    )


def decide(policy: dict[str, Any], request: Request) -> str:
    """ "Deny" (explicit), "Allow", or "ImplicitDeny"."""
    statements = policy["Statement"]
    if any(s["Effect"] == "Deny" and _matches(s, request) for s in statements):
        return "Deny"
    if any(s["Effect"] == "Allow" and _matches(s, request) for s in statements):
        return "Allow"
    return "ImplicitDeny"


# --- from a recorded call to the authorizations EC2, SSM, S3 and KMS make for it --------------------------
#
# Resource types and condition keys per action: the Service Authorization Reference for Amazon EC2
# (https://docs.aws.amazon.com/service-authorization/latest/reference/list_amazonec2.html). Tags given at
# creation are also authorized as ec2:CreateTags with ec2:CreateAction
# (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/supported-iam-actions-tagging.html). CopyImage is
# authorized on the source image (since 2024-10-28), the new image and its snapshots, and tagging the copy
# needs ec2:CreateTags (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/copy-ami-permissions.html).
# Unsourced and therefore modelled conservatively: whether the tags CopyImageTags carries over reach IAM as
# aws:RequestTag. Nothing AWS publishes says they do (request tags are those of a request's
# TagSpecifications, and packer-plugin-amazon v1.8.2 copies with CopyImageTags and no TagSpecifications:
# builder/common/step_ami_region_copy.go:215-222, copyImageV1), so such a copy's image and snapshots are
# authorized here with no request tags at all, and tagging them as ec2:CreateTags with
# ec2:CreateAction=CopyImage and no request tags either. gpuforge's own copies (images.copy_image) give
# their tags as TagSpecifications, which are request tags.

_PREFIXES = {
    "i-": "instance",
    "ami-": "image",
    "snap-": "snapshot",
    "sg-": "security-group",
    "vol-": "volume",
    "subnet-": "subnet",
    "eni-": "network-interface",
    "vpc-": "vpc",
}
# What each creating action makes (the resource types of its TagSpecifications).
_CREATES = {
    "RunInstances": ("instance", "volume", "network-interface"),
    "CreateImage": ("image", "snapshot"),
    "CopyImage": ("image", "snapshot"),
    "CreateSecurityGroup": ("security-group",),
    "CreateKeyPair": ("key-pair",),
}
_NEW_ID = {"instance": "i-new", "volume": "vol-new", "network-interface": "eni-new"}


def resource_type(resource_id: str) -> str:
    return next((kind for prefix, kind in _PREFIXES.items() if resource_id.startswith(prefix)), "key-pair")


def arn(region: str, kind: str, name: str) -> str:
    # Images and snapshots have no account in their ARN (Service Authorization Reference, EC2 resource types).
    account = "" if kind in ("image", "snapshot") else ACCOUNT
    return f"arn:aws:ec2:{region}:{account}:{kind}/{name}"


def _tag_context(prefix: str, tags: dict[str, str]) -> Context:
    return {f"{prefix}/{k}": [v] for k, v in tags.items()}


def _base(call: dict[str, Any]) -> Context:
    return {"aws:RequestedRegion": [call["region"]], "ec2:Region": [call["region"]]}


def _existing(call: dict[str, Any], action: str, why: str) -> list[Request]:
    """The action on each resource the call names, with the tags that resource carried then."""
    requests = []
    for resource_id, tags in call.get("resources", {}).items():
        kind = resource_type(resource_id)
        context = {
            **_base(call),
            **_tag_context("aws:ResourceTag", tags),
            **_tag_context("ec2:ResourceTag", tags),
        }
        requests.append(Request(action, arn(call["region"], kind, resource_id), context, why))
    return requests


def _created(call: dict[str, Any], action: str) -> list[Request]:
    """The creating action on each new resource, and the CreateTags authorization for its tags."""
    requests = []
    request_tags = call.get("request_tags", {})
    copies_tags = call["action"] == "CopyImage" and call.get("params", {}).get("CopyImageTags") == "true"
    if copies_tags:
        # The copy carries the source image's tags (see the note above): not as request tags.
        request_tags = {k: v for k, v in request_tags.items() if k not in ("image", "snapshot")}
    for kind in _CREATES[call["action"]]:
        tags = request_tags.get(kind, {})
        name = (
            call.get("created", "new")
            if kind in ("image", "key-pair", "security-group")
            else _NEW_ID.get(kind, "new")
        )
        if kind == "snapshot":
            name = "snap-new"
        context = {**_base(call), **_tag_context("aws:RequestTag", tags)}
        if tags:
            context["aws:TagKeys"] = sorted(tags)
        if call["action"] == "RunInstances" and kind == "instance":
            context["ec2:InstanceType"] = [call.get("params", {}).get("InstanceType", "")]
        resource = arn(call["region"], kind, name)
        requests.append(Request(action, resource, context, f"new {kind}"))
        if tags or copies_tags:
            tagging = {**context, "ec2:CreateAction": [call["action"]]}
            requests.append(Request("ec2:CreateTags", resource, tagging, f"tags on the new {kind}"))
    return requests


def implied_kms_requests(call: dict[str, Any]) -> list[Request]:
    """What EC2 asks KMS on the caller's behalf for a customer-managed key named in the call.

    The user permissions EBS encryption needs (https://docs.aws.amazon.com/ebs/latest/userguide/
    ebs-encryption-requirements.html): kms:CreateGrant (only for AWS resources: kms:GrantIsForAWSResource),
    kms:Decrypt, kms:DescribeKey, kms:GenerateDataKeyWithoutPlaintext, kms:ReEncrypt*; EC2 makes them
    through the service, so kms:ViaService is ec2.<region>.amazonaws.com
    (https://docs.aws.amazon.com/kms/latest/developerguide/conditions-kms.html#conditions-kms-via-service).
    """
    keys = [v for k, v in call.get("params", {}).items() if k.endswith("KmsKeyId") and v]
    via = {"kms:ViaService": [f"ec2.{call['region']}.amazonaws.com"], "aws:RequestedRegion": [call["region"]]}
    requests = []
    for key in keys:
        for action in EBS_KMS_ACTIONS:
            context = dict(via)
            if action == "kms:CreateGrant":
                context["kms:GrantIsForAWSResource"] = ["true"]
            requests.append(Request(action, key, context, f"EBS encryption for {call['action']}"))
    return requests


EBS_KMS_ACTIONS = (
    "kms:CreateGrant",
    "kms:Decrypt",
    "kms:DescribeKey",
    "kms:GenerateDataKeyWithoutPlaintext",
    "kms:ReEncryptFrom",
    "kms:ReEncryptTo",
)


def _ec2_requests(call: dict[str, Any]) -> list[Request]:
    action = f"ec2:{call['action']}"
    if call["action"].startswith("Describe"):
        return [Request(action, "*", _base(call), "EC2 Describe* has no resource-level permissions")]
    if call["action"] == "CreateTags":
        tags = call.get("request_tags", {}).get("", {})
        requests = _existing(call, action, "tags an existing resource")
        extra = {**_tag_context("aws:RequestTag", tags), "aws:TagKeys": sorted(tags)}
        return [Request(r.action, r.resource, {**r.context, **extra}, r.why) for r in requests]
    requests = []
    if call["action"] in _CREATES:
        requests += _created(call, action)
        # RunInstances also uses the base image, key pair, security groups and subnet it names.
        requests += [r for r in _existing(call, action, "used by the new resource")]
    else:
        requests += _existing(call, action, "acts on an existing resource")
    profile = call.get("params", {}).get("IamInstanceProfile.Name")
    if call["action"] == "RunInstances" and profile:
        # gpuforge's builder profile and its role share one name (gpuforge.ami.iam, BuilderRole).
        # The builder's and the canary's profiles share their role's name (gpuforge.ami.iam); IAM
        # passes the role to EC2 (the iam:PassedToService key, Service Authorization Reference for IAM:
        # https://docs.aws.amazon.com/service-authorization/latest/reference/
        # list_awsidentityandaccessmanagementiam.html).
        passed = {"iam:PassedToService": ["ec2.amazonaws.com"]}
        requests.append(
            Request("iam:PassRole", f"arn:aws:iam::{ACCOUNT}:role/{profile}", passed, "the instance's role")
        )
    return requests + implied_kms_requests(call)


# Session Manager (the builder's tunnel): StartSession is authorized on the target instance, whose tags
# reach IAM as ssm:resourceTag/<key>, and on the session document (an AWS-owned document's ARN has no
# account); TerminateSession and the data channel on the session, which carries the system tags
# aws:ssmmessages:session-id (the caller's aws:userid) and aws:ssmmessages:target-id (AWS Systems Manager
# user guide: getting-started-restrict-access-examples, "Allow a user to end only sessions they started",
# Method 2; getting-started-specify-session-document for the document ARN).
_SESSION_DOCUMENT_ACCOUNT = ""


def _session_requests(call: dict[str, Any], context: Context) -> list[Request]:
    region = call.get("region", "us-east-1")
    action = f"{call.get('service')}:{call['action']}"
    requests = []
    for resource_id, tags in call.get("resources", {}).items():
        tagged = {**context, **_tag_context("ssm:resourceTag", tags)}
        if resource_id.startswith("i-"):
            tagged.update(_tag_context("aws:ResourceTag", tags))
            requests.append(Request(action, arn(region, "instance", resource_id), tagged, "the target"))
        else:
            resource = f"arn:aws:ssm:{region}:{ACCOUNT}:session/{resource_id}"
            requests.append(Request(action, resource, tagged, "the session"))
    document = call.get("params", {}).get("DocumentName")
    if call["action"] == "StartSession" and document:
        resource = f"arn:aws:ssm:{region}:{_SESSION_DOCUMENT_ACCOUNT}:document/{document}"
        requests.append(Request(action, resource, context, "the session document"))
    return requests


def requests_for(call: dict[str, Any]) -> list[Request]:
    """Every authorization IAM makes for one recorded call."""
    service = call.get("service", "ec2")
    if service == "ec2":
        return _ec2_requests(call)
    region = call.get("region", "us-east-1")
    context: Context = {
        "aws:RequestedRegion": [region],
        "aws:userid": [call.get("principal_userid", CALLER_USERID)],
    }
    if service == "ssmmessages" or call["action"] in ("StartSession", "TerminateSession"):
        return _session_requests(call, context)
    if service == "ssm":
        name = call.get("Name") or call.get("Path", "")
        account = "" if name.startswith("/aws/service/") else ACCOUNT
        resource = f"arn:aws:ssm:{region}:{account}:parameter{name}"
        return [Request(f"ssm:{call['action']}", resource, context)]
    if service == "iam":
        name = call.get("params", {}).get("InstanceProfileName", "")
        return [Request(f"iam:{call['action']}", f"arn:aws:iam::{ACCOUNT}:instance-profile/{name}", context)]
    return [Request(f"{service}:{call['action']}", call.get("resource", "*"), context)]


def denied(policy: dict[str, Any], calls: Iterable[dict[str, Any]]) -> list[str]:
    """One line per authorization of the calls that the policy does not allow."""
    lines = []
    for call in calls:
        for request in requests_for(call):
            outcome = decide(policy, request)
            if outcome != "Allow":
                where = call.get("source") or call.get("step") or ""
                line = (
                    f"{call['action']} -> {request.action} on {request.resource} ({request.why}): {outcome}"
                )
                lines.append(f"{line} {where}".rstrip())
    return lines
