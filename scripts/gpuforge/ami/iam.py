"""The pipeline role: packer/iam/pipeline-policy.json, and a CloudFormation template around it.

The JSON policy is the one source; `gpuforge pipeline-role` wraps it, unchanged, in a template that
creates the role for GitHub Actions (OIDC, one repository and environment) and for CodeBuild, and
the builder's instance profile the policy lets Packer pass (docs/ami-pipeline.md).
"""

from __future__ import annotations

import json
import re
from typing import Any

from gpuforge import paths
from gpuforge.errors import UserError

GITHUB_OIDC_HOST = "token.actions.githubusercontent.com"
DEFAULT_ENVIRONMENT = "ami-builder"
# Bakes take up to the workflow's 180 minutes; the role's session must outlive them.
SESSION_SECONDS = 4 * 3600
_OIDC_PROVIDER = f"arn:aws:iam::${{AWS::AccountId}}:oidc-provider/{GITHUB_OIDC_HOST}"
# The builder's instance profile and role share this name plus the region (`gpuforge bake`'s default
# --iam-instance-profile); the pipeline policy passes only gpuforge-builder* roles.
BUILDER_PROFILE_PREFIX = "gpuforge-builder"
# The canary nodes' profile and role (one name, like the builder's) and where their results go: the
# canary policy passes only gpuforge-canary* roles; canary.Request.results_prefix defaults to the prefix.
CANARY_PROFILE_PREFIX = "gpuforge-canary"
CANARY_RESULTS_PREFIX = "gpuforge-canary"
_REPOSITORY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,38}/[A-Za-z0-9._-]{1,100}$")


def builder_profile(region: str) -> str:
    """The builder's instance profile that `gpuforge pipeline-role`'s template creates in region."""
    return f"{BUILDER_PROFILE_PREFIX}-{region}"


def policy_document() -> dict[str, Any]:
    path = paths.repo_root() / "packer" / "iam" / "pipeline-policy.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the pipeline policy {path}: {exc}") from exc


def canary_policy_document() -> dict[str, Any]:
    """`gpuforge canary`'s grants, a managed policy of its own beside the pipeline policy."""
    path = paths.repo_root() / "packer" / "iam" / "canary-policy.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the canary policy {path}: {exc}") from exc


def cloudformation_template(
    github_repository: str | None, environment: str = DEFAULT_ENVIRONMENT
) -> dict[str, Any]:
    """A template with the managed policy, the builder profile and the roles that get the policy."""
    if github_repository is not None and not _REPOSITORY.match(github_repository):
        raise UserError(f"--github-repository {github_repository!r} is not OWNER/NAME")
    resources: dict[str, Any] = {
        "PipelinePolicy": {
            "Type": "AWS::IAM::ManagedPolicy",
            "Properties": {
                "Description": "gpuforge AMI pipeline: bake, rebuild, publish, prune (least privilege)",
                "PolicyDocument": policy_document(),
                # The roles that get the policy (the GitHub role is appended when asked for).
                "Roles": [{"Ref": "CodeBuildRole"}],
            },
        },
        "CanaryPolicy": {
            "Type": "AWS::IAM::ManagedPolicy",
            "Properties": {
                "Description": "gpuforge canary: launch, command and terminate canary instances",
                "PolicyDocument": canary_policy_document(),
                "Roles": [{"Ref": "CodeBuildRole"}],
            },
        },
        # The instance profile Packer attaches to the builder (`--iam-instance-profile`); the
        # policy's iam:PassRole covers only gpuforge-builder* names. It grants the builder only what
        # Packer's Session Manager tunnel needs (ssh_interface = "session_manager" in the template):
        # AWS's managed AmazonSSMManagedInstanceCore, which Packer names for it (hashicorp/packer v1.6.6
        # builder/amazon/common/run_config.go:544) and AWS documents for Session Manager
        # (https://docs.aws.amazon.com/systems-manager/latest/userguide/setup-instance-permissions.html).
        "BuilderRole": {
            "Type": "AWS::IAM::Role",
            "Properties": {
                "RoleName": {"Fn::Sub": f"{BUILDER_PROFILE_PREFIX}-${{AWS::Region}}"},
                "AssumeRolePolicyDocument": _trust({"Service": "ec2.amazonaws.com"}, "sts:AssumeRole"),
                "ManagedPolicyArns": [
                    {"Fn::Sub": "arn:${AWS::Partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"}
                ],
            },
        },
        "BuilderInstanceProfile": {
            "Type": "AWS::IAM::InstanceProfile",
            "Properties": {
                "InstanceProfileName": {"Fn::Sub": f"{BUILDER_PROFILE_PREFIX}-${{AWS::Region}}"},
                "Roles": [{"Ref": "BuilderRole"}],
            },
        },
        # The canary nodes' role and profile (`gpuforge canary --instance-profile`); the canary policy's
        # iam:PassRole covers only gpuforge-canary* roles passed to EC2. The nodes need the SSM agent's
        # permissions (AmazonSSMManagedInstanceCore, as the builder) for SendCommand, and s3:PutObject
        # under the results prefix, where the agent itself writes the command's output (SendCommand's
        # OutputS3BucketName/OutputS3KeyPrefix; the instance profile's own-bucket grant in
        # https://docs.aws.amazon.com/systems-manager/latest/userguide/setup-instance-profile.html). A
        # bucket with SSE-KMS or a bucket policy may need more; that is the bucket owner's to grant.
        "CanaryNodeRole": {
            "Type": "AWS::IAM::Role",
            "Properties": {
                "RoleName": {"Fn::Sub": f"{CANARY_PROFILE_PREFIX}-${{AWS::Region}}"},
                "AssumeRolePolicyDocument": _trust({"Service": "ec2.amazonaws.com"}, "sts:AssumeRole"),
                "ManagedPolicyArns": [
                    {"Fn::Sub": "arn:${AWS::Partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"}
                ],
                "Policies": [
                    {
                        "PolicyName": "canary-results",
                        "PolicyDocument": {
                            "Version": "2012-10-17",
                            "Statement": [
                                {
                                    "Effect": "Allow",
                                    "Action": ["s3:PutObject"],
                                    "Resource": {
                                        "Fn::Sub": "arn:${AWS::Partition}:s3:::${CanaryResultsBucket}/"
                                        f"{CANARY_RESULTS_PREFIX}/*"
                                    },
                                }
                            ],
                        },
                    }
                ],
            },
        },
        "CanaryInstanceProfile": {
            "Type": "AWS::IAM::InstanceProfile",
            "Properties": {
                "InstanceProfileName": {"Fn::Sub": f"{CANARY_PROFILE_PREFIX}-${{AWS::Region}}"},
                "Roles": [{"Ref": "CanaryNodeRole"}],
            },
        },
        "CodeBuildRole": {
            "Type": "AWS::IAM::Role",
            "Properties": {
                "AssumeRolePolicyDocument": _trust(
                    {"Service": "codebuild.amazonaws.com"},
                    "sts:AssumeRole",
                    {"StringEquals": {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}},
                ),
                # CodeBuild writes its build log to CloudWatch Logs under its project's group.
                "Policies": [
                    {
                        "PolicyName": "codebuild-logs",
                        "PolicyDocument": {
                            "Version": "2012-10-17",
                            "Statement": [
                                {
                                    "Effect": "Allow",
                                    "Action": [
                                        "logs:CreateLogGroup",
                                        "logs:CreateLogStream",
                                        "logs:PutLogEvents",
                                    ],
                                    "Resource": {
                                        "Fn::Sub": "arn:aws:logs:${AWS::Region}:${AWS::AccountId}"
                                        ":log-group:/aws/codebuild/gpuforge-*"
                                    },
                                }
                            ],
                        },
                    }
                ],
            },
        },
    }
    outputs: dict[str, Any] = {
        "CodeBuildRoleArn": {"Value": {"Fn::GetAtt": ["CodeBuildRole", "Arn"]}},
        "BuilderInstanceProfileName": {"Value": {"Ref": "BuilderInstanceProfile"}},
        "CanaryInstanceProfileName": {"Value": {"Ref": "CanaryInstanceProfile"}},
    }
    if github_repository is not None:
        resources["GitHubRole"] = {
            "Type": "AWS::IAM::Role",
            "Properties": {
                "MaxSessionDuration": SESSION_SECONDS,
                "AssumeRolePolicyDocument": _trust(
                    {
                        "Federated": {
                            "Fn::Sub": f"arn:aws:iam::${{AWS::AccountId}}:oidc-provider/{GITHUB_OIDC_HOST}"
                        }
                    },
                    "sts:AssumeRoleWithWebIdentity",
                    {
                        # Only this repository's jobs that run in the named environment
                        # (.github/workflows/ami-rebuild.yml sets `environment: ami-builder`).
                        "StringEquals": {
                            f"{GITHUB_OIDC_HOST}:aud": "sts.amazonaws.com",
                            f"{GITHUB_OIDC_HOST}:sub": f"repo:{github_repository}:environment:{environment}",
                        }
                    },
                ),
            },
        }
        resources["PipelinePolicy"]["Properties"]["Roles"].append({"Ref": "GitHubRole"})
        resources["CanaryPolicy"]["Properties"]["Roles"].append({"Ref": "GitHubRole"})
        outputs["GitHubRoleArn"] = {"Value": {"Fn::GetAtt": ["GitHubRole", "Arn"]}}
    return {
        "AWSTemplateFormatVersion": "2010-09-09",
        "Description": "gpuforge AMI pipeline role (generated by `gpuforge pipeline-role`)",
        "Parameters": {
            "CanaryResultsBucket": {
                "Type": "String",
                "Default": "*",
                "Description": "the bucket `gpuforge canary --results-bucket` names; the canary nodes may "
                f"write only under its {CANARY_RESULTS_PREFIX}/ prefix (default: that prefix of any bucket)",
            }
        },
        "Resources": resources,
        "Outputs": outputs,
    }


def _trust(principal: dict[str, Any], action: str, condition: dict[str, Any] | None = None) -> dict[str, Any]:
    statement: dict[str, Any] = {"Effect": "Allow", "Principal": principal, "Action": action}
    if condition:
        statement["Condition"] = condition
    return {"Version": "2012-10-17", "Statement": [statement]}
