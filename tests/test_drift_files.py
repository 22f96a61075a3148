"""The gpuforge.gpu.drift_files filter: ansible.posix.json output of a --check --diff run, per host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ansible.errors import AnsibleFilterError

import sourcefile

REPO = Path(__file__).resolve().parents[1]
drift_files = sourcefile.load("drift_files", "plugins/filter/drift_files.py")


def _output(tasks: list[dict[str, object]]) -> str:
    # The callback prints a deprecation or warning line first at times: the filter starts at "{".
    return "[WARNING]: something\n" + json.dumps({"plays": [{"tasks": tasks}], "stats": {}})


def test_files_per_host_and_other_changes() -> None:
    out = _output(
        [
            {  # A template that would change on node-a only.
                "hosts": {
                    "node-a": {"changed": True, "diff": [{"before_header": "/etc/nccl.conf", "before": "x"}]},
                    "node-b": {"changed": False},
                }
            },
            {  # A loop: a file's mode on node-b, a package on node-a.
                "hosts": {
                    "node-b": {
                        "changed": True,
                        "results": [{"changed": True, "diff": {"before": {"path": "/etc/x"}}}],
                    },
                    "node-a": {"changed": True, "results": [{"changed": True}, {"changed": False}]},
                }
            },
        ]
    )
    assert drift_files.drift_files(out) == {
        "node-a": {"files": ["/etc/nccl.conf"], "other_changes": 1},
        "node-b": {"files": ["/etc/x"], "other_changes": 0},
    }


def test_output_that_is_not_json_is_an_error() -> None:
    with pytest.raises(AnsibleFilterError, match="not the json callback's output"):
        drift_files.drift_files("ERROR! the playbook could not be found")
