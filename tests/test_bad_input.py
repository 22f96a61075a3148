"""Bad input gives a clear error, never a traceback: a table run through the real `gpuforge` CLI.

Each row runs the installed console script in a subprocess with no AWS credentials at all
(AWS_* unset, HOME an empty directory, IMDS disabled so nothing leaves loopback) and asserts the
exit status (2 = bad input, 1 = a failed external call), that the last line is gpuforge's (or
argparse's) one-line error, and that the message names what to fix. Rows that show a known gap
are marked xfail(strict=True) with the command to fix, so they flip to a failure once fixed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SPEC = REPO / "examples" / "cluster-spec.yml"
# A message that tells the user how to provide credentials, not only that they are missing.
HOW_TO_CREDENTIALS = r"AWS_PROFILE|AWS_ACCESS_KEY_ID|aws configure|aws sso login"


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    message: str  # regex the error output must match
    codes: tuple[int, ...] = (2,)
    files: dict[str, str] = field(default_factory=dict)  # name -> content, written to tmp_path
    needs_root: bool = False
    env: dict[str, str] = field(default_factory=dict)  # added to the credential-free environment
    known_gap: str | None = None  # xfail reason: the message or behaviour still to fix
    program: str = "gpuforge"  # or gpuforge-lab, the checkout's lab


def _spec(old: str, new: str) -> str:
    text = SPEC.read_text()
    assert old in text, f"{old!r} is no longer in {SPEC}; update this table"
    return text.replace(old, new, 1)


def _generate(case_id: str, spec: str, message: str) -> Case:
    """`cluster-config generate` of a spec file with this text."""
    return Case(case_id, ("cluster-config", "generate", "{tmp}/spec.yml"), message, files={"spec.yml": spec})


def _no_credentials(case_id: str, *argv: str) -> Case:
    """A command that needs AWS, run without credentials: the error must say how to provide them."""
    return Case(case_id, argv, HOW_TO_CREDENTIALS, codes=(1, 2))


CASES = [
    # Invalid variables and option values.
    Case(
        "negative-spare-nodes", ("preflight", "--cluster-name", "x", "--spare-nodes", "-1"), r"--spare-nodes"
    ),
    Case("prune-keep-zero", ("prune", "--keep", "0"), r"--keep: 0 must be at least 1"),
    # 0 is the default (the base AMI's root snapshot size); a negative size is not a size.
    Case(
        "bake-volume-negative",
        ("bake", "--root-volume-size", "-5"),
        r"--root-volume-size: -5 must be 0 \(the base AMI's root snapshot size\) or more",
    ),
    Case(
        "bake-missing-extra-vars",
        ("bake", "--no-publish", "--extra-vars", "{tmp}/nope.yml"),
        r"argument --extra-vars: .*nope\.yml does not exist",
    ),
    Case(
        "lab-zero-nodes",
        ("up", "--name", "badin", "--nodes", "0"),
        r"0 must be at least 1",
        needs_root=True,
        program="gpuforge-lab",
    ),
    Case(
        "lab-bad-name",
        ("up", "--name", "Bad Name!"),
        r"lab name 'Bad Name!' is invalid: use",
        needs_root=True,
        program="gpuforge-lab",
    ),
    Case(
        "lab-unknown-image",
        ("up", "--name", "badin", "--no-ec2", "--image", "no-such-image"),
        r"no lab image 'no-such-image' \(images here: .*\); make one with",
        needs_root=True,
        program="gpuforge-lab",
    ),
    Case(
        "lab-image-bad-name",
        ("image", "rm", "Bad/Name"),
        r"image name 'Bad/Name' is invalid: use",
        needs_root=True,
        program="gpuforge-lab",
    ),
    Case(
        "bake-local-moved-to-the-lab",
        ("bake", "--local"),
        r"--local: lab hosts are baked with `gpuforge-lab bake`",
    ),
    Case(
        "set-ami-bad-id",
        ("cluster-config", "set-ami", str(SPEC), "--ami", "bogus"),
        r"invalid AMI id 'bogus'",
    ),
    _generate(
        "spec-count-not-integer",
        _spec("max_count: 4", "max_count: many"),
        r"max_count: must be an integer, got 'many'",
    ),
    _generate(
        "spec-bad-ami",
        _spec("ami: ami-0123456789abcdef0", "ami: not-an-ami"),
        r"ami: invalid AMI id 'not-an-ami'",
    ),
    _generate(
        "spec-bad-region", _spec("region: us-east-1", "region: mars-1"), r"region: 'mars-1' is not a region"
    ),
    # Wrong instance type: every entry point names the known types (data/instance_types.yml).
    _generate(
        "spec-unknown-instance-type",
        _spec("instance_type: p5.48xlarge", "instance_type: p9.mega"),
        r"instance_type: unknown instance type 'p9\.mega'; known types: .*p5\.48xlarge",
    ),
    Case(
        "lab-unknown-instance-type",
        ("up", "--name", "badin", "--no-ec2", "--compute-type", "p9.mega"),
        r"unknown instance type 'p9\.mega'; known types: .*p5\.48xlarge",
        needs_root=True,
        program="gpuforge-lab",
    ),
    Case(
        "nccl-unknown-instance-type",
        ("nccl-report", "--instance-type", "p9.mega", "--out", "{tmp}/out", "{tmp}/run.log"),
        r"unknown instance type 'p9\.mega'; known types",
        files={"run.log": "#  size count type\n"},
    ),
    # Malformed cluster specs and configs.
    _generate(
        "spec-not-yaml", "region: us-east-1\nqueues: [\n", r"cluster spec .*spec\.yml is not valid YAML"
    ),
    _generate("spec-not-a-mapping", "- a\n- list\n", r"must be a YAML mapping"),
    _generate(
        "spec-missing-fields",
        "region: us-east-1\n",
        r"ami: missing \(required: ami, head_node, queues, region\)",
    ),
    Case(
        "spec-missing-file",
        ("cluster-config", "generate", "{tmp}/absent.yml"),
        r"argument SPEC: .*absent\.yml does not exist",
    ),
    Case(
        "config-not-yaml",
        ("cluster-config", "validate", "{tmp}/cluster.yml"),
        r"cluster config .*cluster\.yml is not valid YAML",
        files={"cluster.yml": "Region: [us-east-1\n"},
    ),
    # Missing credentials: the CLI must say how to provide them.
    _no_credentials("no-credentials-preflight", "preflight", "--cluster-name", "gpu"),
    _no_credentials("no-credentials-prune", "prune", "--dry-run"),
    _no_credentials("no-credentials-publish", "publish", "--ami", "ami-12345678"),
    _no_credentials("no-credentials-bake", "bake", "--no-publish"),
    # botocore's own errors (not API errors): one line each, never a traceback.
    Case(
        "bad-region",
        ("prune", "--dry-run", "--region", "bad region!"),
        r"gpuforge: error: Provided region_name 'bad region!' doesn't match a supported format",
    ),
    Case(
        "bad-region-env",
        ("publish", "--ami", "ami-12345678"),
        r"gpuforge: error: Provided region_name 'us east 1' doesn't match",
        env={"AWS_REGION": "us east 1"},
    ),
    Case(
        "publish-empty-parameter",
        ("publish", "--ami", "ami-12345678", "--parameter", ""),
        r"must not be empty",
    ),
    Case("prune-empty-parameter", ("prune", "--parameter", ""), r"--parameter: must not be empty"),
    Case("prune-empty-region", ("prune", "--region", ""), r"--region: must not be empty"),
    Case(
        "endpoint-down",
        ("prune", "--dry-run"),
        r"gpuforge: error: .*Could not connect to the endpoint URL: \"http://127\.0\.0\.1:9/\"$",
        codes=(1,),
        env={
            "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE",
            "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
            # Port 9 (discard) on loopback: nothing listens, the connection is refused at once.
            "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
            "AWS_MAX_ATTEMPTS": "1",
        },
    ),
]


def _no_credentials_env(home: Path) -> dict[str, str]:
    """The caller's environment minus every AWS setting, with an empty HOME and no IMDS lookups."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        HOME=str(home),
        AWS_REGION="us-east-1",
        # Without this botocore would ask 169.254.169.254 for instance credentials.
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=str(home / ".aws" / "config"),
        AWS_SHARED_CREDENTIALS_FILE=str(home / ".aws" / "credentials"),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def _param(case: Case) -> object:
    marks = []
    if case.known_gap:
        marks.append(pytest.mark.xfail(strict=True, reason=case.known_gap))
    if case.needs_root:
        marks.append(
            pytest.mark.skipif(os.geteuid() != 0, reason="the lab checks for root before its arguments")
        )
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input_gives_a_clear_error(case: Case, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    for name, content in case.files.items():
        (tmp_path / name).write_text(content)
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in case.argv]
    result = subprocess.run(
        [str(BIN / case.program), *argv],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env=_no_credentials_env(home) | case.env,
        timeout=120,
    )
    err = result.stderr.strip()
    assert "Traceback" not in err, err
    assert result.returncode in case.codes, f"exit {result.returncode}: {err}"
    first_error = next(
        (line for line in err.splitlines() if re.match(r"gpuforge(-lab)?( [\w-]+)*: error: ", line)), ""
    )
    assert first_error, f"no 'gpuforge: error:' line in:\n{err}"
    assert re.search(case.message, err), err


def test_invalid_role_variable_is_rejected_before_any_task(tmp_path: Path) -> None:
    """Role variables are checked against meta/argument_specs.yml before a role does anything.

    Runs the real bake playbook against localhost in check mode with a wrong-typed variable:
    the argument spec validation must stop it with a message naming the variable.
    """
    result = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            "localhost,",
            "-c",
            "local",
            "--check",
            "playbooks/bake.yml",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            "-e",
            "gpuforge_common_imds_timeout=soon",
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={**_no_credentials_env(tmp_path), "ANSIBLE_GATHERING": "explicit", "ANSIBLE_NOCOLOR": "1"},
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Validation of arguments failed" in out, out
    assert re.search(
        r"gpuforge_common_imds_timeout' is of type str and we were unable to convert to int", out
    )
    assert re.search(r"localhost\s+: ok=\d+\s+changed=0\s+unreachable=0\s+failed=1", out), out
