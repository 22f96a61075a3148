"""Repository-level contracts: pinned collections, the versions manifest, ansible.cfg."""

from __future__ import annotations

import configparser
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_collections.gpuforge.gpu.plugins.plugin_utils.versions import VERSIONS_HASH_TAG

import sourcefile
from gpuforge import versions
from gpuforge.errors import UserError

REPO = Path(__file__).resolve().parents[1]
versions_filters = sourcefile.load("versions_filters", "plugins/filter/versions.py")


def test_requirements_yml_is_satisfied_by_the_pinned_ansible_package() -> None:
    """Every collection in requirements.yml is installed, at exactly that version, with no Galaxy access."""
    wanted = {
        c["name"]: c["version"]
        for c in yaml.safe_load((REPO / "requirements.yml").read_text())["collections"]
    }
    out = subprocess.run(
        ["ansible-galaxy", "collection", "list", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    installed: dict[str, str] = {}
    for path_collections in json.loads(out.stdout).values():
        for name, info in path_collections.items():
            installed.setdefault(name, info["version"])
    assert {name: installed.get(name) for name in wanted} == wanted


def test_ansible_cfg_points_at_this_repository() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "ansible.cfg")
    # Roles come from the collection this checkout is (./collections links back here), by FQCN only.
    assert "roles_path" not in cfg["defaults"]
    assert cfg["defaults"]["collections_path"].split(":")[0] == "./collections"
    assert (REPO / "collections/ansible_collections/gpuforge/gpu").resolve() == REPO
    assert cfg["defaults"]["inventory"] == "./inventory/ec2_fleet.yml"
    assert cfg["ssh_connection"].getboolean("pipelining")
    assert cfg["defaults"]["fact_caching"] == "jsonfile"
    assert int(cfg["defaults"]["forks"]) > 5


def test_a_play_without_the_ec2_inventory_does_not_import_boto3(tmp_path: Path) -> None:
    """Only an inventory file that names amazon.aws.aws_ec2 loads it (through `auto`), not every run."""
    play = tmp_path / "play.yml"
    play.write_text("- hosts: localhost\n  gather_facts: false\n  tasks: []\n")
    playbook = shutil.which("ansible-playbook")
    assert playbook is not None
    run = subprocess.run(
        [sys.executable, "-X", "importtime", playbook, "-i", "localhost,", str(play)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr
    assert "| botocore" not in run.stderr


def test_versions_manifest_loads_and_tags_every_component() -> None:
    manifest = versions.load()
    tags = manifest.image_tags()
    assert tags[VERSIONS_HASH_TAG] == manifest.digest
    assert {k.removeprefix(versions.TAG_PREFIX) for k in tags if k != VERSIONS_HASH_TAG} == set(
        manifest.components
    )
    assert all(len(v) <= 256 for v in tags.values())  # EC2's tag value limit.


@pytest.mark.parametrize("bad", ["latest", ">=1.2", "1.x", "2", "~1.2", ""])
def test_versions_manifest_refuses_inexact_pins(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "versions.yml"
    path.write_text(f'gpuforge_versions:\n  nccl:\n    version: "{bad}"\n')
    with pytest.raises(UserError, match="pin an exact version"):
        versions.load(path)


def test_versions_hash_changes_with_any_pin(tmp_path: Path) -> None:
    base = versions.load()
    path = tmp_path / "versions.yml"
    changed = {name: dict(pins) for name, pins in base.components.items()}
    first = next(iter(changed))
    changed[first]["version"] = changed[first]["version"] + ".1"
    path.write_text(yaml.safe_dump({"gpuforge_versions": changed}))
    assert versions.load(path).digest != base.digest


def _broken_pins() -> tuple[dict[str, Any], dict[str, Any], str]:
    """versions.yml with one component per rule broken: (its data, the broken entries, one good name)."""
    data = yaml.safe_load((REPO / "versions.yml").read_text())
    pins = data["gpuforge_versions"]
    good, *others = sorted(pins)
    broken = {
        others[0]: {"version": "latest"},  # not exact
        others[1]: {"version": 12.8},  # a YAML float, not a version string
        others[2]: {"floor": "999.0"},  # floor above the pin
        others[3]: {"provided_by": "someone"},
        others[4]: {"floor_reason": " "},
    }
    for name, change in broken.items():
        pins[name].update(change)
    return data, broken, good


def test_the_roles_filter_names_each_pin_the_policy_forbids() -> None:
    """load_data.yml's rules are the CLI's (plugins/plugin_utils/versions.py): each offender named."""
    data, broken, _ = _broken_pins()
    assert versions_filters.versions_bad_pins(data["gpuforge_versions"]) == sorted(broken)
    assert (
        versions_filters.versions_bad_pins(
            yaml.safe_load((REPO / "versions.yml").read_text())["gpuforge_versions"]
        )
        == []
    )


@pytest.mark.parametrize(
    ("field", "number", "message"),
    [("version", 999.5, "pin an exact version"), ("floor", 0.1, "needs a 'floor'")],
)
def test_the_cli_refuses_a_yaml_number_as_a_pin_as_the_roles_do(
    tmp_path: Path, field: str, number: float, message: str
) -> None:
    """12.8 unquoted is a float: the roles always refused it; the CLI, which read it as "12.8", now too."""
    data = yaml.safe_load((REPO / "versions.yml").read_text())
    name = sorted(data["gpuforge_versions"])[0]
    data["gpuforge_versions"][name][field] = number
    path = tmp_path / "versions.yml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(UserError, match=f"{name}.*{message}"):
        versions.load(path)


def test_the_roles_hash_the_pins_as_the_cli() -> None:
    """The roles hash the pins as include_vars loads them; the digest is the CLI's, field for field."""
    raw = yaml.safe_load((REPO / "versions.yml").read_text())["gpuforge_versions"]
    assert versions_filters.versions_digest(raw) == versions.load().digest
    task = (REPO / "roles/gpuforge_common/tasks/load_data.yml").read_text()
    assert "gpuforge_versions | gpuforge.gpu.versions_digest" in task
    assert "gpuforge_versions | gpuforge.gpu.versions_bad_pins" in task
    assert "regex" not in task and "hash('sha256')" not in task  # no Jinja copy of the rules


def test_aws_ofi_nccl_pin_is_the_release_the_pinned_efa_installer_bundles() -> None:
    """A bake on the DLAMI then uses the installer's plugin; building is only the fallback."""
    pins = versions.load().components
    assert pins["aws_ofi_nccl"]["version"] == pins["efa_installer"]["bundled_aws_ofi_nccl"]


@pytest.mark.parametrize(
    ("component", "field", "digits"),
    [("efa_installer", "sha256", 64), ("aws_ofi_nccl", "source_sha512", 128)],
)
def test_downloaded_components_pin_a_hash(component: str, field: str, digits: int) -> None:
    """Every tarball a role downloads and runs has its hash in versions.yml (no unverified fallback).

    aws-ofi-nccl's release notes publish a sha512 of the release tarball, and no sha256.
    """
    sha = versions.load().components[component].get(field, "")
    assert len(sha) == digits and all(c in "0123456789abcdef" for c in sha)


def test_roles_embed_no_plugins() -> None:
    """Roles run from the collection (gpuforge.gpu.<role>), where Ansible loads no plugins from a
    role's own filter_plugins/, lookup_plugins/ or library/: those live in plugins/ instead."""
    roles = REPO / "roles"
    embedded = [
        str(p.relative_to(REPO))
        for p in roles.glob("*/*")
        if p.is_dir() and (p.name.endswith("_plugins") or p.name in ("library", "module_utils"))
    ]
    assert embedded == []


def test_the_disable_lookups_deprecation_is_amazon_aws_s_not_ours() -> None:
    """Every ansible command prints it while the pinned amazon.aws passes `disable_lookups` (issue #2786).

    Fails once the pinned ansible bundles an amazon.aws with the fix (PR #2864): then drop the note
    in inventory/aws_ec2.yml. Nothing in this repository passes the argument.
    """
    import ansible_collections.amazon.aws as amazon_aws

    upstream = Path(next(iter(amazon_aws.__path__))) / "plugins/plugin_utils/inventory.py"
    assert "disable_lookups=False" in upstream.read_text()
    assert "issues/2786" in (REPO / "inventory/aws_ec2.yml").read_text()
    ours = [REPO / d for d in ("roles", "plugins", "playbooks", "scripts", "inventory")]

    def code_lines(path: Path) -> str:
        return "\n".join(
            line
            for line in path.read_text(errors="replace").splitlines()
            if not line.lstrip().startswith("#")
        )

    offenders = [
        p
        for d in ours
        for p in d.rglob("*")
        if p.is_file() and p.suffix in {".py", ".yml"} and "disable_lookups" in code_lines(p)
    ]
    assert offenders == []


def test_the_roles_refuse_each_pin_the_policy_forbids_and_name_it(tmp_path: Path) -> None:
    """gpuforge_common's load_data.yml applies gpuforge.versions' policy: every offending component named."""
    data, broken, good = _broken_pins()
    versions = tmp_path / "versions.yml"
    versions.write_text(yaml.safe_dump(data))
    extra = tmp_path / "extra.yml"
    extra.write_text(yaml.safe_dump({"gpuforge_common_versions_file": str(versions)}))
    play = tmp_path / "play.yml"
    play.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.include_role:\n"
        "        {name: gpuforge.gpu.gpuforge_common, tasks_from: load_data.yml}\n"
    )
    run = subprocess.run(
        ["ansible-playbook", "-i", "localhost,", str(play), "-e", f"@{extra}"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert run.returncode == 2, run.stdout
    named = run.stdout.split("versions.yml: ", 1)[1].split(": each needs", 1)[0]
    assert sorted(named.replace("\n", " ").split(", ")) == sorted(broken)
    assert good not in named
