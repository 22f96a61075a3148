"""`gpuforge cluster-config` through gpuforge.cli.main: exit codes 0 (ok) and 2 (bad input).

generate and validate make no AWS call; set-ami checks the image in moto (the test double for EC2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from clusterconfigs import COMMENTED
from gpuforge import cli
from gpuforge.pcluster.config import custom_amis, load_config
from gpuforge_lab.moto import MotoServer
from imagetools import baked_image

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cluster-spec.yml"


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Build the CLI with just this feature's commands, so other modules' state cannot break these tests."""
    assert "gpuforge.commands.cluster_config" in cli._COMMAND_MODULES
    monkeypatch.setattr(cli, "_COMMAND_MODULES", ("gpuforge.commands.cluster_config",))


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    out = tmp_path / "cluster.yml"
    assert cli.main(["cluster-config", "generate", str(EXAMPLE), "-o", str(out)]) == 0
    return out


def test_generate_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["cluster-config", "generate", str(EXAMPLE)]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["Image"]["CustomAmi"] == yaml.safe_load(EXAMPLE.read_text())["ami"]
    assert list(config)[:4] == ["Region", "Image", "HeadNode", "Scheduling"]


def test_generate_to_file_then_validate(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["cluster-config", "validate", str(config_file)]) == 0
    assert "valid" in capsys.readouterr().out


def test_generate_bad_spec_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["queues"][0]["compute_resources"][0]["min_count"] = 9
    path = tmp_path / "spec.yml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "never.yml"
    assert cli.main(["cluster-config", "generate", str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpuforge: error: cluster spec: queues[0].compute_resources[0].min_count:")
    assert not out.exists()


def test_missing_spec_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["cluster-config", "generate", str(tmp_path / "absent.yml")])
    assert exited.value.code == 2
    assert "absent.yml does not exist" in capsys.readouterr().err


def test_validate_schema_error_exits_2(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = load_config(config_file)
    del config["Scheduling"]
    config_file.write_text(yaml.safe_dump(config))
    assert cli.main(["cluster-config", "validate", str(config_file)]) == 2
    assert "Scheduling: Missing data for required field." in capsys.readouterr().err


@pytest.fixture
def pcluster_ami(aws: MotoServer) -> str:
    """A pcluster-flavor gpuforge image in moto, tagged as a bake tags it."""
    return baked_image("pcluster")


def test_set_ami_gives_every_queue_the_image(
    config_file: Path, tmp_path: Path, pcluster_ami: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """By default every Slurm queue gets the image, with DRAIN, and the plan says pcluster accepts it."""
    out = tmp_path / "patched.yml"
    assert (
        cli.main(["cluster-config", "set-ami", str(config_file), "--ami", pcluster_ami, "-o", str(out)]) == 0
    )
    patched = load_config(out)
    assert {q["Image"]["CustomAmi"] for q in patched["Scheduling"]["SlurmQueues"]} == {pcluster_ami}
    assert patched["Scheduling"]["SlurmSettings"]["QueueUpdateStrategy"] == "DRAIN"
    assert patched["Image"] == load_config(config_file)["Image"], "the cluster-wide image stays"
    err = capsys.readouterr().err
    assert "pcluster update-cluster accepts this change" in err
    assert "Scheduling.SlurmQueues[gpu].Image" in err and "QUEUE_UPDATE_STRATEGY: SUCCEEDED" in err


def test_set_ami_cluster_wide(
    config_file: Path, tmp_path: Path, pcluster_ami: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--cluster-wide writes Image.CustomAmi, and says pcluster update-cluster refuses it (UNSUPPORTED)."""
    out = tmp_path / "patched.yml"
    argv = ["cluster-config", "set-ami", str(config_file), "--ami", pcluster_ami, "--cluster-wide"]
    assert cli.main([*argv, "-o", str(out)]) == 0
    assert custom_amis(load_config(out)) == {pcluster_ami}
    assert load_config(config_file)["Image"]["CustomAmi"] != pcluster_ami, "the input file is untouched"
    err = capsys.readouterr().err
    assert "pcluster update-cluster refuses this change" in err
    assert "Image.CustomAmi" in err and "UNSUPPORTED: FAILED" in err


def test_set_ami_per_queue_to_stdout(
    config_file: Path, capsys: pytest.CaptureFixture[str], pcluster_ami: str
) -> None:
    assert (
        cli.main(["cluster-config", "set-ami", str(config_file), "--ami", pcluster_ami, "--queue", "gpu"])
        == 0
    )
    patched = yaml.safe_load(capsys.readouterr().out)
    queues = {q["Name"]: q for q in patched["Scheduling"]["SlurmQueues"]}
    assert queues["gpu"]["Image"] == {"CustomAmi": pcluster_ami}
    assert "Image" not in queues["cpu"]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (
            ["--ami", "ami-0aaaaaaaaaaaaaaaa", "--queue", "nope"],
            "unknown queue(s) nope; the config's Slurm queues are: gpu, cpu",
        ),
        (["--ami", "ami-bad"], "invalid AMI id 'ami-bad'"),
    ],
)
def test_set_ami_bad_input_exits_2(
    config_file: Path, capsys: pytest.CaptureFixture[str], extra: list[str], fragment: str
) -> None:
    assert cli.main(["cluster-config", "set-ami", str(config_file), *extra]) == 2
    assert fragment in capsys.readouterr().err


def test_set_ami_requires_ami(config_file: Path) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["cluster-config", "set-ami", str(config_file)])
    assert info.value.code == 2


def test_set_ami_refuses_a_dlami_image_unless_forced(
    config_file: Path, aws: MotoServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    dlami = baked_image("dlami")
    out = tmp_path / "out.yml"
    assert cli.main(["cluster-config", "set-ami", str(config_file), "--ami", dlami, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "ParallelCluster configs take only pcluster-flavor images, this is dlami" in err
    assert not out.exists()
    argv = ["cluster-config", "set-ami", str(config_file), "--ami", dlami, "-o", str(out), "--force"]
    assert cli.main(argv) == 0
    assert dlami in custom_amis(load_config(out))


def test_set_ami_refuses_an_image_that_does_not_exist(config_file: Path, aws: MotoServer) -> None:
    assert cli.main(["cluster-config", "set-ami", str(config_file), "--ami", "ami-0aaaaaaaaaaaaaaaa"]) == 2


def test_set_ami_keeps_comments_order_and_quoting(tmp_path: Path, pcluster_ami: str) -> None:
    text = COMMENTED
    config = tmp_path / "cluster.yml"
    config.write_text(text)
    out = tmp_path / "out.yml"
    argv = ["cluster-config", "set-ami", str(config), "--ami", pcluster_ami, "--cluster-wide", "-o", str(out)]
    assert cli.main(argv) == 0
    assert out.read_text() == text.replace("CustomAmi: ami-0123456789abcdef0", f"CustomAmi: {pcluster_ami}")
    # The default, per queue: the queue gets an Image, Scheduling gets SlurmSettings before SlurmQueues.
    assert cli.main(["cluster-config", "set-ami", str(config), "--ami", pcluster_ami, "-o", str(out)]) == 0
    expected = text.replace(
        "  Scheduler: slurm\n", "  Scheduler: slurm\n  SlurmSettings:\n    QueueUpdateStrategy: DRAIN\n"
    ).replace(
        '        SubnetIds: ["subnet-0123456789abcdef0"]\n',
        f'        SubnetIds: ["subnet-0123456789abcdef0"]\n      Image:\n        CustomAmi: {pcluster_ami}\n',
    )
    assert out.read_text() == expected
