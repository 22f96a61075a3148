"""The pipeline role's least-privilege policy (packer/iam/pipeline-policy.json) against the code.

conftest.py records every AWS call of the whole session (GPUFORGE_AWS_CALL_LOG) and fails the
session when the pipeline made one the policy does not grant; the tests here check the policy's
shape, compare it with the calls the source can make, and run the pipeline commands once on moto.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import boto3
import pytest

import iamaudit
import packerrecord
from gpuforge import aws as gpuforge_aws
from gpuforge.ami import images
from gpuforge_lab.moto import MotoServer
from imagetools import baked_image
from test_packer_security import needs_packer_1_6


def test_policy_is_valid_and_names_every_action() -> None:
    policy = iamaudit.load_policy()
    assert policy["Version"] == "2012-10-17"
    sids = [statement["Sid"] for statement in policy["Statement"]]
    assert len(sids) == len(set(sids))
    for statement in policy["Statement"]:
        assert statement["Sid"].startswith(("Gpuforge", "Packer", "EbsEncryption")), statement["Sid"]
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
    # Images and snapshots: only those a bake made. The build id is on them from CreateImage on (the
    # amazon plugin tags the image and its snapshot with run_tags); gpuforge:flavor only from the last step.
    for sid in ("GpuforgeRetireOwnImages", "GpuforgeRetireOwnSnapshots"):
        assert statements[sid]["Condition"] == {"StringLike": {"aws:ResourceTag/gpuforge:build-id": "?*"}}
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


def test_kms_grants_are_ebs_encryptions_and_only_through_ec2() -> None:
    """A customer-managed key: what EBS needs, only via EC2, grants only for AWS resources."""
    for statement in iamaudit.load_policy()["Statement"]:
        kms = [a for a in statement["Action"] if a.startswith("kms:")]
        if not kms:
            continue
        assert statement["Sid"].startswith("EbsEncryption") and set(kms) <= set(iamaudit.EBS_KMS_ACTIONS)
        assert statement["Condition"]["StringLike"]["kms:ViaService"] == "ec2.*.amazonaws.com"
        if "kms:CreateGrant" in kms:
            assert statement["Condition"]["Bool"] == {"kms:GrantIsForAWSResource": "true"}


def test_policy_fits_a_managed_policy() -> None:
    """IAM's managed-policy limit: 6,144 characters, whitespace not counted (IAM and STS quotas page)."""
    text = iamaudit.POLICY.read_text()
    assert len("".join(text.split())) <= 6144


def test_packer_grants_come_from_packers_documented_policy() -> None:
    packer_grants = iamaudit.granted(iamaudit.load_policy(), "Packer")
    sourced = iamaudit.PACKER_DOCUMENTED | iamaudit.PACKER_SESSION_MANAGER
    assert packer_grants <= sourced, packer_grants - sourced
    # What the amazon-ebs builder cannot work without (launch, image, clean up).
    assert {"ec2:RunInstances", "ec2:CreateImage", "ec2:TerminateInstances", "iam:PassRole"} <= packer_grants


def test_a_new_call_without_its_permission_is_caught(tmp_path: Path) -> None:
    """The checks fail when code gains a call the policy lacks (static and recorded views)."""
    module = tmp_path / "copy.py"
    module.write_text(
        "from gpuforge import aws\n"
        "def copy(ami):\n"
        "    ec2 = aws.client('ec2')\n"
        "    ec2.copy_snapshot(SourceSnapshotId=ami, SourceRegion='us-east-1')\n"
        "    ec2.get_waiter('volume_available')\n"
    )
    found = iamaudit.static_actions([module])
    assert set(found) == {"ec2:CopySnapshot", "ec2:DescribeVolumes"}
    assert "ec2:CopySnapshot" not in iamaudit.granted(iamaudit.load_policy(), "Gpuforge")

    log = tmp_path / "calls.jsonl"
    log.write_text(
        json.dumps({"action": "ec2:DeleteVolume", "caller": "gpuforge.ami.copy"})
        + "\n"
        + json.dumps({"action": "ec2:RunInstances", "caller": "gpuforge_lab.ec2"})
        + "\n"
    )
    # The lab's own calls are not the pipeline's; the pipeline's DeleteVolume is reported.
    problems = iamaudit.ungranted(iamaudit.recorded_actions(log), iamaudit.load_policy())
    assert problems == ["ec2:DeleteVolume (called by gpuforge.ami.copy)"]


def test_client_records_each_call_with_its_caller(
    aws: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv(gpuforge_aws.CALL_LOG_ENV, str(log))
    assert images.gpuforge_images("dlami") == []
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    # gpuforge.ami.images pages through gpuforge.image.describe_images, which makes the call.
    assert entries == [{"action": "ec2:DescribeImages", "caller": "gpuforge.image"}]


def test_pipeline_commands_on_moto_call_only_granted_actions(aws: MotoServer, tmp_path: Path) -> None:
    """publish and prune as the scheduled job runs them, each a separate process."""
    # Tagged as a bake tags it: publish refuses an image without gpuforge's tags (gpuforge.fitness).
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
    # The role's grants are the pipeline policy and the canary's (iamaudit.load_policy merges them).
    policies = [resources[name]["Properties"] for name in ("PipelinePolicy", "CanaryPolicy")]
    statements = [s for p in policies for s in p["PolicyDocument"]["Statement"]]
    assert statements == iamaudit.load_policy()["Statement"]
    assert policies[0]["Roles"] == policies[1]["Roles"]
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
        assert sorted(p["PolicyArn"] for p in attached) == sorted(
            created[name] for name in ("PipelinePolicy", "CanaryPolicy")
        )
    version = iam_client.get_policy(PolicyArn=created["PipelinePolicy"])["Policy"]["DefaultVersionId"]
    document = iam_client.get_policy_version(PolicyArn=created["PipelinePolicy"], VersionId=version)
    assert document["PolicyVersion"]["Document"] == iamaudit.load_policy(iamaudit.POLICY, canary=False)


def test_pipeline_role_refuses_a_malformed_repository() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gpuforge.cli", "pipeline-role", "--github-repository", "acme gpuforge"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "is not OWNER/NAME" in result.stderr


# --- the policy against Packer's real call order (gpuforge issue 28) ------------------------------------

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "packer"
PLUGIN_SEQUENCE = json.loads((FIXTURES / "amazon-ebs-sequence.json").read_text())
RECORDED_SCENARIOS = ("success", "fail-after-create-image")


def _made(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls that reached EC2 (a call the recorder refused as IAM would is not one to grant)."""
    return [c for c in calls if c.get("status", 200) == 200]


STAGED_SCENARIOS = sorted(k for k, v in PLUGIN_SEQUENCE["scenarios"].items() if v.get("staged", True))


@pytest.mark.parametrize("scenario", STAGED_SCENARIOS)
def test_policy_allows_every_call_of_the_amazon_plugins_bake(scenario: str) -> None:
    """packer-plugin-amazon v1.8.2 (production: Packer 1.11.2, plugin ~> 1.8.2), its calls in its order.

    The failed bake's cleanup (stepCreateAMI.Cleanup: DeregisterImage, DeleteSnapshot; terminate, delete
    the group and key pair) is allowed too, so a failed bake leaves nothing behind.
    """
    calls = _made(PLUGIN_SEQUENCE["scenarios"][scenario]["calls"])
    assert iamaudit.denied(iamaudit.load_policy(), calls) == []
    if scenario.startswith("fail"):
        assert {"DeregisterImage", "DeleteSnapshot", "TerminateInstances"} <= {c["action"] for c in calls}


def test_the_plugins_own_region_copy_is_denied_where_it_tags_the_untagged_snapshot() -> None:
    """Why Packer gets no ami_regions: packer-plugin-amazon v1.8.2 copies with CopyImageTags and no
    TagSpecifications, so the copy's snapshot arrives untagged, and StepCreateTags tags it with the copy in
    one CreateTags (step_create_tags.go:117). A policy that let that through would let the role tag, and so
    delete, any untagged snapshot of the account (gpuforge issue 34, R1)."""
    scenario = PLUGIN_SEQUENCE["scenarios"]["plugin-region-copy"]
    assert scenario["staged"] is False
    policy = iamaudit.load_policy()
    refused = [c for c in scenario["calls"] if c.get("status", 200) != 200]
    assert [(c["action"], c["region"], c["source"]) for c in refused] == [
        ("CreateTags", "us-west-2", "common/step_create_tags.go:117")
    ]
    assert iamaudit.denied(policy, refused) != []
    copy = next(c for c in scenario["calls"] if c["action"] == "CopyImage")
    assert "request_tags" not in copy and copy["params"]["CopyImageTags"] == "true"
    # Its cleanup deregisters only the build region's image: the copy and its snapshot are left to gpuforge,
    # which may not delete a snapshot without the build id.
    cleanup = [c for c in scenario["calls"] if "Cleanup" in c["step"] and c["action"] == "DeregisterImage"]
    assert {c["region"] for c in cleanup} == {"us-east-1"}
    untagged = {
        "action": "DeleteSnapshot",
        "region": "us-west-2",
        "resources": {"snap-0b1de5c0ffee00005": {}},
    }
    assert iamaudit.denied(policy, [untagged]) != []


def test_the_staged_template_gives_packer_no_region_copy() -> None:
    """Neither ami_regions nor encrypt_boot (which copies too): gpuforge copies the image itself."""
    for name in ("gpuforge.pkr.hcl", "amazon-ebs.pkr.hcl.modern"):
        text = (iamaudit.REPO / "packer" / name).read_text()
        assert not re.search(r"^\s*(ami_regions|encrypt_boot|region_kms_key_ids)\s*=", text, re.M), name


# gpuforge's copy (gpuforge.ami.images.copy_image and bake_aws): CopyImage with the image's tags as
# TagSpecifications on the new image and its snapshots, then the checks on the copy.
COPY_TAGS = {
    "Name": "gpuforge-dlami-source",
    "gpuforge:build-id": "20261206-source",
    "gpuforge:flavor": "dlami",
    "gpuforge:installed:nccl": "2.27.7",
}
GPUFORGE_COPY: list[dict[str, Any]] = [
    {
        "action": "CopyImage",
        "region": "us-west-2",
        "created": "ami-0b1de5c0ffee00008",
        "params": {"SourceRegion": "us-east-1", "Encrypted": "true"},
        "request_tags": {"image": COPY_TAGS, "snapshot": COPY_TAGS},
        "resources": {"ami-0b1de5c0ffee00002": COPY_TAGS},
    },
    {"action": "DescribeImages", "region": "us-west-2", "resources": {"ami-0b1de5c0ffee00008": COPY_TAGS}},
    {
        "action": "ModifyImageAttribute",
        "region": "us-west-2",
        "params": {"ImdsSupport.Value": "v2.0"},
        "resources": {"ami-0b1de5c0ffee00008": COPY_TAGS},
    },
]
# bake._discard -> images.discard_build in the copy region after a failure: the copy and its snapshot, then
# any snapshot still carrying the build id.
GPUFORGE_DISCARD_COPY: list[dict[str, Any]] = [
    {"action": "DescribeImages", "region": "us-west-2"},
    {"action": "DeregisterImage", "region": "us-west-2", "resources": {"ami-0b1de5c0ffee00008": COPY_TAGS}},
    {"action": "DeleteSnapshot", "region": "us-west-2", "resources": {"snap-0b1de5c0ffee00009": COPY_TAGS}},
    {"action": "DescribeSnapshots", "region": "us-west-2"},
    {"action": "DeleteSnapshot", "region": "us-west-2", "resources": {"snap-0b1de5c0ffee0000a": COPY_TAGS}},
]


def test_policy_allows_a_multi_region_bake_in_order() -> None:
    """A --copy-region bake: the plugin's calls in its order (the staged template), then gpuforge's copy;
    and a failed one's cleanup there. Before issue 34 the bake gave Packer ami_regions instead, whose calls
    (plugin-region-copy) the policy denies at the copy's snapshot."""
    policy = iamaudit.load_policy()
    plugin = _made(PLUGIN_SEQUENCE["scenarios"]["success"]["calls"])
    assert iamaudit.denied(policy, [*plugin, *GPUFORGE_COPY]) == []
    assert iamaudit.denied(policy, [*plugin, *GPUFORGE_COPY, *GPUFORGE_DISCARD_COPY]) == []
    tagging = [r for r in iamaudit.requests_for(GPUFORGE_COPY[0]) if r.action == "ec2:CreateTags"]
    assert {r.resource.split(":")[-1].split("/")[0] for r in tagging} == {"image", "snapshot"}
    assert all(r.context["ec2:CreateAction"] == ["CopyImage"] for r in tagging)


def test_copy_tagging_is_for_copies_that_carry_the_build_id() -> None:
    """CreateTags at CopyImage is allowed only with gpuforge:build-id among the request's tags: a copy with
    CopyImageTags alone (no request tags: Packer's) is not, nor is tagging a snapshot that exists."""
    policy = iamaudit.load_policy()
    unscoped = {**GPUFORGE_COPY[0], "request_tags": {"image": {"Name": "x"}, "snapshot": {"Name": "x"}}}
    assert iamaudit.denied(policy, [unscoped]) != []
    packers = {**GPUFORGE_COPY[0], "params": {"CopyImageTags": "true", "SourceRegion": "us-east-1"}}
    packers.pop("request_tags")
    assert iamaudit.denied(policy, [packers]) != []
    retag = {
        "action": "CreateTags",
        "region": "us-west-2",
        "request_tags": {"": COPY_TAGS},
        "resources": {"snap-0fee1d00000000001": {}},
    }
    assert iamaudit.denied(policy, [retag]) != []


def test_packer_installs_the_plugin_release_the_policy_was_checked_against() -> None:
    """`packer init` installs the newest release the constraint allows: only patch releases of the one whose
    call sequence the policy passes (`~> 1.3` let any 1.x in, with calls nobody checked)."""
    text = (iamaudit.REPO / "packer" / "plugins.pkr.hcl.modern").read_text()
    block = re.search(r"amazon = \{(.*?)\}", text, re.S)
    assert block is not None
    constraint = re.search(r'version\s*=\s*"([^"]+)"', block.group(1))
    assert constraint is not None
    assert constraint.group(1) == f"~> {PLUGIN_SEQUENCE['about']['tag'].removeprefix('v')}"


def test_the_plugin_sequence_names_its_source() -> None:
    about = PLUGIN_SEQUENCE["about"]
    assert about["tag"] == "v1.8.2" and len(about["commit"]) == 40
    for scenario in PLUGIN_SEQUENCE["scenarios"].values():
        for call in scenario["calls"]:
            assert re.fullmatch(r"(common|builder/ebs)/(ssm/)?\w+\.go:\d+", call["source"]), call


def _recorded(scenario: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / f"packer-1.6.6-{scenario}.json").read_text()))


def test_packer_1_6_order_matches_the_plugins_step_order() -> None:
    """Debian's Packer 1.6.6 makes the plugin's calls in the plugin's order in the build region (same steps,
    same sequence); its recording copies to a region too, which gpuforge no longer asks Packer to do."""

    def build_region(calls: list[dict[str, Any]]) -> list[str]:
        return [
            c["action"]
            for c in calls
            if c["region"] == "us-east-1"
            and c.get("service", "ec2") == "ec2"
            and not c["action"].startswith("Describe")
            and c["action"] != "CopyImage"
            # The plugin sets imds_support (amazon-ebs.pkr.hcl.modern): one more ModifyImageAttribute.
            and "ImdsSupport.Value" not in c.get("params", {})
        ]

    recorded = build_region(_recorded("success")["calls"])
    assert recorded == build_region(PLUGIN_SEQUENCE["scenarios"]["success"]["calls"])


# Where Packer 1.6.6 differs: it tags nothing it creates except the instance and its volumes (no run_tags on
# CreateKeyPair, CreateSecurityGroup, CreateImage; CopyImage without CopyImageTags), so the image and its
# copy are untagged until StepCreateTags, its last step. No tag-scoped policy can let it modify, tag or clean
# up those images without letting the role do so to every untagged image of the account. CopyImage itself
# is not among them: the policy cannot scope a copy by tags (iamaudit: CopyImageTags gives no request
# tags), and a copy only adds an image; Packer 1.6's untagged copy is then denied its tags and cleanup.
PACKER_1_6_DENIED = {
    "success": {
        ("CreateSecurityGroup", "security-group"),
        ("AuthorizeSecurityGroupIngress", "security-group"),
        ("CreateImage", "image"),
        ("CreateImage", "snapshot"),
        ("ModifyImageAttribute", "image"),
        ("CreateTags", "image"),
        ("CreateTags", "snapshot"),
        ("DeleteSecurityGroup", "security-group"),
    },
    "fail-after-create-image": {
        ("CreateSecurityGroup", "security-group"),
        ("AuthorizeSecurityGroupIngress", "security-group"),
        ("CreateImage", "image"),
        ("CreateImage", "snapshot"),
        ("DeregisterImage", "image"),
        ("DeleteSnapshot", "snapshot"),
        ("DeleteSecurityGroup", "security-group"),
    },
}


@pytest.mark.parametrize("scenario", RECORDED_SCENARIOS)
def test_packer_1_6_recording_is_denied_exactly_where_it_tags_late(scenario: str) -> None:
    """The real builder's record: all Packer 1.6.6 needs beyond the policy comes from its late tags."""
    record = _recorded(scenario)
    assert record["about"]["packer"] == "1.6.6"
    policy = iamaudit.load_policy()
    got = set()
    for call in _made(record["calls"]):
        for request in iamaudit.requests_for(call):
            if iamaudit.decide(policy, request) != "Allow":
                got.add((call["action"], request.resource.split(":")[-1].split("/")[0]))
    assert got == PACKER_1_6_DENIED[scenario]
    # The calls it shares with the plugin are allowed: launch, stop, terminate, the key pair.
    actions = {c["action"] for c in _made(record["calls"])}
    assert {"RunInstances", "StopInstances", "TerminateInstances", "DeleteKeyPair"} <= actions


@pytest.mark.slow
@needs_packer_1_6
@pytest.mark.parametrize("scenario", packerrecord.SCENARIOS, ids=lambda s: s.name)
def test_recording_the_real_builder_again_gives_the_committed_sequence(
    scenario: packerrecord.Scenario, moto_server: MotoServer, tmp_path: Path
) -> None:
    """Packer 1.6.6 against moto through awsrecorder: the same calls, in order, with the same tags."""
    fresh = packerrecord.record(scenario, moto_server, tmp_path)
    committed = _recorded(scenario.name)
    assert fresh["about"]["exit_status"] == committed["about"]["exit_status"]

    def shape(calls: list[dict[str, Any]]) -> list[tuple[str, str, int, list[str]]]:
        """Each call without its ids (moto makes new ones each run): action, region, status, tags."""
        return [
            (
                str(c["action"]),
                str(c["region"]),
                int(c["status"]),
                sorted(json.dumps(t, sort_keys=True) for t in c.get("resources", {}).values()),
            )
            for c in calls
        ]

    # Packer walks its region -> image map (a Go map) in no fixed order: compare each region's sequence,
    # and leave out ModifyImageAttribute, whose count before the refused one depends on that order.
    def by_region(calls: list[dict[str, Any]]) -> list[tuple[str, str, int, list[str]]]:
        kept = [c for c in calls if c["action"] != "ModifyImageAttribute"]
        return sorted(shape(kept), key=lambda call: call[1])

    def refused(calls: list[dict[str, Any]]) -> list[str]:
        return [c["action"] for c in calls if c["status"] != 200]

    assert refused(fresh["calls"]) == refused(committed["calls"])

    assert by_region(fresh["calls"]) == by_region(committed["calls"])


# gpuforge's own calls with the resources as they are when it makes them (scripts/gpuforge/ami): the
# bake's IMDSv2 calls, installed tags and _discard; publish; prune.
BUILD = {"gpuforge:build-id": "20261206-x", "Name": "gpuforge-bake-20261206-x"}
IMAGE = {**BUILD, "gpuforge:flavor": "dlami"}
GPUFORGE_CALLS: list[dict[str, Any]] = [
    # bake.BuilderImds -> images.require_instance_imdsv2: the builder Packer launched with run_tags.
    {
        "action": "ModifyInstanceMetadataOptions",
        "region": "us-east-1",
        "resources": {"i-0123456789abcdef0": BUILD},
    },
    # images.require_imdsv2 and images.add_tags on the image and on a copy in another region.
    {"action": "ModifyImageAttribute", "region": "us-east-1", "resources": {"ami-0123456789abcdef0": IMAGE}},
    {"action": "ModifyImageAttribute", "region": "us-west-2", "resources": {"ami-0123456789abcdef1": IMAGE}},
    {
        "action": "CreateTags",
        "region": "us-west-2",
        "resources": {"ami-0123456789abcdef1": IMAGE},
        "request_tags": {"": {"gpuforge:installed:nccl": "2.27.7"}},
    },
    # bake._discard: images of a failed bake found by build id (the copy carries it from CopyImage on).
    {"action": "DeregisterImage", "region": "us-west-2", "resources": {"ami-0123456789abcdef1": BUILD}},
    {"action": "DeleteSnapshot", "region": "us-west-2", "resources": {"snap-0123456789abcdef1": BUILD}},
    # prune / publish.
    {"action": "DeregisterImage", "region": "us-east-1", "resources": {"ami-0123456789abcdef0": IMAGE}},
    {"action": "DeleteSnapshot", "region": "us-east-1", "resources": {"snap-0123456789abcdef0": IMAGE}},
    {"service": "ssm", "action": "PutParameter", "region": "us-east-1", "Name": "/gpuforge/ami/dlami/latest"},
    {"service": "ssm", "action": "GetParametersByPath", "region": "us-east-1", "Path": "/gpuforge"},
    {
        "service": "ssm",
        "action": "GetParameter",
        "region": "us-east-1",
        "Name": "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id",
    },
]


def test_policy_allows_gpuforges_own_calls_on_what_a_bake_made() -> None:
    assert iamaudit.denied(iamaudit.load_policy(), GPUFORGE_CALLS) == []


OUT_OF_SCOPE = [
    # A p5 "builder": only the builder families may be launched.
    {
        "action": "RunInstances",
        "region": "us-east-1",
        "request_tags": {"instance": BUILD, "volume": BUILD},
        "params": {"InstanceType": "p5.48xlarge"},
    },
    # A builder without the build id on it, or on its volumes.
    {"action": "RunInstances", "region": "us-east-1", "params": {"InstanceType": "g5.2xlarge"}},
    {
        "action": "RunInstances",
        "region": "us-east-1",
        "request_tags": {"instance": BUILD},
        "params": {"InstanceType": "g5.2xlarge"},
    },
    # Images and snapshots a bake did not make.
    {
        "action": "DeregisterImage",
        "region": "us-east-1",
        "resources": {"ami-0fee1d00000000001": {"Name": "other"}},
    },
    {"action": "ModifyImageAttribute", "region": "us-east-1", "resources": {"ami-0fee1d00000000001": {}}},
    {"action": "DeleteSnapshot", "region": "us-east-1", "resources": {"snap-0fee1d00000000001": {}}},
    # Tagging a foreign image into scope.
    {
        "action": "CreateTags",
        "region": "us-east-1",
        "resources": {"ami-0fee1d00000000001": {}},
        "request_tags": {"": {"gpuforge:build-id": "stolen"}},
    },
    # An instance Packer did not launch.
    {
        "action": "TerminateInstances",
        "region": "us-east-1",
        "resources": {"i-0fee1d00000000001": {"Name": "db"}},
    },
    {"action": "StopInstances", "region": "us-east-1", "resources": {"i-0fee1d00000000001": {}}},
    # An image registered without the build id.
    {"action": "CreateImage", "region": "us-east-1", "resources": {"i-0123456789abcdef0": BUILD}},
    # A security group Packer did not create.
    {"action": "DeleteSecurityGroup", "region": "us-east-1", "resources": {"sg-0fee1d00000000001": {}}},
]


@pytest.mark.parametrize("call", OUT_OF_SCOPE, ids=lambda c: f"{c['action']}-{OUT_OF_SCOPE.index(c)}")
def test_policy_denies_what_no_bake_needs(call: dict[str, Any]) -> None:
    assert iamaudit.denied(iamaudit.load_policy(), [call]) != []


def test_kms_grants_only_for_aws_resources_through_ec2() -> None:
    key = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"
    policy = iamaudit.load_policy()
    direct = iamaudit.Request("kms:CreateGrant", key, {"kms:ViaService": ["ec2.us-east-1.amazonaws.com"]})
    assert iamaudit.decide(policy, direct) == "ImplicitDeny"
    decrypt = iamaudit.Request("kms:Decrypt", key, {})
    assert iamaudit.decide(policy, decrypt) == "ImplicitDeny"


# --- Session Manager: how Packer reaches the builder (ssh_interface = "session_manager") -------------

SESSION_SCENARIO = PLUGIN_SEQUENCE["scenarios"]["success-session-manager"]["calls"]


def _one(action: str) -> dict[str, Any]:
    (call,) = [c for c in SESSION_SCENARIO if c["action"] == action]
    return dict(call)


def test_the_session_manager_bake_makes_the_tunnels_calls_in_order() -> None:
    """The plugin's SSM path: StartSession on the builder with AWS-StartPortForwardingSession after launch,
    TerminateSession once the builder stopped, and no SSH ingress rule (SkipSSHRuleCreation)."""
    actions = [c["action"] for c in SESSION_SCENARIO]
    assert "AuthorizeSecurityGroupIngress" not in actions
    assert actions.index("RunInstances") < actions.index("StartSession") < actions.index("StopInstances")
    assert actions.index("StopInstances") < actions.index("TerminateSession") < actions.index("CreateImage")
    assert _one("StartSession")["params"]["DocumentName"] == "AWS-StartPortForwardingSession"


def test_session_manager_grants_are_what_the_tunnel_needs() -> None:
    requests = [r for call in SESSION_SCENARIO for r in iamaudit.requests_for(call)]
    resources: dict[str, set[str]] = {r.action: set() for r in requests}
    for request in requests:
        resources[request.action].add(request.resource)
    assert resources["ssm:StartSession"] == {
        "arn:aws:ec2:us-east-1:123456789012:instance/i-0b1de5c0ffee00001",
        "arn:aws:ssm:us-east-1::document/AWS-StartPortForwardingSession",
    }
    assert resources["ssm:TerminateSession"] == {
        "arn:aws:ssm:us-east-1:123456789012:session/gpuforge-bake-0b1de5c0ffee00009"
    }


SESSION_OUT_OF_SCOPE = {
    # A session to an instance no bake launched (no build id on it).
    "start-on-untagged-instance": {
        **_one("StartSession"),
        "resources": {"i-0fee1d00000000001": {"Name": "db"}},
    },
    # A shell (or any other document) instead of port forwarding to the builder.
    "start-with-another-document": {
        **_one("StartSession"),
        "params": {"DocumentName": "AWS-StartInteractiveCommand", "Target": "i-0b1de5c0ffee00001"},
    },
    # Ending a session another principal started.
    "terminate-someone-elses-session": {
        **_one("TerminateSession"),
        "resources": {
            "alice-0fee1d00000000001": {
                "aws:ssmmessages:session-id": "AROA0SOMEBODY0ELSE0000:alice",
                "aws:ssmmessages:target-id": "i-0fee1d00000000001",
            }
        },
    },
    # A session without the system tag (the condition key is missing: no match).
    "terminate-untagged-session": {**_one("TerminateSession"), "resources": {"x-0fee1d00000000001": {}}},
}


@pytest.mark.parametrize("name", sorted(SESSION_OUT_OF_SCOPE))
def test_policy_denies_sessions_no_bake_needs(name: str) -> None:
    assert iamaudit.denied(iamaudit.load_policy(), [SESSION_OUT_OF_SCOPE[name]]) != []


def test_policy_variables_are_substituted_from_the_request() -> None:
    context = {"aws:userid": ["AROA1:me"]}
    assert iamaudit.substitute("${aws:userid}", context) == "AROA1:me"
    assert iamaudit.substitute("session/${aws:userid}-*", context) == "session/AROA1:me-*"
    assert iamaudit.substitute("${aws:username}", context) is None


# --- the canary nodes' role: passed only to EC2, only gpuforge-canary* ------------------------------

CANARY_TAG = {"gpuforge:canary": "canary-20261206"}


def _canary_launch(profile: str) -> dict[str, Any]:
    return {
        "action": "RunInstances",
        "region": "us-east-1",
        "params": {"InstanceType": "p5.48xlarge", "IamInstanceProfile.Name": profile},
        "request_tags": {"instance": CANARY_TAG, "volume": CANARY_TAG},
        "resources": {"ami-0123456789abcdef0": IMAGE, "subnet-0b1de5c0ffee00007": {}},
    }


def test_policy_lets_the_canary_pass_its_node_role_to_ec2_only() -> None:
    policy = iamaudit.load_policy()
    assert iamaudit.denied(policy, [_canary_launch("gpuforge-canary-us-east-1")]) == []
    assert iamaudit.denied(policy, [_canary_launch("admin")]) != []
    role = f"arn:aws:iam::{iamaudit.ACCOUNT}:role/gpuforge-canary-us-east-1"
    to_lambda = iamaudit.Request("iam:PassRole", role, {"iam:PassedToService": ["lambda.amazonaws.com"]})
    assert iamaudit.decide(policy, to_lambda) == "ImplicitDeny"


def test_pipeline_role_creates_the_canary_nodes_role_the_canary_policy_passes(
    aws: MotoServer, tmp_path: Path
) -> None:
    """The canary's profile: SSM core and s3:PutObject under the results prefix, named so that the canary
    policy's PassRole (gpuforge-canary*) covers it; deployed on moto with the results bucket given."""
    result = subprocess.run(
        [sys.executable, "-m", "gpuforge.cli", "pipeline-role"], capture_output=True, text=True, check=True
    )
    cfn = boto3.client("cloudformation")
    cfn.create_stack(
        StackName="gpuforge-canary-role",
        TemplateBody=result.stdout,
        Capabilities=["CAPABILITY_NAMED_IAM"],
        Parameters=[{"ParameterKey": "CanaryResultsBucket", "ParameterValue": "acme-canary"}],
    )
    iam_client = boto3.client("iam")
    profile = iam_client.get_instance_profile(InstanceProfileName="gpuforge-canary-us-east-1")[
        "InstanceProfile"
    ]
    (role,) = profile["Roles"]
    assert role["RoleName"] == "gpuforge-canary-us-east-1"
    assert iam_client.list_role_policies(RoleName=role["RoleName"])["PolicyNames"] == ["canary-results"]
    # moto's CloudFormation neither attaches AWS managed policies nor returns inline documents as JSON, so
    # the template says what the role holds.
    node_role = json.loads(result.stdout)["Resources"]["CanaryNodeRole"]["Properties"]
    assert node_role["ManagedPolicyArns"] == [
        {"Fn::Sub": "arn:${AWS::Partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"}
    ]
    (results,) = node_role["Policies"][0]["PolicyDocument"]["Statement"]
    assert results["Action"] == ["s3:PutObject"]
    assert results["Resource"] == {
        "Fn::Sub": "arn:${AWS::Partition}:s3:::${CanaryResultsBucket}/gpuforge-canary/*"
    }
    # The role the profile holds is one the canary policy lets the pipeline role pass to EC2.
    passed = iamaudit.Request(
        "iam:PassRole",
        f"arn:aws:iam::{iamaudit.ACCOUNT}:role/{role['RoleName']}",
        {"iam:PassedToService": ["ec2.amazonaws.com"]},
    )
    assert iamaudit.decide(iamaudit.load_policy(), passed) == "Allow"


def test_no_action_is_granted_twice_on_every_resource() -> None:
    """An action allowed on "*" without a condition in two statements: dropping it from one (narrowing
    what Packer or gpuforge needs) would silently change nothing. Packer's Describe calls that gpuforge
    makes too (DescribeRegions, DescribeSnapshots) are granted once, in gpuforge's statement."""
    seen: dict[str, str] = {}
    twice: list[str] = []
    for statement in iamaudit.load_policy()["Statement"]:
        if statement["Effect"] != "Allow" or statement["Resource"] != "*" or "Condition" in statement:
            continue
        for action in statement["Action"]:
            if action in seen:
                twice.append(f"{action}: {seen[action]} and {statement['Sid']}")
            seen[action] = statement["Sid"]
    assert not twice
