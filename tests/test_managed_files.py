"""The gpuforge.gpu.managed_* filters: a role's managed files against one find of the host."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from ansible.errors import AnsibleFilterError

import sourcefile

REPO = Path(__file__).resolve().parents[1]
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
