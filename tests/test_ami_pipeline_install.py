"""The scheduled bake's setup, read from .github/workflows/ami-rebuild.yml and packer/buildspec.yml: what
they install (run for real in a new virtualenv), how long the AWS
session lasts, how the builder is reached."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuforge.ami import iam

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / ".github" / "workflows" / "ami-rebuild.yml"
BUILDSPEC = REPO / "packer" / "buildspec.yml"
PLUGIN_SCRIPT = REPO / "packer" / "scripts" / "install-session-manager-plugin.sh"
AWS_PLUGIN_KEY = "7959637124CE093AD501D47A2C4D4AFF6F6757EE"


def _job() -> dict[str, Any]:
    return dict(yaml.safe_load(WORKFLOW.read_text())["jobs"]["rebuild"])


def _step(name: str) -> dict[str, Any]:
    steps = [s for s in _job()["steps"] if s.get("name") == name]
    assert len(steps) == 1, f"no single step named {name!r} in {WORKFLOW}"
    return dict(steps[0])


def _step_using(action: str) -> dict[str, Any]:
    (step,) = [s for s in _job()["steps"] if str(s.get("uses", "")).startswith(action + "@")]
    return dict(step)


def _install_commands() -> list[str]:
    return [
        line for line in _step("Install gpuforge with the tested pins")["run"].splitlines() if line.strip()
    ]


def _buildspec_install() -> list[str]:
    return [str(c) for c in yaml.safe_load(BUILDSPEC.read_text())["phases"]["install"]["commands"]]


def test_workflow_and_buildspec_install_ansible_from_the_constraints() -> None:
    """`pip install -e .` alone leaves Ansible out (it is the `ansible` extra): both must ask for the extra
    with the constraints file, and install the same things."""
    for commands in (_install_commands(), _buildspec_install()):
        pip = [c for c in commands if "pip install" in c]
        assert len(pip) == 1, commands
        assert "-c requirements/constraints.txt" in pip[0]
        assert "'.[ansible]'" in pip[0]
        assert "ansible-galaxy collection install -r requirements.yml" in commands
    assert [c for c in _buildspec_install() if "pip" in c or "galaxy" in c] == _install_commands()


def test_the_aws_session_lasts_as_long_as_the_job_may() -> None:
    """configure-aws-credentials' default session is one hour; the job may run timeout-minutes, and the
    role that `gpuforge pipeline-role` creates must allow that long."""
    creds = _step_using("aws-actions/configure-aws-credentials")["with"]
    seconds = int(creds["role-duration-seconds"])
    assert seconds >= int(_job()["timeout-minutes"]) * 60
    role = iam.cloudformation_template("owner/repo")["Resources"]["GitHubRole"]["Properties"]
    assert seconds <= role["MaxSessionDuration"]


def test_builder_profile_gives_session_manager_what_it_needs() -> None:
    """Packer's session_manager tunnel needs the builder to run the SSM agent with the core permissions."""
    resources = iam.cloudformation_template(None)["Resources"]
    managed = resources["BuilderRole"]["Properties"]["ManagedPolicyArns"]
    assert managed == [{"Fn::Sub": "arn:${AWS::Partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"}]


def test_runners_install_the_signed_session_manager_plugin_and_pass_the_profile(tmp_path: Path) -> None:
    env = yaml.safe_load(WORKFLOW.read_text())["env"]
    spec_env = yaml.safe_load(BUILDSPEC.read_text())["env"]["variables"]
    assert env["SESSION_MANAGER_PLUGIN_VERSION"] == spec_env["SESSION_MANAGER_PLUGIN_VERSION"]
    assert (
        _step("Install the Session Manager plugin")["run"]
        == "packer/scripts/install-session-manager-plugin.sh"
    )
    assert "packer/scripts/install-session-manager-plugin.sh" in _buildspec_install()
    assert "--iam-instance-profile" in _step("Rebuild ${{ matrix.flavor }}")["run"]
    assert "--iam-instance-profile" in yaml.safe_load(BUILDSPEC.read_text())["phases"]["build"]["commands"][0]
    shown = subprocess.run(
        ["gpg", "--show-keys", "--with-colons", str(PLUGIN_SCRIPT.with_name("session-manager-plugin.asc"))],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "GNUPGHOME": str(tmp_path)},
    ).stdout
    assert f"fpr:::::::::{AWS_PLUGIN_KEY}:" in shown.splitlines()


@pytest.mark.skipif(shutil.which("gpg") is None, reason="gpg absent")
def test_plugin_with_a_signature_by_another_key_is_not_installed(tmp_path: Path) -> None:
    """The install script installs nothing unless AWS's key signed the package."""
    home = tmp_path / "gnupg"
    home.mkdir(mode=0o700)
    env = {**os.environ, "GNUPGHOME": str(home)}
    subprocess.run(
        ["gpg", "--batch", "--passphrase", "", "--quick-gen-key", "mallory@example.com", "default", "sign"],
        check=True,
        capture_output=True,
        env=env,
    )
    pkg = tmp_path / "plugin" / "9.9.9" / "ubuntu_64bit"
    pkg.mkdir(parents=True)
    deb = pkg / "session-manager-plugin.deb"
    deb.write_bytes(b"not AWS's package")
    subprocess.run(
        ["gpg", "--batch", "--detach-sign", "-o", f"{deb}.sig", str(deb)],
        check=True,
        capture_output=True,
        env=env,
    )
    run_env = {
        **os.environ,
        "SESSION_MANAGER_PLUGIN_VERSION": "9.9.9",
        "SESSION_MANAGER_PLUGIN_BASE_URL": f"file://{tmp_path / 'plugin'}",
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
    }
    # A dpkg that records being called: it must not be.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "dpkg").write_text(f"#!/bin/sh\ntouch {tmp_path / 'installed'}\n")
    (tmp_path / "bin" / "dpkg").chmod(0o755)
    result = subprocess.run(
        ["bash", str(PLUGIN_SCRIPT)], capture_output=True, text=True, env=run_env, check=False
    )
    assert result.returncode != 0
    assert "does not verify against AWS's key" in result.stderr
    assert not (tmp_path / "installed").exists()


@pytest.mark.slow
def test_workflow_install_commands_give_a_working_bake_entry_point(tmp_path: Path) -> None:
    """The workflow's install lines, run as written in a new virtualenv on a copy of the checkout (pip's
    cache and index only), leave `gpuforge bake`, ansible-playbook and requirements.yml's collections."""
    src = tmp_path / "src"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    for name in filter(None, listed.stdout.split("\0")):
        path = REPO / name
        if path.is_file() and not path.is_symlink():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON", "ANSIBLE_"))}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    env["HOME"] = str(tmp_path / "home")  # no ~/.ansible collections from this machine
    env.setdefault("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip"))
    script = "set -euo pipefail\n" + "\n".join(_install_commands())
    installed = subprocess.run(
        ["bash", "-c", script], cwd=src, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    assert "Nothing to do. All requested collections are already installed" in installed.stdout
    for cmd in (
        ["gpuforge", "bake", "--help"],
        ["ansible-playbook", "--version"],
        ["ansible-galaxy", "--version"],
    ):
        ran = subprocess.run(
            [str(venv / "bin" / cmd[0]), *cmd[1:]],
            cwd=src,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert ran.returncode == 0, ran.stdout + ran.stderr
    pinned = (REPO / "requirements" / "constraints.txt").read_text()
    version = subprocess.run(
        [str(venv / "bin" / "ansible-playbook"), "--version"],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
    ).stdout
    core = next(line.split("==")[1] for line in pinned.splitlines() if line.startswith("ansible-core=="))
    assert f"core {core}]" in version


def test_the_codebuild_schedule_moves_latest_only_through_canary_and_promote() -> None:
    """Review finding: the buildspec rebuilt (a candidate, by default) but never ran canary or promote,
    so latest never moved on CodeBuild; the canary is bounded so the build fits its timeout."""
    script = "\n".join(yaml.safe_load(BUILDSPEC.read_text())["phases"]["build"]["commands"])
    rebuild, canary, promote = (
        script.index(f"gpuforge {word} ") for word in ("rebuild", "canary", "promote")
    )
    assert rebuild < canary < promote
    assert "| tee" not in script  # sh: no pipefail, a failed rebuild must stop the build
    assert '--boot-timeout "$CANARY_BOOT_TIMEOUT" --command-timeout "$CANARY_COMMAND_TIMEOUT"' in script
    variables = yaml.safe_load(BUILDSPEC.read_text())["env"]["variables"]
    assert int(variables["CANARY_BOOT_TIMEOUT"]) * 2 + int(variables["CANARY_COMMAND_TIMEOUT"]) * 4 < 4 * 3600


def test_packer_init_gets_the_jobs_token_for_the_github_api() -> None:
    """`packer init` lists plugin releases through the GitHub API, 60 unauthenticated requests an hour per
    address on a shared runner (hashicorp/packer#11259); Packer reads PACKER_GITHUB_API_TOKEN for it."""
    rebuild = _step("Rebuild ${{ matrix.flavor }}")
    assert rebuild["env"]["PACKER_GITHUB_API_TOKEN"] == "${{ github.token }}"


def _run_canary_step(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], str, str]:
    step = _step("Canary ${{ matrix.flavor }}")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "gpuforge"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    fake.chmod(0o755)
    output = tmp_path / "github_output"
    output.touch()
    variables = {k: "" for k in step["env"] if k.startswith("CANARY_")}
    run_env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "GITHUB_OUTPUT": str(output),
        "FLAVOR": "dlami",
        "AMI": "ami-0123456789abcdef0",
        **variables,
        "CANARY_COUNT": "2",
        **env,
    }
    result = subprocess.run(
        ["bash", "-e", "-c", step["run"]], env=run_env, capture_output=True, text=True, check=False
    )
    return result, calls.read_text() if calls.exists() else "", output.read_text()


def test_the_canary_without_its_settings_leaves_a_candidate_and_says_so(tmp_path: Path) -> None:
    """As packer/buildspec.yml: no CANARY_INSTANCE_TYPE, no canary and no promote; the job goes on (prune)."""
    result, calls, output = _run_canary_step(tmp_path)
    assert result.returncode == 0, result.stderr
    assert calls == "" and "passed=true" not in output
    assert (
        "ami-0123456789abcdef0 stays a candidate" in result.stdout and "CANARY_INSTANCE_TYPE" in result.stdout
    )
    assert _step("Promote ${{ matrix.flavor }}")["if"] == "steps.canary.outputs.passed == 'true'"
    # Prune runs after any rebuild that succeeded, whatever the canary did (a misconfigured one included).
    assert _step("Prune ${{ matrix.flavor }}")["if"] == "always() && steps.rebuild.outcome == 'success'"


@pytest.mark.parametrize(
    ("settings", "missing"),
    [
        ({"CANARY_INSTANCE_TYPE": "p5.48xlarge"}, "CANARY_INSTANCE_PROFILE, CANARY_RESULTS_BUCKET"),
        ({"CANARY_INSTANCE_PROFILE": "p", "CANARY_RESULTS_BUCKET": "b"}, "CANARY_INSTANCE_TYPE"),
        ({"CANARY_INSTANCE_TYPE": "p5.48xlarge", "CANARY_INSTANCE_PROFILE": "p"}, "CANARY_RESULTS_BUCKET"),
    ],
)
def test_the_canary_with_some_settings_fails_naming_the_missing(
    tmp_path: Path, settings: dict[str, str], missing: str
) -> None:
    """Half a canary configuration is a mistake, not a choice: the step fails naming what is missing, so
    promote does not run (prune does: its `if`)."""
    result, calls, output = _run_canary_step(tmp_path, **settings)
    assert result.returncode != 0
    assert calls == "" and "passed=true" not in output
    assert "::error::" in result.stdout and f"missing {missing}" in result.stdout


def _run_buildspec(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run packer/buildspec.yml's build commands under sh with a gpuforge that records its calls and whose
    rebuild names a new candidate."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    calls = tmp_path / "calls"
    fake = bin_dir / "gpuforge"
    fake.write_text(
        f'#!/bin/sh\necho "$1" >> {calls}\n[ "$1" = rebuild ] && echo ami-0123456789abcdef0\nexit 0\n'
    )
    fake.chmod(0o755)
    spec = yaml.safe_load(BUILDSPEC.read_text())
    variables = {k: str(v) for k, v in spec["env"]["variables"].items()}
    run_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "AWS_REGION": "us-east-1", **variables}
    run_env.update(FLAVORS="dlami", **env)
    result = subprocess.run(
        ["sh", "-c", "\n".join(spec["phases"]["build"]["commands"])],
        cwd=tmp_path,
        env=run_env,
        capture_output=True,
        text=True,
        check=False,
    )
    return result, calls.read_text().split() if calls.exists() else []


def test_the_buildspec_canary_guard_matches_the_workflows(tmp_path: Path) -> None:
    none, calls = _run_buildspec(tmp_path / "none")
    assert none.returncode == 0 and calls == ["rebuild", "prune"]
    assert "stays a candidate" in none.stdout
    some, calls = _run_buildspec(tmp_path / "some", CANARY_INSTANCE_TYPE="p5.48xlarge")
    # Fails naming the missing settings, promotes nothing, still prunes.
    assert some.returncode != 0 and calls == ["rebuild", "prune"]
    assert "missing CANARY_INSTANCE_PROFILE, CANARY_RESULTS_BUCKET" in some.stdout + some.stderr
    full = {
        "CANARY_INSTANCE_TYPE": "p5.48xlarge",
        "CANARY_INSTANCE_PROFILE": "p",
        "CANARY_RESULTS_BUCKET": "b",
    }
    every, calls = _run_buildspec(tmp_path / "all", **full)
    assert every.returncode == 0 and calls == ["rebuild", "canary", "promote", "prune"]


def test_the_canary_with_its_settings_runs_and_lets_promote_run(tmp_path: Path) -> None:
    settings = {
        "CANARY_INSTANCE_TYPE": "p5.48xlarge",
        "CANARY_INSTANCE_PROFILE": "gpuforge-canary",
        "CANARY_RESULTS_BUCKET": "b",
    }
    result, calls, output = _run_canary_step(tmp_path, **settings)
    assert result.returncode == 0, result.stderr
    assert calls.startswith("canary --flavor dlami --ami ami-0123456789abcdef0 --instance-type p5.48xlarge")
    assert "passed=true" in output


def test_the_buildspec_token_example_uncommented_is_a_secret_beside_the_variables() -> None:
    """Uncommenting the secrets-manager example (deleting each line's "# ") gives env.secrets-manager and
    leaves every variable, the CANARY_* ones included, under env.variables."""
    example = re.compile(r"^(\s*)# (\s*(?:secrets-manager|PACKER_GITHUB_API_TOKEN):.*)$", re.MULTILINE)
    text = BUILDSPEC.read_text()
    assert len(example.findall(text)) == 2
    env = yaml.safe_load(example.sub(r"\1\2", text))["env"]
    assert env["secrets-manager"] == {"PACKER_GITHUB_API_TOKEN": "gpuforge/packer-github-token"}
    assert env["variables"] == yaml.safe_load(text)["env"]["variables"]
    assert "CANARY_INSTANCE_TYPE" in env["variables"]
