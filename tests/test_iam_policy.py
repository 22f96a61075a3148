"""The pipeline role's least-privilege policy (packer/iam/pipeline-policy.json) against the code.

conftest.py records every AWS call of the whole session (GPUFORGE_AWS_CALL_LOG) and fails the
session when the pipeline made one the policy does not grant; the tests here check the policy's
shape, compare it with the calls the source can make, and run the pipeline commands once on moto.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

import iamaudit
from gpuforge import aws as gpuforge_aws
from gpuforge.ami import images
from gpuforge.lab.moto import MotoServer
from imagetools import baked_image


def test_policy_is_valid_and_names_every_action() -> None:
    policy = iamaudit.load_policy()
    assert policy["Version"] == "2012-10-17"
    sids = [statement["Sid"] for statement in policy["Statement"]]
    assert len(sids) == len(set(sids))
    for statement in policy["Statement"]:
        assert statement["Sid"].startswith(("Gpuforge", "Packer")), statement["Sid"]
        assert statement["Effect"] == "Allow"
        actions = statement["Action"]
        assert isinstance(actions, list) and actions == sorted(actions), statement["Sid"]
        for action in actions:
            # No wildcard actions: every grant is one API operation someone can point to.
            assert "*" not in action and "?" not in action, action


def test_destructive_actions_are_scoped() -> None:
    """Deregister/delete/terminate/put/pass only on named resources or tagged ones, never on `*`."""
    for statement in iamaudit.load_policy()["Statement"]:
        destructive = [
            a for a in statement["Action"] if a.split(":", 1)[1].startswith(iamaudit.DESTRUCTIVE_VERBS)
        ]
        if not destructive:
            continue
        resources = statement["Resource"]
        resources = [resources] if isinstance(resources, str) else resources
        assert "*" not in resources, f"{statement['Sid']} grants {destructive} on every resource"
        assert all(r.startswith("arn:aws:") for r in resources)
    statements = {s["Sid"]: s for s in iamaudit.load_policy()["Statement"]}
    # Images and snapshots: only those gpuforge tagged (Packer tags both with gpuforge:flavor).
    for sid in ("GpuforgeRetireOwnImages", "GpuforgeRetireOwnSnapshots"):
        assert statements[sid]["Condition"] == {"StringLike": {"aws:ResourceTag/gpuforge:flavor": "?*"}}
    # SSM writes only under the project's prefix; PassRole only for the builder's profile.
    assert statements["GpuforgeParameters"]["Resource"] == "arn:aws:ssm:*:*:parameter/gpuforge/*"
    assert all("gpuforge-builder" in r for r in statements["PackerPassBuilderRole"]["Resource"])


def test_policy_grants_exactly_what_the_pipeline_code_calls() -> None:
    policy = iamaudit.load_policy()
    called = iamaudit.static_actions()
    assert {"ec2:DescribeImages", "ec2:DeregisterImage", "ssm:PutParameter"} <= set(called)
    gpuforge_grants = iamaudit.granted(policy, "Gpuforge")
    missing = {a: sorted(by) for a, by in called.items() if a not in gpuforge_grants}
    assert not missing, f"code calls actions the policy does not grant: {missing}"
    unused = gpuforge_grants - set(called)
    assert not unused, f"the policy grants actions no gpuforge code path calls: {sorted(unused)}"


def test_packer_grants_come_from_packers_documented_policy() -> None:
    packer_grants = iamaudit.granted(iamaudit.load_policy(), "Packer")
    assert packer_grants <= iamaudit.PACKER_DOCUMENTED, packer_grants - iamaudit.PACKER_DOCUMENTED
    # What the amazon-ebs builder cannot work without (launch, image, clean up).
    assert {"ec2:RunInstances", "ec2:CreateImage", "ec2:TerminateInstances", "iam:PassRole"} <= packer_grants


def test_a_new_call_without_its_permission_is_caught(tmp_path: Path) -> None:
    """The checks fail when code gains a call the policy lacks (static and recorded views)."""
    module = tmp_path / "copy.py"
    module.write_text(
        "from gpuforge import aws\n"
        "def copy(ami):\n"
        "    ec2 = aws.client('ec2')\n"
        "    ec2.copy_image(SourceImageId=ami, SourceRegion='us-east-1', Name='x')\n"
        "    ec2.get_waiter('snapshot_completed')\n"
    )
    found = iamaudit.static_actions([module])
    assert set(found) == {"ec2:CopyImage", "ec2:DescribeSnapshots"}
    assert "ec2:CopyImage" not in iamaudit.granted(iamaudit.load_policy(), "Gpuforge")

    log = tmp_path / "calls.jsonl"
    log.write_text(
        json.dumps({"action": "ec2:CopyImage", "caller": "gpuforge.ami.copy"})
        + "\n"
        + json.dumps({"action": "ec2:RunInstances", "caller": "gpuforge.lab.ec2"})
        + "\n"
    )
    # The lab's own calls are not the pipeline's; the pipeline's CopyImage is reported.
    problems = iamaudit.ungranted(iamaudit.recorded_actions(log), iamaudit.load_policy())
    assert problems == ["ec2:CopyImage (called by gpuforge.ami.copy)"]


def test_client_records_each_call_with_its_caller(
    aws: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv(gpuforge_aws.CALL_LOG_ENV, str(log))
    assert images.gpuforge_images("dlami") == []
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert entries == [{"action": "ec2:DescribeImages", "caller": "gpuforge.ami.images"}]


def test_pipeline_commands_on_moto_call_only_granted_actions(aws: MotoServer, tmp_path: Path) -> None:
    """publish and prune as the scheduled job runs them, each a separate process."""
    # Tagged as a bake tags it: publish refuses an image without gpuforge's tags (gpuforge.ami.fitness).
    amis = [baked_image("pcluster", f"gpuforge-pcluster-{n}") for n in range(3)]
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, gpuforge_aws.CALL_LOG_ENV: str(log)}
    commands = [
        ["publish", "--flavor", "pcluster", "--ami", amis[2]],
        ["prune", "--flavor", "pcluster", "--keep", "1", "--dry-run"],
        ["prune", "--flavor", "pcluster", "--keep", "1"],
    ]
    for command in commands:
        result = subprocess.run(
            [sys.executable, "-m", "gpuforge.cli", *command],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, (command, result.stderr)
    calls = iamaudit.recorded_actions(log)
    assert {"ssm:PutParameter", "ec2:DescribeImages", "ec2:DeregisterImage"} <= set(calls)
    assert iamaudit.ungranted(calls, iamaudit.load_policy()) == []


def test_pipeline_role_template_wraps_the_policy_lints_and_deploys(aws: MotoServer, tmp_path: Path) -> None:
    """`gpuforge pipeline-role`: cfn-lint clean; CloudFormation (moto) makes roles holding the policy."""
    result = subprocess.run(
        [sys.executable, "-m", "gpuforge.cli", "pipeline-role", "--github-repository", "acme/gpuforge"],
        capture_output=True,
        text=True,
        check=True,
    )
    template = json.loads(result.stdout)
    resources = template["Resources"]
    assert resources["PipelinePolicy"]["Properties"]["PolicyDocument"] == iamaudit.load_policy()
    trust = resources["GitHubRole"]["Properties"]["AssumeRolePolicyDocument"]["Statement"][0]
    assert trust["Condition"]["StringEquals"] == {
        "token.actions.githubusercontent.com:aud": "sts.amazonaws.com",
        "token.actions.githubusercontent.com:sub": "repo:acme/gpuforge:environment:ami-builder",
    }
    path = tmp_path / "pipeline-role.json"
    path.write_text(result.stdout)
    lint = subprocess.run(
        [str(Path(sys.executable).parent / "cfn-lint"), str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr

    cfn = boto3.client("cloudformation")
    cfn.create_stack(
        StackName="gpuforge-pipeline", TemplateBody=result.stdout, Capabilities=["CAPABILITY_NAMED_IAM"]
    )
    created = {
        r["LogicalResourceId"]: r["PhysicalResourceId"]
        for r in cfn.describe_stack_resources(StackName="gpuforge-pipeline")["StackResources"]
    }
    iam_client = boto3.client("iam")
    for role in ("GitHubRole", "CodeBuildRole"):
        attached = iam_client.list_attached_role_policies(RoleName=created[role])["AttachedPolicies"]
        assert [p["PolicyArn"] for p in attached] == [created["PipelinePolicy"]]
    version = iam_client.get_policy(PolicyArn=created["PipelinePolicy"])["Policy"]["DefaultVersionId"]
    document = iam_client.get_policy_version(PolicyArn=created["PipelinePolicy"], VersionId=version)
    assert document["PolicyVersion"]["Document"] == iamaudit.load_policy()


def test_pipeline_role_refuses_a_malformed_repository() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gpuforge.cli", "pipeline-role", "--github-repository", "acme gpuforge"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "is not OWNER/NAME" in result.stderr
