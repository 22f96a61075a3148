"""Docs state each fact once (issue 30, part 3).

A role variable is described in its meta/argument_specs.yml (the generated role README shows it);
defaults/main.yml keeps the value and at most a short comment saying why the value is what it is.
The README opens with gpuforge on AWS and its production commands, the lab has a page of its own,
and docs/performance.md holds current figures, each under the command that prints it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from gpuforge import cli

REPO = Path(__file__).resolve().parents[1]
ROLES = sorted(p.parent.parent for p in REPO.glob("roles/*/defaults/main.yml"))
README = (REPO / "README.md").read_text()
PERFORMANCE = (REPO / "docs" / "performance.md").read_text()

# A why is one or two short lines; a longer block is a description, which belongs in the spec.
MAX_COMMENT_BLOCK = 2
MAX_COMMENT_SHARE = 0.2


def comment_blocks(text: str) -> list[int]:
    """Lengths of the runs of consecutive comment lines."""
    blocks, run = [], 0
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            run += 1
        elif run:
            blocks.append(run)
            run = 0
    return blocks + ([run] if run else [])


def spec_options(role: Path) -> dict[str, dict[str, object]]:
    specs = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    options: dict[str, dict[str, object]] = {}
    for entry in specs.values():
        options.update(entry.get("options") or {})
    return options


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_defaults_keep_values_and_at_most_a_short_why(role: Path) -> None:
    text = (role / "defaults" / "main.yml").read_text()
    lines = text.splitlines()
    comments = sum(1 for line in lines if line.lstrip().startswith("#"))
    assert comments / len(lines) <= MAX_COMMENT_SHARE, f"{comments} of {len(lines)} lines are comments"
    assert max(comment_blocks(text), default=0) <= MAX_COMMENT_BLOCK


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_every_default_is_described_in_the_argument_spec(role: Path) -> None:
    defaults = yaml.safe_load((role / "defaults" / "main.yml").read_text()) or {}
    options = spec_options(role)
    undescribed = [
        name for name in defaults if not str(options.get(name, {}).get("description") or "").strip()
    ]
    assert not undescribed


# A comment with half its words in the variable's description says it again: the spec is the one place.
MAX_SHARED_WORDS = 0.5


def words(text: str) -> set[str]:
    """The words of `text` longer than three characters, lower-cased (paths and versions stay whole)."""
    return {w for w in re.findall(r"[a-z0-9][a-z0-9_.'/-]*[a-z0-9]", text.lower()) if len(w) > 3}


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_no_defaults_comment_restates_the_description(role: Path) -> None:
    """A comment above a variable stays only for a why its argument_specs description does not give."""
    options = spec_options(role)
    restated, block = [], []
    for line in (role / "defaults" / "main.yml").read_text().splitlines():
        if line.lstrip().startswith("#"):
            block.append(line.lstrip("# "))
            continue
        variable = re.match(r"^(\w+):", line)
        if block and variable:
            said = words(" ".join(block))
            described = words(str(options.get(variable.group(1), {}).get("description") or ""))
            if len(said & described) >= MAX_SHARED_WORDS * len(said):
                restated.append(variable.group(1))
        block = []
    assert restated == []


def sh_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, re.DOTALL)


def command_lines(block: str) -> list[str]:
    """Each command of a sh block, continuation lines joined and trailing comments dropped."""
    joined = block.replace("\\\n", " ")
    return [shlex.join(shlex.split(line, comments=True)) for line in joined.splitlines() if line.strip()]


def test_the_readme_starts_with_make_demo_and_make_test() -> None:
    first = sh_blocks(README)[0]
    assert [line.split()[:2] for line in command_lines(first)] == [["make", "demo"], ["make", "test"]]
    assert README.index("```sh") < README.index("\n## ")


def test_the_readme_opens_with_aws_and_leaves_the_lab_to_its_page() -> None:
    headings = re.findall(r"^## (.+)$", README, re.MULTILINE)
    assert headings[:2] == ["What gpuforge does on AWS", "Production commands"]
    assert "](docs/lab.md)" in README
    assert "gpuforge lab" not in README and "gpuforge-lab" not in README
    lab = (REPO / "docs" / "lab.md").read_text()
    assert "After `make demo` the lab stays up" in lab


def test_the_setup_commands_and_what_they_do_are_stated_once() -> None:
    """make demo and make test are shown in the README only; what they install, what the lab is and
    how make test runs are said on the lab page only."""
    setup = re.compile(r"^\s*make (demo|test)\b", re.MULTILINE)
    for page in sorted((REPO / "docs").glob("*.md")):
        assert not [block for block in sh_blocks(page.read_text()) if setup.search(block)], page.name
    lab = (REPO / "docs" / "lab.md").read_text()
    for fact in ("requirements/constraints.txt", "moto as EC2", "scripts/ci/testrun.py"):
        assert fact in lab and fact not in README, fact


PRODUCTION = (
    "pip install",
    "ansible-galaxy collection install",
    "ansible-playbook -i inventory/ec2_fleet.yml site.yml",
    "gpuforge rebuild",
    "gpuforge canary",
    "gpuforge promote",
    "gpuforge cluster-config generate",
    "gpuforge roll",
    "gpuforge fleet apply --via ssm",
    "ansible-playbook playbooks/health.yml",
    "ansible-playbook playbooks/drift.yml",
    "gpuforge nccl-report",
)


def test_the_readme_shows_the_production_commands() -> None:
    commands = [line for block in sh_blocks(README) for line in command_lines(block)]
    for prefix in PRODUCTION:
        assert any(line.startswith(prefix) for line in commands), prefix
    assert "gpuforge-node apply" in README


def readme_commands(program: str) -> list[list[str]]:
    return [
        shlex.split(line)
        for block in sh_blocks(README)
        for line in command_lines(block)
        if shlex.split(line)[0] == program
    ]


@pytest.mark.parametrize("argv", readme_commands("gpuforge"), ids=lambda a: " ".join(a[:3]))
def test_readme_gpuforge_commands_parse(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each `gpuforge` line of the README is a valid command line as written (parsed, not run), in a folder
    with the files the commands read: the checkout's examples, what an earlier line writes (cluster.yaml)
    and the user's own (a job log). Input files are checked at parse time."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    for arg in argv[1:]:
        if arg.endswith((".yaml", ".yml", ".log")) and not (REPO / arg).exists():
            (tmp_path / arg).touch()
    monkeypatch.chdir(tmp_path)
    args = cli.build_parser().parse_args(argv[1:])
    assert callable(args.handler)


@pytest.mark.parametrize("argv", readme_commands("ansible-playbook"), ids=lambda a: " ".join(a[1:4]))
def test_readme_playbooks_and_inventories_exist(argv: list[str]) -> None:
    paths = [a for a in argv[1:] if a.endswith((".yml", ".yaml"))]
    assert paths and all((REPO / p).is_file() for p in paths), paths


def test_readme_files_named_by_its_commands_exist() -> None:
    for argv in readme_commands("gpuforge"):
        if argv[1:3] == ["cluster-config", "generate"]:
            assert (REPO / argv[3]).is_file()


def test_performance_states_current_figures_each_under_its_command() -> None:
    sections = re.split(r"^#+ ", PERFORMANCE, flags=re.MULTILINE)[1:]
    for section in sections:
        title = section.splitlines()[0]
        tables = [m.start() for m in re.finditer(r"^\| .* \|\n\| [-| ]+\|$", section, re.MULTILINE)]
        if not tables:
            continue
        command = section.find("```sh\n")
        assert 0 <= command < tables[0], f"{title}: no command above its first table"
    for history in (
        r"\bat commit\b",
        r"\bcommit `[0-9a-f]{7}`",
        r"\bbefore `[0-9a-f]{7}`",
        r"-> ",
        r"\bwas [0-9.,]+ s\b",
    ):
        assert not re.search(history, PERFORMANCE), history
