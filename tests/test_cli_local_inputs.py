"""Every command checks the files it reads before anything else: a missing one is exit 2 naming it, with no
AWS call (`promote --cluster-config /nonexistent.yaml` spent 30 s of retries first; issue 34, R11)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuforge import cli
from gpuforge.cliargs import existing_file

MISSING = "/nonexistent/gpuforge-input.yaml"
# Path arguments that are written, or are folders or a checkout: no file to read.
NOT_READ = {"out", "output", "work_dir", "repo", "cache_dir", "results_dir", "run_dir"}
# Checked by the handler before any AWS call instead (prune --allow-missing goes on without a gone config).
IN_HANDLER = {("prune", "cluster_config")}


def _subcommands(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, (*prefix, name))


def test_every_path_a_command_reads_is_checked_at_parse_time() -> None:
    unchecked = [
        f"{' '.join(words)} {action.option_strings or action.dest}"
        for words, parser in _subcommands(cli.build_parser())
        for action in parser._actions
        if action.type is Path
        and action.dest not in NOT_READ
        and words[:1]
        and (words[0], action.dest) not in IN_HANDLER
    ]
    assert unchecked == []


COMMANDS = [
    ["promote", "--flavor", "pcluster", "--cluster-config", MISSING],
    ["roll", "--cluster-config", MISSING, "--revision", "HEAD", "--bucket", "b"],
    ["roll", "--cluster-config", __file__, "--ami", "ami-0123456789abcdef0", "--deployed-config", MISSING],
    ["cluster-config", "generate", MISSING, "-o", "/tmp/x.yaml"],
    ["cluster-config", "validate", MISSING],
    ["bake", "--extra-vars", MISSING],
    ["nccl-report", MISSING, "--instance-type", "p5.48xlarge", "--out", "/tmp/r"],
    ["nccl-report", __file__, "--instance-type", "p5.48xlarge", "--out", "/tmp/r", "--baseline", MISSING],
    ["accept", "--instance-type", "p5.48xlarge", "--baseline", MISSING],
]


def _command_id(argv: list[str]) -> str:
    """The command and its first argument, this file by its name: test ids must not depend on the clone."""
    return " ".join(Path(a).name if a == __file__ else a for a in argv[:2])


@pytest.mark.parametrize("argv", COMMANDS, ids=_command_id)
def test_a_missing_input_file_is_refused_before_any_aws_call(
    argv: list[str], no_aws: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert f"{MISSING} does not exist" in capsys.readouterr().err
    assert no_aws == []


def test_prune_refuses_a_missing_config_before_aws_unless_allowed(
    no_aws: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["prune", "--flavor", "dlami", "--cluster-config", MISSING]) == 2
    assert f"cluster config {MISSING} does not exist" in capsys.readouterr().err
    assert no_aws == []


def test_a_folder_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="is not a file"):
        existing_file(str(tmp_path))


SPEC = Path(__file__).resolve().parents[1] / "examples" / "cluster-spec.yml"


@pytest.mark.parametrize(
    "argv",
    [
        ["roll", "--cluster-config", str(SPEC), "--revision", "HEAD", "--bucket", "b"],
        ["roll", "--cluster-config", str(SPEC), "--ami", "ami-0123456789abcdef0"],
        ["cluster-config", "validate", str(SPEC)],
        ["promote", "--flavor", "pcluster", "--cluster-config", str(SPEC)],
    ],
    ids=_command_id,
)
def test_a_cluster_spec_given_for_a_config_is_named_as_one(
    argv: list[str], no_aws: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Not "no queue runs gpuforge-node": the file is a spec, and generate writes the config from it."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{SPEC} is a cluster spec" in err
    assert f"gpuforge cluster-config generate {SPEC} -o cluster.yaml" in err
    assert no_aws == []
