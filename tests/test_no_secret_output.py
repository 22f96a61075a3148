"""No secret ever printed: the munge key stays out of Ansible's output at -vvvv, when tasks fail, too.

The dynamic test runs the slurm role's real munge tasks (roles/slurm/tasks/munge.yml) on the control
host, with random keys from each source (SSM in moto, a variable, a file), at -vvvv with --diff, and
forces the failures that matter: a key too short for the check, an SSM parameter that is missing,
and a write that fails with the key in hand. Only one line of the task file changes for the test:
the key's destination, so nothing under /etc is touched. A canary run of the same play with the
no_log lines removed must show every key, which proves this verbosity and these paths would print
them. No lab is needed.

The static test checks that every task in roles/ and playbooks/ that touches a secret-named variable
(munge key, password, token, secret, private key) or reads a secret store runs with no_log.
"""

from __future__ import annotations

import os
import pwd
import re
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml

from gpuforge_lab.moto import MotoServer
from localplay import REPO, read_results, record, results_task, run_play

pytestmark = pytest.mark.slow

MUNGE_TASKS = REPO / "roles" / "slurm" / "tasks" / "munge.yml"
DEST_LINE = "    dest: /etc/munge/munge.key\n"
PARAMETER = "/gpuforge/secret-test/munge-key"
MISSING_PARAMETER = "/gpuforge/secret-test/no-such-key"


def _key() -> str:
    """A munge key as an operator makes one (base64 of random bytes): unique, so any echo of it is ours."""
    return secrets.token_urlsafe(48)


def _tasks_file(tmp: Path, keep_no_log: bool) -> Path:
    """munge.yml with its destination pointed into tmp; the canary copy also loses every no_log line."""
    text = MUNGE_TASKS.read_text()
    assert text.count(DEST_LINE) == 1, "munge.yml's destination moved: update DEST_LINE"
    text = text.replace(DEST_LINE, '    dest: "{{ _test_dest }}"\n')
    if not keep_no_log:
        assert "  no_log: true\n" in text
        text = text.replace("  no_log: true\n", "")
    path = tmp / ("munge.yml" if keep_no_log else "munge-without-no_log.yml")
    path.write_text(text)
    return path


def _play(tmp: Path, tasks_file: Path, keys: dict[str, str]) -> list[dict[str, Any]]:
    (tmp / "etc").mkdir(exist_ok=True)
    (tmp / "written").mkdir(exist_ok=True)
    key_file = tmp / "munge.key"
    key_file.write_text(keys["file"])
    # A regular file where the key's directory should be: the write fails, for real, with the key in hand.
    (tmp / "not-a-directory").write_text("")
    ok = str(tmp / "etc" / "munge.key")
    cases: dict[str, tuple[dict[str, Any], bool]] = {
        "ssm": ({"slurm_munge_key_source": "ssm", "slurm_munge_key_ssm_parameter": PARAMETER}, True),
        "var": ({"slurm_munge_key_source": "var", "slurm_munge_key": keys["var"]}, True),
        "file": ({"slurm_munge_key_source": "file", "slurm_munge_key_file": str(key_file)}, True),
        "short": ({"slurm_munge_key_source": "var", "slurm_munge_key": keys["short"]}, True),
        "ssm-missing": (
            {"slurm_munge_key_source": "ssm", "slurm_munge_key_ssm_parameter": MISSING_PARAMETER},
            True,
        ),
        "write-fails": (
            {
                "slurm_munge_key_source": "ssm",
                "slurm_munge_key_ssm_parameter": PARAMETER,
                "_test_dest": str(tmp / "not-a-directory" / "munge.key"),
            },
            False,
        ),
        # Fails later, after the key reached the host and the diff was made: at chown to munge, on a
        # control host without that user. Where munge exists, this writes the key into tmp instead.
        "chown-fails": (
            {
                "slurm_munge_key_source": "var",
                "slurm_munge_key": keys["var"],
                "_test_dest": str(tmp / "written" / "munge.key"),
            },
            False,
        ),
    }
    tasks: list[dict[str, Any]] = [
        {
            "name": f"Case {case}",
            # Check mode keeps the successful writes on paper; the failing write runs for real.
            "check_mode": check,
            "block": [
                {"ansible.builtin.include_tasks": str(tasks_file), "vars": {"_test_dest": ok, **variables}},
                record(case, "ok"),
            ],
            "rescue": [record(case, "{{ ansible_failed_result.msg | default('failed') }}")],
        }
        for case, (variables, check) in cases.items()
    ]
    tasks.append(results_task(tmp))
    return [
        {
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": False,
            "vars": {"_results": {}, "ansible_python_interpreter": sys.executable},
            "tasks": tasks,
            # The role's handler restarts munge; here a stand-in, so the control host is left alone.
            "handlers": [{"name": "Restart munge", "ansible.builtin.debug": {"msg": "munge restarted"}}],
        }
    ]


def _run(tmp: Path, tasks_file: Path, keys: dict[str, str]) -> tuple[str, dict[str, str]]:
    """Run the play at -vvvv --diff; return everything Ansible wrote (output, log, fact cache) and results."""
    log = tmp / "ansible.log"
    cache = tmp / "facts"
    # The lookup is the collection's (gpuforge.gpu.slurm_ssm_secret), found through ansible.cfg's
    # collections_path (./collections links back to this checkout).
    env = {**os.environ, "ANSIBLE_LOG_PATH": str(log), "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(cache)}
    result = run_play(tmp, _play(tmp, tasks_file, keys), "-vvvv", "--diff", env=env)
    written = [result.stdout, result.stderr, log.read_text()]
    written += [p.read_text() for p in cache.rglob("*") if p.is_file()]
    return "\n".join(written), read_results(tmp)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@pytest.fixture
def keys(aws: MotoServer) -> Iterator[dict[str, str]]:
    """One fresh key per source; the SSM one stored as a SecureString in this test's moto."""
    values = {"ssm": _key(), "var": _key(), "file": _key(), "short": secrets.token_hex(8)}
    boto3.client("ssm").put_parameter(Name=PARAMETER, Value=values["ssm"], Type="SecureString")
    yield values


def test_munge_key_never_appears_in_output(keys: dict[str, str], tmp_path: Path) -> None:
    output, results = _run(tmp_path, _tasks_file(tmp_path, keep_no_log=True), keys)
    # Every case ran the path it was meant to: three keys written (in check mode), three failures.
    assert {case: results[case] for case in ("ssm", "var", "file")} == dict.fromkeys(
        ("ssm", "var", "file"), "ok"
    )
    assert "shorter than 32 bytes" in results["short"]
    assert f"cannot read SSM parameter {MISSING_PARAMETER}: ParameterNotFound" in results["ssm-missing"]
    assert "Not a directory" in results["write-fails"]
    if _has_user("munge"):
        assert results["chown-fails"] == "ok"
    else:
        assert "munge" in results["chown-fails"] and results["chown-fails"] != "ok"
    leaked = sorted(source for source, key in keys.items() if key in output)
    assert leaked == [], f"the munge key from {leaked} appears in Ansible's output"


def test_canary_without_no_log_the_keys_do_appear(keys: dict[str, str], tmp_path: Path) -> None:
    """Without no_log, the same play prints every key: the check above is not vacuous."""
    output, results = _run(tmp_path, _tasks_file(tmp_path, keep_no_log=False), keys)
    assert results["ssm"] == "ok"
    assert sorted(source for source, key in keys.items() if key in output) == sorted(keys)


def test_why_the_role_has_its_own_ssm_lookup(keys: dict[str, str], tmp_path: Path) -> None:
    """amazon.aws.ssm_parameter prints what it read at -vvvv, even in a no_log task.

    If this fails, amazon.aws stopped doing so, and the role could use it again instead of
    plugins/lookup/slurm_ssm_secret.py.
    """
    task = {
        "name": "Read the key the collection's way",
        "ansible.builtin.set_fact": {
            "_read": f"{{{{ lookup('amazon.aws.ssm_parameter', '{PARAMETER}', decrypt=true) }}}}"
        },
        "no_log": True,
    }
    play = [{"hosts": "localhost", "connection": "local", "gather_facts": False, "tasks": [task]}]
    env = {**os.environ, "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(tmp_path / "facts")}
    result = run_play(tmp_path, play, "-vvvv", env=env, timeout=300)
    assert keys["ssm"] in result.stdout + result.stderr


# --- static: no_log on every task that touches a secret --------------------------------------------

# A variable holding a secret, by name: the name ends with one of these words. Names that only say where
# a secret lives (slurm_munge_key_source, slurm_munge_key_file, ..._ssm_parameter) do not end so.
SECRET_NAME = re.compile(
    r"(?:^|_)(?:munge_key|password|passwd|passphrase|token|secret|secret_key|private_key|api_key|credentials?)$"
)
# Lookups that return a secret whatever the variable is called.
SECRET_LOOKUP = re.compile(
    r"lookup\(\s*['\"](?:(?:gpuforge\.gpu\.)?slurm_ssm_secret|amazon\.aws\.(?:aws_)?ssm(?:_parameter)?|"
    r"amazon\.aws\.(?:aws_)?secret(?:smanager_secret)?|ansible\.builtin\.password)['\"]"
)
JINJA = re.compile(r"\{\{(.*?)\}\}|\{%(.*?)%\}", re.S)
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Task keys whose value is a bare Jinja expression, without {{ }}.
EXPRESSION_KEYS = {"when", "failed_when", "changed_when", "until", "that", "var", "register", "loop_var"}
BLOCK_KEYS = ("block", "rescue", "always")
PLAY_TASK_KEYS = ("pre_tasks", "tasks", "post_tasks", "handlers")


def _strings(value: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """(key it sits under, string) for every string in a task, nested ones included."""
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, str(k))
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v, key)


def secret_references(task: dict[str, Any]) -> set[str]:
    """The secret-named variables (and secret lookups) a task reads, writes or registers."""
    found: set[str] = set()
    body = {k: v for k, v in task.items() if k not in BLOCK_KEYS}
    for key, text in _strings(body):
        expressions = [a or b for a, b in JINJA.findall(text)]
        if key in EXPRESSION_KEYS:
            expressions.append(text)
        for expression in expressions:
            found |= {name for name in IDENTIFIER.findall(expression) if SECRET_NAME.search(name)}
            found |= {m.group(0) for m in SECRET_LOOKUP.finditer(expression)}
    # set_fact's keys are the variables it sets.
    for module in ("ansible.builtin.set_fact", "set_fact"):
        if isinstance(task.get(module), dict):
            found |= {name for name in task[module] if SECRET_NAME.search(str(name))}
    return found


def unprotected(tasks: Any, where: str, no_log: bool = False) -> Iterator[str]:
    """'file: task name: secrets' for each task that touches a secret without no_log (own or inherited)."""
    for task in tasks if isinstance(tasks, list) else []:
        if not isinstance(task, dict):
            continue
        hidden = no_log or task.get("no_log") is True
        for key in BLOCK_KEYS:
            yield from unprotected(task.get(key), where, hidden)
        touched = secret_references(task)
        if touched and not hidden:
            yield f"{where}: {task.get('name', '(unnamed)')}: {', '.join(sorted(touched))}"


def _task_files() -> Iterator[tuple[Path, Any]]:
    for path in sorted((REPO / "roles").glob("*/tasks/*.yml")) + sorted(
        (REPO / "roles").glob("*/handlers/*.yml")
    ):
        yield path, yaml.safe_load(path.read_text())
    for path in [REPO / "site.yml", *sorted((REPO / "playbooks").glob("*.yml"))]:
        plays = yaml.safe_load(path.read_text()) or []
        for play in plays:
            for key in PLAY_TASK_KEYS:
                yield path, play.get(key)


def test_every_task_touching_a_secret_has_no_log() -> None:
    problems = [p for path, tasks in _task_files() for p in unprotected(tasks, str(path.relative_to(REPO)))]
    assert problems == [], "add no_log: true to:\n" + "\n".join(problems)


def _all_tasks(tasks: Any) -> Iterator[dict[str, Any]]:
    for task in tasks if isinstance(tasks, list) else []:
        if isinstance(task, dict):
            yield task
            for key in BLOCK_KEYS:
                yield from _all_tasks(task.get(key))


def test_the_secret_scan_finds_what_it_must() -> None:
    """The scan sees the roles' secret tasks, and flags each kind of unprotected one."""
    seen: dict[str, set[str]] = {}
    for path, tasks in _task_files():
        for task in _all_tasks(tasks):
            if secret_references(task):
                seen.setdefault(str(path.relative_to(REPO)), set()).add(str(task.get("name")))
    assert seen == {
        "roles/slurm/tasks/munge.yml": {
            "Read the munge key from SSM Parameter Store",
            "Take the munge key from the inventory",
            "Check the munge key",
            "Write the munge key",
        },
        "roles/gpuforge_common/tasks/detect_hardware.yml": {
            "Ask IMDSv2 for a session token",
            "Ask IMDSv2 for the instance type",
        },
    }
    leaky = [
        {"name": "Show the key", "ansible.builtin.debug": {"var": "_slurm_munge_key"}},
        {"name": "Write it", "ansible.builtin.copy": {"content": "{{ vault_db_password }}\n", "dest": "/x"}},
        {
            "name": "Read it",
            "ansible.builtin.debug": {"msg": "{{ lookup('amazon.aws.ssm_parameter', 'x') }}"},
        },
        {"name": "Keep it", "ansible.builtin.command": "true", "register": "_x_api_token"},
        {"name": "Set it", "ansible.builtin.set_fact": {"_x_secret": "{{ 'a' * 3 }}"}},
        {"name": "Path only", "ansible.builtin.stat": {"path": "{{ slurm_munge_key_file }}"}},
        {
            "name": "In a block",
            "no_log": True,
            "block": [{"ansible.builtin.debug": {"var": "_slurm_munge_key"}}],
        },
    ]
    flagged = [line.split(": ")[1] for line in unprotected(leaky, "t")]
    assert flagged == ["Show the key", "Write it", "Read it", "Keep it", "Set it"]
