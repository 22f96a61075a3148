"""`gpuforge roll` through gpuforge.cli.main: a revision or an image rolled through ParallelCluster.

The verdict comes from the installed aws-parallelcluster's own ConfigPatch (gpuforge.pcluster.update);
S3 and EC2 are moto_server (the test double); `pcluster update-cluster` is a stand-in script on PATH
that records its argv (a test double: the real one needs a deployed cluster).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml

from gpuforge import cli
from gpuforge.pcluster import update
from gpuforge.pcluster.config import dump_config, load_config, load_yaml_mapping
from gpuforge.pcluster.generate import generate
from gpuforge_lab.moto import MotoServer
from imagetools import baked_image

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BUCKET = "my-gpuforge-bucket"  # the examples' revision bucket, listed in every queue's Iam.S3Access


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Build the CLI with just roll, so other modules' state cannot break these tests."""
    assert "gpuforge.commands.roll" in cli._COMMAND_MODULES
    monkeypatch.setattr(cli, "_COMMAND_MODULES", ("gpuforge.commands.roll",))


def _generate(example: str, path: Path, drop_strategy: bool = False) -> Path:
    config = generate(load_yaml_mapping(EXAMPLES / example, "cluster spec"), None)
    if drop_strategy:
        del config["Scheduling"]["SlurmSettings"]["QueueUpdateStrategy"]
    dump_config(config, path)
    return path


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    """cluster-spec.yml's config (queues gpu and cpu run gpuforge-node), without a QueueUpdateStrategy."""
    return _generate("cluster-spec.yml", tmp_path / "cluster.yml", drop_strategy=True)


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, str]:
    """A small git repository with one commit (the revision to publish)."""
    root = tmp_path / "repo"
    (root / "playbooks").mkdir(parents=True)
    (root / "playbooks/fleet.yml").write_text("---\n- hosts: all\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@e"
    for command in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "one"]):
        subprocess.run(["git", "-C", str(root), *command], check=True, env=env)
    head = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    )
    return root, head.stdout.strip()


@pytest.fixture
def s3(aws: MotoServer) -> Any:
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


def _queue(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(q for q in config["Scheduling"]["SlurmQueues"] if q["Name"] == name)


def _revision_args(repo: tuple[Path, str], *extra: str, bucket: str | None = BUCKET) -> list[str]:
    """roll --revision HEAD of the test repository, with --bucket unless bucket is None."""
    root, _ = repo
    named = [] if bucket is None else ["--bucket", bucket]
    return ["roll", "--revision", "HEAD", "--repo", str(root), *named, *extra]


def test_revision_roll_publishes_and_patches_the_queues_args_and_strategy(
    config_file: Path, repo: tuple[Path, str], s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every gpuforge-node queue gets --revision/--sha256/--bucket of the object just uploaded, DRAIN is
    written, the head node's OnNodeConfigured is untouched, and ParallelCluster's verdict is printed."""
    _, commit = repo
    out = tmp_path / "rolled.yml"
    before = config_file.read_text()
    argv = _revision_args(repo, "--cluster-config", str(config_file), "--out", str(out))
    assert cli.main(argv) == 0

    key = f"gpuforge/revisions/gpuforge-{commit}.tar.gz"
    body = s3.get_object(Bucket=BUCKET, Key=key)
    digest = hashlib.sha256(body["Body"].read()).hexdigest()
    assert body["Metadata"]["sha256"] == digest
    rolled, original = load_config(out), load_config(config_file)
    for name in ("gpu", "cpu"):
        args = _queue(rolled, name)["CustomActions"]["OnNodeConfigured"]["Args"]
        assert args == [
            *("--node-type", "Compute", "--queue", name),
            *("--revision", commit, "--sha256", digest, "--bucket", BUCKET),
        ]
        assert args[:4] == _queue(original, name)["CustomActions"]["OnNodeConfigured"]["Args"]
    assert rolled["Scheduling"]["SlurmSettings"]["QueueUpdateStrategy"] == "DRAIN"
    assert rolled["HeadNode"] == original["HeadNode"]
    assert config_file.read_text() == before, "--out leaves the config as it was"

    printed = capsys.readouterr().out
    assert (
        "pcluster update-cluster accepts this change (compute fleet running, QueueUpdateStrategy DRAIN)"
        in printed
    )
    assert "Scheduling.SlurmQueues[gpu].CustomActions.OnNodeConfigured.Args" in printed
    assert "[QUEUE_UPDATE_STRATEGY: SUCCEEDED]" in printed
    assert "(no job is killed)" in printed
    assert (
        f"run: pcluster update-cluster --cluster-name CLUSTER_NAME --cluster-configuration {out}" in printed
    )


def test_revision_roll_replaces_an_earlier_revision_of_one_queue(
    repo: tuple[Path, str], s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A queue already on a revision gets the new one in its place (bucket from its Args), TERMINATE is
    written when asked, the other queue keeps its Args."""
    _, commit = repo
    config = _generate("p5-capacity-block.yml", tmp_path / "p5.yml")
    old = _queue(load_config(config), "train")["CustomActions"]["OnNodeConfigured"]["Args"]
    assert "--revision" in old
    argv = _revision_args(repo, "--cluster-config", str(config), "--queue", "train", bucket=None)
    assert cli.main([*argv, "--queue-update-strategy", "TERMINATE", "--out", str(tmp_path / "o.yml")]) == 0
    rolled, original = load_config(tmp_path / "o.yml"), load_config(config)
    args = _queue(rolled, "train")["CustomActions"]["OnNodeConfigured"]["Args"]
    assert args[:4] == ["--node-type", "Compute", "--queue", "train"]
    assert args[4:6] == ["--revision", commit] and args.count("--revision") == 1
    assert args[-2:] == ["--bucket", BUCKET]
    assert _queue(rolled, "spot") == _queue(original, "spot")
    assert rolled["Scheduling"]["SlurmSettings"]["QueueUpdateStrategy"] == "TERMINATE"
    assert "running jobs are killed and requeued" in capsys.readouterr().out


def test_head_node_rolls_through_on_node_updated_only(
    repo: tuple[Path, str], s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--head-node moves the head node's OnNodeUpdated action (SUPPORTED), never its OnNodeConfigured,
    which ParallelCluster refuses to change on a running cluster (UNSUPPORTED)."""
    _, commit = repo
    config = _generate("p5-capacity-block.yml", tmp_path / "p5.yml")
    out = tmp_path / "o.yml"
    assert (
        cli.main([*_revision_args(repo, "--cluster-config", str(config)), "--head-node", "--out", str(out)])
        == 0
    )
    rolled, original = load_config(out), load_config(config)
    actions = rolled["HeadNode"]["CustomActions"]
    assert actions["OnNodeUpdated"]["Args"][:4] == ["--node-type", "HeadNode", "--revision", commit]
    assert actions["OnNodeConfigured"] == original["HeadNode"]["CustomActions"]["OnNodeConfigured"]
    assert "HeadNode.CustomActions.OnNodeUpdated.Args" in capsys.readouterr().out

    # Why roll leaves OnNodeConfigured alone: ParallelCluster's own verdict on changing it.
    changed = load_config(out)
    changed["HeadNode"]["CustomActions"]["OnNodeConfigured"]["Args"] = actions["OnNodeUpdated"]["Args"]
    plan = update.plan(original, changed)
    assert not plan.accepted
    refused = [c for c in plan.changes if not c.accepted]
    assert [(c.path, c.policy) for c in refused] == [
        ("HeadNode.CustomActions.OnNodeConfigured.Args", "UNSUPPORTED")
    ]


def test_ami_roll_patches_the_queue_image(
    config_file: Path, aws: MotoServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--ami gives the named queue Image.CustomAmi (the cluster-wide image stays), with DRAIN."""
    ami = baked_image("pcluster")
    out = tmp_path / "rolled.yml"
    argv = ["roll", "--cluster-config", str(config_file), "--ami", ami, "--queue", "gpu", "--out", str(out)]
    assert cli.main(argv) == 0
    rolled, original = load_config(out), load_config(config_file)
    assert _queue(rolled, "gpu")["Image"]["CustomAmi"] == ami
    assert "Image" not in _queue(rolled, "cpu")
    assert rolled["Image"] == original["Image"]
    assert rolled["Scheduling"]["SlurmSettings"]["QueueUpdateStrategy"] == "DRAIN"
    printed = capsys.readouterr().out
    assert "pcluster update-cluster accepts this change" in printed
    # The queue had no Image section: ConfigPatch reports the section added.
    assert (
        f"Scheduling.SlurmQueues[gpu].Image: - -> {{'CustomAmi': '{ami}'}} [QUEUE_UPDATE_STRATEGY: SUCCEEDED]"
        in printed
    )


def test_a_change_parallelcluster_refuses_is_refused_before_anything_happens(
    config_file: Path,
    repo: tuple[Path, str],
    tmp_path: Path,
    no_aws: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Judged against the deployed config, the file's pending cluster-wide image change is UNSUPPORTED:
    exit 2 with ParallelCluster's reason; nothing uploaded (no AWS call at all), written or run."""
    deployed = load_config(config_file)
    deployed["Image"]["CustomAmi"] = "ami-0fedcba9876543210"
    deployed_file = tmp_path / "deployed.yml"
    deployed_file.write_text(yaml.safe_dump(deployed))
    before = config_file.read_text()
    argv = _revision_args(repo, "--cluster-config", str(config_file), "--deployed-config", str(deployed_file))
    assert cli.main([*argv, "--cluster-name", "c1", "--apply"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpuforge: error: cluster config ")
    assert "pcluster update-cluster refuses this change" in err
    assert "Image.CustomAmi: ami-0fedcba9876543210 -> ami-0123456789abcdef0 [UNSUPPORTED: FAILED]" in err
    assert config_file.read_text() == before
    assert list(tmp_path.glob("*.bak")) == []


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (["--queue", "nope"], "unknown queue(s) nope; the config's Slurm queues are: gpu, cpu"),
        (["--head-node"], "--head-node: the head node has no OnNodeUpdated action running gpuforge-node"),
        (["--bucket", "other-bucket"], "queue gpu: Iam.S3Access does not list bucket other-bucket"),
        (["--apply"], "--apply needs --cluster-name"),
    ],
)
def test_bad_requests_exit_2_without_aws(
    config_file: Path,
    repo: tuple[Path, str],
    no_aws: list[str],
    extra: list[str],
    reason: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main([*_revision_args(repo, "--cluster-config", str(config_file)), *extra]) == 2
    assert reason in capsys.readouterr().err


def test_a_revision_without_a_bucket_anywhere_asks_for_one(
    config_file: Path, repo: tuple[Path, str], no_aws: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The queues run the image's revision (`gpuforge_node: true`): no bucket to reuse, so --bucket."""
    assert cli.main(_revision_args(repo, "--cluster-config", str(config_file), bucket=None)) == 2
    err = capsys.readouterr().err
    assert "give --bucket BUCKET: an S3 bucket the cluster's nodes can read" in err
    assert "actions name none" in err


def test_queue_without_gpuforge_node_is_refused(
    config_file: Path, repo: tuple[Path, str], no_aws: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    config = load_config(config_file)
    del _queue(config, "cpu")["CustomActions"]
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    assert cli.main([*_revision_args(repo, "--cluster-config", str(config_file)), "--queue", "cpu"]) == 2
    assert "queue cpu: its OnNodeConfigured does not run gpuforge-node" in capsys.readouterr().err


def _fake_pcluster(bin_dir: Path, rc: int, answer: dict[str, Any]) -> Path:
    """A stand-in `pcluster` (test double) that records its argv as JSON and prints answer."""
    bin_dir.mkdir()
    record = bin_dir / "argv.json"
    script = bin_dir / "pcluster"
    script.write_text(
        "#!/usr/bin/env python3\nimport json, sys\n"
        f"open({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
        f"print({json.dumps(answer)!r})\nsys.exit({rc})\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return record


def test_apply_runs_pcluster_update_cluster_in_place_with_a_backup(
    config_file: Path,
    repo: tuple[Path, str],
    s3: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--apply runs the printed command with the rewritten config; the original is kept as a backup."""
    record = _fake_pcluster(tmp_path / "bin", 0, {"cluster": {"clusterStatus": "UPDATE_IN_PROGRESS"}})
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    before = config_file.read_text()
    argv = _revision_args(repo, "--cluster-config", str(config_file), "--cluster-name", "train-1", "--apply")
    assert cli.main(argv) == 0
    expected = ["update-cluster", "--cluster-name", "train-1", "--cluster-configuration", str(config_file)]
    assert json.loads(record.read_text()) == [*expected, "--region", "us-east-1"]
    (backup,) = tmp_path.glob("cluster.yml.*.bak")
    assert backup.read_text() == before
    assert "--revision" in str(_queue(load_config(config_file), "gpu")["CustomActions"])
    assert "UPDATE_IN_PROGRESS" in capsys.readouterr().out


def test_apply_reports_pcluster_failure_in_one_line(
    config_file: Path,
    repo: tuple[Path, str],
    s3: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _fake_pcluster(tmp_path / "bin", 1, {"message": "Cluster train-1 does not exist"})
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    argv = _revision_args(repo, "--cluster-config", str(config_file), "--cluster-name", "train-1", "--apply")
    assert cli.main([*argv, "--out", str(tmp_path / "o.yml")]) == 1
    err = capsys.readouterr().err
    assert err.endswith(
        "\ngpuforge: error: pcluster update-cluster failed (exit 1): Cluster train-1 does not exist\n"
    )
    assert "Traceback" not in err


def test_apply_without_pcluster_says_how_to_get_it(
    config_file: Path,
    repo: tuple[Path, str],
    s3: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A PATH with git (the revision is archived with it) and no pcluster, nor one beside "this Python".
    only_git = tmp_path / "only-git"
    only_git.mkdir()
    (only_git / "git").symlink_to(str(shutil.which("git")))
    monkeypatch.setenv("PATH", str(only_git))
    monkeypatch.setattr(sys, "executable", str(only_git / "python"))
    argv = _revision_args(repo, "--cluster-config", str(config_file), "--cluster-name", "train-1", "--apply")
    assert cli.main([*argv, "--out", str(tmp_path / "o.yml")]) == 2
    assert "pcluster not found on PATH or in gpuforge's virtualenv" in capsys.readouterr().err
