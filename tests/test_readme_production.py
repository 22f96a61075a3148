"""README's production commands, pasted as they are, in order, against moto (credentials set,
AWS_ENDPOINT_URL at a moto_server), in a clone of the checkout (roll publishes its HEAD).

Two lines need what moto cannot be: `gpuforge rebuild` bakes on EC2 with Packer and `gpuforge canary`
boots GPU nodes. In their place the test leaves what they would: an image baked by `gpuforge bake` with
the test's fake Packer (tests/test_ami_bake.py) and published as the pcluster candidate, carrying the
verdict a passed canary records. `pcluster` is a stand-in that records its argv (tests/test_pcluster_roll.py):
the cluster runs on no real ParallelCluster here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import boto3
import pytest

from gpuforge import cli
from gpuforge_lab.moto import MotoServer
from test_ami_bake import _install_fake_packer, _register_base
from test_pcluster_roll import _fake_pcluster

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
STOOD_IN = ("gpuforge rebuild ", "gpuforge canary ")


def production_commands() -> list[str]:
    """Every gpuforge line of the README's production section, in order."""
    section = README[README.index("## Production commands") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    return [line for block in blocks for line in block.splitlines() if line.startswith("gpuforge ")]


def test_the_section_has_the_chain_this_test_runs() -> None:
    commands = production_commands()
    starts = [" ".join(c.split()[:2]) for c in commands]
    assert starts[:5] == [
        "gpuforge cluster-config",
        "gpuforge rebuild",
        "gpuforge canary",
        "gpuforge promote",
        "gpuforge roll",
    ]


def _run(line: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-e", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=300
    )


@pytest.mark.slow
def test_the_production_commands_run_in_order_on_the_readmes_example(
    aws: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkout = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{REPO}", str(checkout)], check=True)
    # What the spec names and the account has before the README starts: its bootstrap bucket.
    boto3.client("s3").create_bucket(Bucket="my-gpuforge-bucket")
    record = _fake_pcluster(
        tmp_path / "pcluster-bin", 0, {"cluster": {"clusterStatus": "UPDATE_IN_PROGRESS"}}
    )
    venv_bin = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin"
    env = {
        "PATH": f"{tmp_path / 'pcluster-bin'}:{venv_bin}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),
        **aws.env(),
    }
    for line in production_commands():
        if line.startswith(STOOD_IN):
            if line.startswith("gpuforge rebuild "):
                _install_fake_packer(tmp_path, monkeypatch)
                _register_base("aws-parallelcluster-3.16.1-ubuntu-2204-lts-hvm-x86_64-202611010000")
                argv = [*shlex.split(line)[1:], "--base-owner", "self", "--work-dir", str(tmp_path / "w")]
                assert cli.main(argv) == 0
            else:
                ami = boto3.client("ssm").get_parameter(Name="/gpuforge/ami/pcluster/ubuntu2204/candidate")
                boto3.client("ec2").create_tags(
                    Resources=[ami["Parameter"]["Value"]],
                    Tags=[{"Key": "gpuforge:canary", "Value": "passed"}],
                )
            continue
        if line.startswith("gpuforge fleet apply") or line.startswith(
            ("gpuforge preflight", "gpuforge nccl-")
        ):
            break  # Slurm, SSM agents and GPU nodes: beyond moto (docs/fleet-ssm.md tests those in the lab).
        result = _run(line, checkout, env)
        assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
    argv = json.loads(record.read_text())
    assert argv[:3] == ["update-cluster", "--cluster-name", "mycluster"]
    config = (checkout / "cluster.yaml").read_text()
    latest = boto3.client("ssm").get_parameter(Name="/gpuforge/ami/pcluster/ubuntu2204/latest")
    assert latest["Parameter"]["Value"] in config
    assert "--revision" in config


def test_the_mitogen_row_claims_speed_only_as_measured() -> None:
    """A review's rerun under mitogen was slower than linear (issue 34, R11): the README says where it was
    measured faster and that it is not always."""
    (row,) = [line for line in README.splitlines() if "mitogen_linear ansible-playbook" in line]
    assert "faster (opt-in mitogen)" not in row
    assert "docs/performance.md" in row and "not on every run" in row
    performance = (REPO / "docs" / "performance.md").read_text()
    assert re.search(r"^\| \d+ \| mitogen \|", performance, re.M)
