"""The gpuforge.gpu.managed_* filters: a role's managed files against one find of the host; and
roles/gpuforge_common/tasks/managed_files.yml, the one pass every configure role runs them in."""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.errors import AnsibleFilterError

import sourcefile
from localplay import read_results, record, results_task, run_play

REPO = Path(__file__).resolve().parents[1]
FQCN = "gpuforge.gpu"
managed_files = sourcefile.load("managed_files", "plugins/filter/managed_files.py")

CONF = "SlurmctldPort=6817\n"
MANAGED: list[dict[str, Any]] = [
    {"path": "/etc/slurm", "state": "directory", "owner": "root", "group": "root", "mode": "0755"},
    {"path": "/var/log/slurm/", "state": "directory", "owner": "slurm", "group": "slurm", "mode": "0755"},
    {
        "path": "/etc/slurm/slurm.conf",
        "state": "file",
        "content": CONF,
        "owner": "root",
        "group": "root",
        "mode": "0644",
    },
]


def _found(**changes: dict[str, Any]) -> list[dict[str, Any]]:
    """find's files for MANAGED as written, each changed as given (None leaves it out)."""
    base = {
        "/etc/slurm": {"isdir": True, "isreg": False, "pw_name": "root", "gr_name": "root", "mode": "0755"},
        "/var/log/slurm": {
            "isdir": True,
            "isreg": False,
            "pw_name": "slurm",
            "gr_name": "slurm",
            "mode": "0755",
        },
        "/etc/slurm/slurm.conf": {
            "isdir": False,
            "isreg": True,
            "pw_name": "root",
            "gr_name": "root",
            "mode": "0644",
            "checksum": hashlib.sha1(CONF.encode()).hexdigest(),  # noqa: S324
        },
        # A match of a pattern elsewhere is ignored.
        "/etc/slurm.conf": {
            "isdir": False,
            "isreg": True,
            "pw_name": "root",
            "gr_name": "root",
            "mode": "0600",
        },
    }
    out = []
    for path, entry in base.items():
        change = changes.get(path, {})
        if change is None:
            continue
        out.append({"path": path, **entry, **change})
    return out


def test_find_arguments_cover_every_path_once() -> None:
    assert managed_files.managed_parents(MANAGED) == ["/etc", "/etc/slurm", "/var/log"]
    assert managed_files.managed_names(MANAGED) == ["slurm", "slurm.conf"]


def test_nothing_differs_on_a_host_as_written() -> None:
    assert managed_files.managed_differ(MANAGED, _found()) == []


def test_entries_to_write_come_with_state_and_notify() -> None:
    """The tasks that write them select on both, so an entry that leaves them out still has them."""
    bare = [{"path": "/etc/x.conf", "content": "x", "owner": "root", "group": "root", "mode": "0644"}]
    assert managed_files.managed_differ(bare, []) == [{**bare[0], "state": "file", "notify": False}]


@pytest.mark.parametrize(
    ("changes", "differing"),
    [
        ({"/etc/slurm/slurm.conf": None}, ["/etc/slurm/slurm.conf"]),
        ({"/etc/slurm/slurm.conf": {"checksum": "0" * 40}}, ["/etc/slurm/slurm.conf"]),
        ({"/etc/slurm/slurm.conf": {"mode": "0664"}}, ["/etc/slurm/slurm.conf"]),
        ({"/etc/slurm/slurm.conf": {"gr_name": "slurm"}}, ["/etc/slurm/slurm.conf"]),
        ({"/etc/slurm/slurm.conf": {"isreg": False, "isdir": True}}, ["/etc/slurm/slurm.conf"]),
        ({"/var/log/slurm": {"pw_name": "root"}}, ["/var/log/slurm/"]),
        ({"/etc/slurm": {"isdir": False, "isreg": True}}, ["/etc/slurm"]),
        ({"/etc/slurm": None, "/etc/slurm/slurm.conf": None}, ["/etc/slurm", "/etc/slurm/slurm.conf"]),
    ],
)
def test_what_differs_is_written(changes: dict[str, Any], differing: list[str]) -> None:
    assert [e["path"] for e in managed_files.managed_differ(MANAGED, _found(**changes))] == differing


@pytest.mark.parametrize(
    ("managed", "message"),
    [
        ([{"state": "file"}], "a list of entries"),
        ([{"path": "/x", "state": "link"}], "state must be file or directory"),
        ([{"path": "/x", "state": "file"}], "content as a string"),
    ],
)
def test_malformed_entries_are_refused(managed: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(AnsibleFilterError, match=message):
        managed_files.managed_differ(managed, [])


def _caller_role(roles: Path) -> None:
    """A role like slurm's: it renders a directory, a configuration file (its change notifies the
    role's own listen topic) and a checked script, and writes them with gpuforge_common's one pass."""
    owned = {"owner": pwd.getpwuid(os.getuid()).pw_name, "group": grp.getgrgid(os.getgid()).gr_name}
    etc = "{{ caller_root }}/etc"
    managed = [
        {"path": etc, "state": "directory", **owned, "mode": "0755"},
        {
            "path": f"{etc}/caller.conf",
            "state": "file",
            "content": "{{ caller_conf }}",
            **owned,
            "mode": "0644",
        }
        | {"notify": True},
        {
            "path": f"{etc}/prolog.sh",
            "state": "file",
            "content": "{{ caller_script }}",
            **owned,
            "mode": "0755",
        }
        | {"validate": "/bin/sh -n %s"},
    ]
    tasks = [
        {"name": "Render the files", "ansible.builtin.set_fact": {"_caller_managed": managed}},
        {
            "name": "Write them",
            "ansible.builtin.include_role": {
                "name": f"{FQCN}.gpuforge_common",
                "tasks_from": "managed_files.yml",
            },
            "vars": {
                "gpuforge_common_managed_files": "{{ _caller_managed }}",
                "gpuforge_common_managed_notify": ["Caller configuration changed"],
            },
        },
    ]
    handlers = [
        {
            "name": "Count the notification",
            "ansible.builtin.set_fact": {"caller_notified": "{{ caller_notified | int + 1 }}"},
            "listen": "Caller configuration changed",
        }
    ]
    for name, content in (("tasks", tasks), ("handlers", handlers)):
        (roles / "caller" / name).mkdir(parents=True)
        (roles / "caller" / name / "main.yml").write_text(yaml.safe_dump(content, sort_keys=False))


@pytest.mark.slow
def test_one_pass_writes_what_differs_and_notifies_the_callers_handler(tmp_path: Path) -> None:
    """A real play: the first pass writes everything and notifies the calling role's handler from
    gpuforge_common's task (handlers are found in the whole play); a second pass writes nothing; a
    changed script is rewritten without a notification, a changed configuration with one; a script
    that fails its validate is not written; a check-mode pass writes nothing."""
    _caller_role(tmp_path / "roles")
    root = tmp_path / "root"
    paths = [f"{root}/etc", f"{root}/etc/caller.conf", f"{root}/etc/prolog.sh"]
    caller = {"ansible.builtin.include_role": {"name": "caller"}}
    caller_in_check_mode = {"ansible.builtin.include_role": {"name": "caller", "apply": {"check_mode": True}}}
    flush = {"ansible.builtin.meta": "flush_handlers"}
    stat = {
        "ansible.builtin.stat": {"path": "{{ item }}", "get_checksum": False},
        "loop": paths,
        "register": "_stat",
    }
    invalid = {
        "name": "A script that does not pass its check",
        "block": [{**caller, "vars": {"caller_script": "if then\n"}}],
        "rescue": [
            record("invalid", "{{ ansible_failed_result.results | map(attribute='msg', default='') | join }}")
        ],
    }

    def observe(case: str) -> list[dict[str, Any]]:
        seen = {
            "notified": "{{ caller_notified | int }}",
            "inodes": "{{ _stat.results | map(attribute='stat.inode') | list }}",
            "modes": "{{ _stat.results | map(attribute='stat.mode') | list }}",
        }
        return [caller, flush, stat, record(case, seen)]

    def edit(path: str, content: str) -> dict[str, Any]:
        return {"ansible.builtin.copy": {"dest": path, "content": content, "mode": "0600"}}

    tasks = [
        *observe("first"),
        *observe("second"),
        edit(paths[2], "true\n"),
        *observe("script"),
        edit(paths[1], "old\n"),
        *observe("conf"),
        invalid,
        edit(paths[1], "old\n"),
        caller_in_check_mode,
        results_task(tmp_path),
    ]
    play = [
        {
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": False,
            "vars": {
                "_results": {},
                "ansible_python_interpreter": sys.executable,
                "caller_root": str(root),
                "caller_conf": "Port=6817\n",
                "caller_script": "exit 0\n",
                "caller_notified": 0,
            },
            "tasks": tasks,
        }
    ]
    run_play(tmp_path, play, env={"ANSIBLE_ROLES_PATH": str(tmp_path / "roles")})
    results = read_results(tmp_path)
    first, second, script, conf = (results[case] for case in ("first", "second", "script", "conf"))
    assert first["modes"] == ["0755", "0644", "0755"]
    assert first["notified"] == 1
    assert second == first  # nothing written: the same inodes, no notification
    assert script["notified"] == 1 and script["inodes"][1] == first["inodes"][1] != script["inodes"][2]
    assert conf["notified"] == 2 and conf["inodes"][2] == script["inodes"][2]
    assert conf["modes"] == first["modes"]
    assert "failed to validate" in results["invalid"]
    assert (root / "etc" / "prolog.sh").read_text() == "exit 0\n"
    assert (root / "etc" / "caller.conf").read_text() == "old\n"  # the check-mode pass wrote nothing
