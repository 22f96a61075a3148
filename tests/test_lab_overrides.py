"""The lab runs the roles' production defaults: its only overrides say where artifacts come from (issue 27).

Every variable the lab sets for the roles, wherever it is set (the lab group's group_vars, the
extra vars of a lab bake from gpuforge_lab.bench.labrun.write_bake_vars and tests/torchdouble.bake_vars,
the Molecule scenarios' inventories and converge plays), must be

- an ARTIFACT SOURCE in ALLOWED below: a role variable that exists in that role's
  meta/argument_specs.yml and whose name says it is a URL, hash, key or repository
  (SOURCE_SUFFIXES), or a gpuforge_lab_* helper those are built from;
- the one TEST-DOUBLE switch gpuforge_lab_hardware_absent, read by the health role only;
- in a Molecule inventory only, a host's identity that the production inventory composes from EC2
  (inventory/aws_ec2.yml compose: gpuforge_instance_type, gpuforge_queue, ...), since Molecule's
  inventory stands in for it.

Anything else (a version, a build flavour, an installer flag, an install method) is a default the
lab would be testing instead of production's, and fails here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import torchdouble
from gpuforge_lab.bench import labrun

REPO = Path(__file__).resolve().parents[1]
GROUP_VARS = REPO / "inventory/group_vars/gpuforge_lab"
SOURCES = REPO / labrun.FIXTURE_VARS
TEST_DOUBLE_SWITCH = "gpuforge_lab_hardware_absent"

# What an artifact-source variable's name ends with. The brief's list, plus _gpg_fingerprint (the efa
# role's signing-key fingerprint, efa_installer_gpg_fingerprint) and _key_source/_key_file (where the
# Molecule slurm scenario's fixture munge key comes from: a file instead of SSM, which it lacks).
SOURCE_SUFFIXES = (
    "_url",
    "_url_base",
    "_release_base",
    "_sha256",
    "_sha512",
    "_key_fingerprint",
    "_gpg_fingerprint",
    "_key_url",
    "_repo_url",
    "_key_source",
    "_key_file",
)
# The explicit allow-list: every role variable the lab may set, by role.
ALLOWED = {
    "efa": {"efa_installer_url_base", "efa_installer_sha256", "efa_installer_gpg_fingerprint"},
    "aws_ofi_nccl": {"aws_ofi_nccl_release_base", "aws_ofi_nccl_source_sha512", "aws_ofi_nccl_source_sha256"},
    "nccl_tests": {"nccl_tests_url_base", "nccl_tests_source_sha256"},
    "pytorch": {"pytorch_wheel_url", "pytorch_wheel_sha256"},
    "nvidia_driver": {
        "nvidia_driver_cuda_repo_url",
        "nvidia_driver_cuda_repo_key_url",
        "nvidia_driver_cuda_repo_key_fingerprint",
    },
    "nvidia_container_toolkit": {
        "nvidia_container_toolkit_repo_url",
        "nvidia_container_toolkit_repo_key_url",
        "nvidia_container_toolkit_repo_key_fingerprint",
    },
    "dcgm": {"dcgm_exporter_binary_url", "dcgm_exporter_binary_sha256"},
    "slurm": {"slurm_munge_key_source", "slurm_munge_key_file"},
}
ALLOWED_NAMES = {name: role for role, names in ALLOWED.items() for name in names}
# Where production code lives: only the health role may read the test-double switch, and no code
# reads the other gpuforge_lab_* helpers (they only build the artifact sources above).
PRODUCTION = ("roles", "playbooks", "plugins", "packer", "scripts/gpuforge", "site.yml", "data")


def _options(role: str) -> dict[str, Any]:
    specs = yaml.safe_load((REPO / "roles" / role / "meta/argument_specs.yml").read_text())
    options: dict[str, Any] = {}
    for entry in specs["argument_specs"].values():
        options.update(entry.get("options") or {})
    return options


def _composed_identity() -> set[str]:
    """The host variables the production inventory composes from EC2 (inventory/aws_ec2.yml)."""
    inventory = yaml.safe_load((REPO / "inventory/aws_ec2.yml").read_text())
    return {name for name in inventory["compose"] if name.startswith("gpuforge_")}


def offences(variables: dict[str, Any], where: str, inventory: bool = False) -> list[str]:
    """Why each variable in `variables` (set at `where`) is not an allowed lab override."""
    found = []
    for name in sorted(variables):
        if name.startswith("gpuforge_lab_") or name in ALLOWED_NAMES:
            continue
        if inventory and name in _composed_identity():
            continue
        found.append(f"{where}: {name}={variables[name]!r} is not an artifact source")
    return found


def _vars_files(play: dict[str, Any], base: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    for name in play.get("vars_files") or []:
        path = (base / name).resolve()
        yield str(path.relative_to(REPO)), yaml.safe_load(path.read_text()) or {}


def _role_vars(play: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for role in play.get("roles") or []:
        if isinstance(role, dict):
            found.update(role.get("vars") or {})
            found.update({k: v for k, v in role.items() if k not in ("role", "name", "vars", "tags", "when")})
    for task in play.get("tasks") or []:
        if any(key.endswith(("include_role", "import_role")) for key in task):
            found.update(task.get("vars") or {})
    return found


def molecule_settings() -> list[tuple[str, dict[str, Any], bool]]:
    """(where, variables, is-inventory) for every scenario's inventory and converge plays."""
    settings: list[tuple[str, dict[str, Any], bool]] = []
    for scenario in sorted((REPO / "molecule").glob("*/molecule.yml")):
        where = str(scenario.relative_to(REPO))
        inventory = (yaml.safe_load(scenario.read_text()).get("provisioner") or {}).get("inventory") or {}
        for kind in ("host_vars", "group_vars"):
            for target, variables in (inventory.get(kind) or {}).items():
                settings.append((f"{where} {kind} {target}", variables or {}, True))
        for directory in ("inventory/group_vars", "inventory/host_vars", "group_vars", "host_vars"):
            for path in sorted((scenario.parent / directory).rglob("*.yml")):
                settings.append((str(path.relative_to(REPO)), yaml.safe_load(path.read_text()) or {}, True))
        converge = scenario.parent / "converge.yml"
        for index, play in enumerate(yaml.safe_load(converge.read_text()) if converge.exists() else []):
            where = f"{converge.relative_to(REPO)} play {index}"
            settings.append((f"{where} vars", play.get("vars") or {}, False))
            settings.append((f"{where} role vars", _role_vars(play), False))
            settings += [
                (f"{where} vars_files {name}", found, False)
                for name, found in _vars_files(play, converge.parent)
            ]
    return settings


@pytest.fixture
def bake_extra_vars(tmp_path: Path) -> dict[str, dict[str, Any]]:
    """The extra vars a lab bake gets, from both writers (a lab serving the PyTorch double)."""
    artifacts = tmp_path / "artifacts"
    wheel = torchdouble.build(artifacts / "test-doubles")
    record = {"torch_double": {"file": wheel.name, "sha256": torchdouble.sha256(wheel)}}
    (artifacts / "fixture.json").write_text(json.dumps(record))
    (tmp_path / "labrun").mkdir()
    (tmp_path / "torch").mkdir()
    return {
        "labrun.write_bake_vars": yaml.safe_load(labrun.write_bake_vars(tmp_path / "labrun").read_text()),
        "torchdouble.bake_vars": yaml.safe_load(
            torchdouble.bake_vars(str(artifacts), tmp_path / "torch").read_text()
        ),
    }


def test_the_lab_group_has_one_file_of_overrides() -> None:
    assert sorted(p.name for p in GROUP_VARS.iterdir()) == [SOURCES.name]


def test_the_one_file_sets_only_artifact_sources_and_the_test_double_switch() -> None:
    variables = yaml.safe_load(SOURCES.read_text())
    assert offences(variables, str(SOURCES.relative_to(REPO))) == []
    assert variables[TEST_DOUBLE_SWITCH] is True


def test_a_lab_bake_gets_only_the_artifact_sources(bake_extra_vars: dict[str, dict[str, Any]]) -> None:
    sources = yaml.safe_load(SOURCES.read_text())
    for writer, variables in bake_extra_vars.items():
        assert offences(variables, writer) == []
        assert variables == sources, f"{writer} hands over other variables than {SOURCES.name}"


def test_molecule_scenarios_set_only_artifact_sources() -> None:
    found = [
        o
        for where, variables, inventory in molecule_settings()
        for o in offences(variables, where, inventory)
    ]
    assert found == []


@pytest.mark.parametrize("name", sorted(ALLOWED_NAMES))
def test_each_allowed_variable_is_a_source_variable_of_its_role(name: str) -> None:
    role = ALLOWED_NAMES[name]
    assert name.startswith(f"{role}_")
    assert name.endswith(SOURCE_SUFFIXES), f"{name} does not name a URL, hash, key or repository"
    assert name in _options(role), f"{name} is not in roles/{role}/meta/argument_specs.yml"


def test_only_the_health_role_reads_the_test_double_switch_and_no_code_reads_lab_helpers() -> None:
    readers: dict[str, set[str]] = {}
    pattern = re.compile(r"\bgpuforge_lab_[a-z_]+")
    for top in PRODUCTION:
        base = REPO / top
        files = [base] if base.is_file() else [p for p in base.rglob("*") if p.is_file()]
        for path in files:
            if "__pycache__" in path.parts or path.suffix in (".md", ".pyc"):
                continue
            for name in pattern.findall(path.read_text(errors="replace")):
                readers.setdefault(name, set()).add(str(path.relative_to(REPO)))
    assert set(readers) <= {TEST_DOUBLE_SWITCH}, {k: v for k, v in readers.items() if k != TEST_DOUBLE_SWITCH}
    assert readers.get(TEST_DOUBLE_SWITCH, set()) and all(
        path.startswith("roles/health/") for path in readers[TEST_DOUBLE_SWITCH]
    ), readers.get(TEST_DOUBLE_SWITCH)


def test_the_check_catches_what_the_lab_used_to_override() -> None:
    """The overrides the lab had before issue 27 are each refused (so the checks above can fail)."""
    before = {
        "efa_installer_skip_kmod": True,
        "pytorch_version": "2.13.0",
        "pytorch_cuda_build": "cpu",
        "dcgm_exporter_install_method": "binary",
        "slurm_cluster_name": "molecule",
    }
    assert len(offences(before, "before")) == len(before)
    assert offences({"gpuforge_instance_type": "p5.48xlarge"}, "inventory", inventory=True) == []
    assert offences({"gpuforge_instance_type": "p5.48xlarge"}, "converge") != []
