"""The repository root is the Ansible collection gpuforge.gpu; the built collection works on its own.

The collection is built with ansible-galaxy, installed into an empty collections path outside the
checkout, and a playbook there runs its roles (by FQCN) in check mode on a lab host, with an
ansible.cfg that knows nothing of this checkout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

import labtools

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ROLES = sorted(p.name for p in (REPO / "roles").iterdir() if (p / "tasks").is_dir())
GALAXY = yaml.safe_load((REPO / "galaxy.yml").read_text())
FQCN = f"{GALAXY['namespace']}.{GALAXY['name']}"

PLAY = f"""\
- name: Use the installed collection's roles
  hosts: all
  become: true
  gather_facts: true
  roles:
    - role: {FQCN}.gpuforge_common
  tasks:
    - name: Show where the roles read the pins from
      ansible.builtin.debug:
        msg: "versions file: {{{{ lookup('{FQCN}.data_file', 'versions') }}}}"
"""

CFG = """\
[defaults]
collections_path = {collections}
host_key_checking = False
interpreter_python = auto_silent
gathering = explicit

[inventory]
enable_plugins = amazon.aws.aws_ec2
"""


def _galaxy(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "ansible-galaxy"), "collection", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The collection tarball, built from this checkout into a temporary directory."""
    out = tmp_path_factory.mktemp("dist")
    result = _galaxy("build", "--output-path", str(out), str(REPO), cwd=out)
    assert result.returncode == 0, result.stderr
    return out / f"{GALAXY['namespace']}-{GALAXY['name']}-{GALAXY['version']}.tar.gz"


@pytest.fixture(scope="module")
def installed(built: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty collections path with only the built collection installed (dependencies come with ansible)."""
    collections = tmp_path_factory.mktemp("collections")
    result = _galaxy("install", "--no-deps", "--offline", "-p", str(collections), str(built), cwd=collections)
    assert result.returncode == 0, result.stderr
    return collections


@pytest.fixture(scope="module")
def outside(installed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory outside the checkout whose ansible.cfg knows only the installed collection."""
    directory = tmp_path_factory.mktemp("outside")
    (directory / "ansible.cfg").write_text(CFG.format(collections=installed))
    return directory


def test_every_role_playbook_and_data_file_is_in_the_collection(built: Path) -> None:
    with tarfile.open(built) as tar:
        names = set(tar.getnames())
    for role in ROLES:
        assert f"roles/{role}/tasks/main.yml" in names
    for path in (
        "galaxy.yml",
        "meta/runtime.yml",
        "versions.yml",
        "data/instance_types.yml",
        "data/aws_ofi_nccl.yml",
        "plugins/lookup/data_file.py",
        "plugins/inventory/ec2_fleet.py",
        # The decisions the filters import (controller code).
        "plugins/plugin_utils/policy.py",
        "playbooks/drift.yml",
    ):
        assert path in names or (path == "galaxy.yml" and "MANIFEST.json" in names), path
    # Nothing of the Python CLI, the lab, the tests or the link back to the checkout; of tests/, only the
    # ansible-test sanity ignore files, which ansible-test reads from the collection it checks.
    shipped_tests = {n for n in names if n.split("/")[0] == "tests"}
    assert shipped_tests <= {"tests", "tests/sanity"} | {
        n for n in shipped_tests if re.fullmatch(r"tests/sanity/ignore-[\d.]+\.txt", n)
    }, shipped_tests
    assert not {n for n in names if n.split("/")[0] in {"collections", "scripts", "molecule", "bench", "lab"}}


def _installed_doc(outside: Path, kind: str, name: str) -> dict[str, Any]:
    """`ansible-doc --json` of the installed collection's `kind` plugin `name`, run outside the checkout."""
    result = subprocess.run(
        [str(BIN / "ansible-doc"), "--json", "-t", kind, f"{FQCN}.{name}"],
        capture_output=True,
        text=True,
        check=False,
        cwd=outside,
        env={**os.environ, "ANSIBLE_CONFIG": str(outside / "ansible.cfg")},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    entry: dict[str, Any] = json.loads(result.stdout)[f"{FQCN}.{name}"]
    return entry


def test_installed_collection_documents_its_plugins(installed: Path, outside: Path) -> None:
    doc = _installed_doc(outside, "lookup", "data_file")["doc"]
    assert doc["short_description"] == "Path of one of the gpuforge collection's shared data files"
    # The installed copy answers, not this checkout.
    assert doc["filename"].startswith(str(installed))


def test_installed_collection_documents_its_inventory_plugin(installed: Path, outside: Path) -> None:
    entry = _installed_doc(outside, "inventory", "ec2_fleet")
    assert entry["doc"]["filename"].startswith(str(installed))
    assert entry["doc"]["options"]["plugin"]["choices"] == [f"{FQCN}.ec2_fleet"]
    # The inventory cache's options come from ansible-core's fragment.
    assert {"cache", "cache_plugin", "cache_timeout", "regions", "retry_mode"} <= set(entry["doc"]["options"])
    assert yaml.safe_load(entry["examples"])["plugin"] == f"{FQCN}.ec2_fleet"


def test_roles_name_each_other_by_fqcn() -> None:
    """A bare dependency name would resolve to a user's own role of that name."""
    for role in ROLES:
        meta = yaml.safe_load((REPO / "roles" / role / "meta/main.yml").read_text())
        for dep in meta.get("dependencies") or []:
            name = dep["role"] if isinstance(dep, dict) else dep
            assert name.startswith(f"{FQCN}."), f"{role} depends on {name}"


def test_playbooks_list_the_roles_others_depend_on_as_their_dependencies_do() -> None:
    """Ansible runs a role once per play only when every instance of it has the same tags, when and
    vars: a playbook entry with tags for a role that other roles depend on runs it a second time.
    Such roles tag their own tasks with their name instead, so `--tags`/`--skip-tags` still select them."""
    depended_on = set()
    for role in ROLES:
        meta = yaml.safe_load((REPO / "roles" / role / "meta/main.yml").read_text())
        for dep in meta.get("dependencies") or []:
            assert set(dep) == {"role"}, f"{role} depends on {dep} with more than its name"
            depended_on.add(dep["role"])
    assert {f"{FQCN}.nvidia_driver", f"{FQCN}.gpuforge_common"} <= depended_on
    for playbook in sorted((REPO / "playbooks").glob("*.yml")):
        for play in yaml.safe_load(playbook.read_text()) or []:
            for entry in play.get("roles") or []:
                if isinstance(entry, dict) and entry["role"] in depended_on:
                    assert set(entry) == {"role"}, f"{playbook.name}: {entry}"
    for name in depended_on:
        role = name.removeprefix(f"{FQCN}.")
        for task in yaml.safe_load((REPO / "roles" / role / "tasks/main.yml").read_text()):
            assert role in task.get("tags", []), f"{role}: {task['name']}"


def test_no_role_reaches_outside_itself() -> None:
    for path in (REPO / "roles").rglob("*.yml"):
        assert "role_path }}/.." not in path.read_text(), path


@pytest.mark.lab
def test_installed_collection_runs_on_a_lab_host(
    installed: Path, outside: Path, fleet_lab: dict[str, str]
) -> None:
    """Check mode of the installed gpuforge_common role, outside the checkout, on the lab."""
    (outside / "play.yml").write_text(PLAY)
    env = {**fleet_lab, "ANSIBLE_CONFIG": str(outside / "ansible.cfg")}
    inventory = str(REPO / "inventory/aws_ec2.yml")
    result = labtools.playbook(env, "-i", inventory, "--check", "play.yml", cwd=outside, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    own = installed / "ansible_collections" / GALAXY["namespace"] / GALAXY["name"] / "versions.yml"
    assert result.stdout.count(f"versions file: {own}") == 2, result.stdout[-3000:]
    assert "failed=0" in result.stdout
