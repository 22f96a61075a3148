"""The dcgm role's exporter units as the role renders them (Ansible's own templating, the role's
defaults and vars, versions.yml): the production default needs no Docker, and every install method
connects dcgm-exporter to the host's nv-hostengine instead of starting an embedded one beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader  # type: ignore[import-untyped]
from ansible.template import Templar, trust_as_template  # type: ignore[import-untyped]

from localplay import REPO

ROLE = REPO / "roles/dcgm"
UNIT = "etc/systemd/system/dcgm-exporter.service.j2"
DROPIN = "etc/systemd/system/nvidia-dcgm-exporter.service.d/gpuforge.conf.j2"
HOST_ENGINE = "nvidia-dcgm.service"


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _trusted(value: Any) -> Any:
    """Strings from the role's files are templates, as Ansible treats the files it loads itself."""
    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, dict):
        return {key: _trusted(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_trusted(item) for item in value]
    return value


def render(template: str, **overrides: Any) -> str:
    """`template` (under the role's templates/) with the role's defaults and vars and versions.yml."""
    variables: dict[str, Any] = {}
    for path in (REPO / "versions.yml", ROLE / "defaults/main.yml", ROLE / "vars/main.yml"):
        variables.update(_trusted(_yaml(path)))
    variables.update(ansible_managed="managed by the test", **overrides)
    templar = Templar(loader=DataLoader(), variables=variables)
    rendered: str = templar.template(trust_as_template((ROLE / "templates" / template).read_text()))
    return rendered


def directives(unit: str) -> list[tuple[str, str]]:
    """(key, value) of every directive, continuation lines joined, comments dropped."""
    joined = unit.replace("\\\n", " ")
    pairs = []
    for line in joined.splitlines():
        if "=" in line and not line.lstrip().startswith(("#", "[")):
            key, value = line.split("=", 1)
            pairs.append((key.strip(), " ".join(value.split())))
    return pairs


def values(unit: str, key: str) -> list[str]:
    return [value for name, value in directives(unit) if name == key]


def rendered_units() -> dict[str, str]:
    """The exporter's unit text per install method, as the role writes it."""
    return {
        "package": render(DROPIN),
        "container": render(
            UNIT, dcgm_exporter_install_method="container", _dcgm_exporter_run_ref="img@sha256:1"
        ),
        "binary": render(UNIT, dcgm_exporter_install_method="binary"),
    }


def test_the_production_default_is_nvidias_package_which_needs_no_docker() -> None:
    """The ParallelCluster AMI has no Docker: the default method must not need it, nor the lab hide it."""
    assert _yaml(ROLE / "defaults/main.yml")["dcgm_exporter_install_method"] == "package"
    spec = _yaml(ROLE / "meta/argument_specs.yml")["argument_specs"]["main"]["options"]
    assert spec["dcgm_exporter_install_method"]["default"] == "package"
    assert "package" in spec["dcgm_exporter_install_method"]["choices"]
    lab = _yaml(REPO / "inventory/group_vars/gpuforge_lab/artifacts.yml")
    assert not {name for name in lab if name.startswith("dcgm_")}, "the lab must run the production default"
    package_tasks = (ROLE / "tasks/exporter_package.yml").read_text()
    assert "docker" not in package_tasks.lower()


@pytest.mark.parametrize("method", ["package", "container", "binary"])
def test_every_method_connects_to_the_hosts_engine(method: str) -> None:
    """No embedded host engine beside nvidia-dcgm (NVIDIA/dcgm-exporter#7): -r to the host's, after it."""
    unit = rendered_units()[method]
    commands = [command for command in values(unit, "ExecStart") if command]
    assert len(commands) == 1
    args = commands[0].split()
    assert args[args.index("--remote-hostengine-info") + 1] == "localhost:5555"
    assert args[args.index("--address") + 1] == ":9400"
    assert args[args.index("--collectors") + 1] == "/etc/dcgm-exporter/gpuforge-counters.csv"
    assert HOST_ENGINE in " ".join(values(unit, "Requires")).split()
    assert HOST_ENGINE in " ".join(values(unit, "After")).split()


def test_the_package_unit_is_changed_through_a_drop_in_that_replaces_its_command_line() -> None:
    """An empty ExecStart= first: systemd would otherwise refuse a second ExecStart for a simple service,
    and the package's own command line (no -r) must not run."""
    dropin = rendered_units()["package"]
    assert values(dropin, "ExecStart")[0] == ""
    assert values(dropin, "ExecStart")[1].split()[0] == "/usr/bin/dcgm-exporter"
    role_vars = _yaml(ROLE / "vars/main.yml")
    assert role_vars["_dcgm_exporter_dropin"].startswith(
        f"/etc/systemd/system/{role_vars['_dcgm_exporter_package_unit']}.d/"
    )
    assert "[Install]" not in dropin


def test_the_container_shares_the_hosts_network_to_reach_its_engine() -> None:
    command = values(rendered_units()["container"], "ExecStart")[0].split()
    assert command[command.index("--network") + 1] == "host"
    assert "--publish" not in command
    assert "docker.service" in values(rendered_units()["container"], "Requires")


def test_a_listen_address_and_another_engine_reach_every_method() -> None:
    for template, extra in ((DROPIN, {}), (UNIT, {"dcgm_exporter_install_method": "binary"})):
        unit = render(
            template,
            dcgm_exporter_listen_address="10.0.0.5",
            dcgm_exporter_remote_hostengine="[::1]:5556",
            **extra,
        )
        command = next(value for value in values(unit, "ExecStart") if value).split()
        assert command[command.index("--address") + 1] == "10.0.0.5:9400"
        assert command[command.index("--remote-hostengine-info") + 1] == "[::1]:5556"


def test_dcgm_is_installed_with_its_recommends_as_nvidia_documents() -> None:
    """NVIDIA installs datacenter-gpu-manager-4-cuda<N> with --install-recommends (DCGM installation
    guide); the one package it recommends, libnuma1 (NVIDIA/DCGM cmake/packaging.cmake at v4.6.0, lines
    161-175), is what DCGM's diagnostics load to bind to a NUMA node: `dcgmi diag`'s PCIe test fails
    without it (nvvs/plugin_src/pcie/PcieMain.cpp line 626). The exporter package keeps to its Depends."""
    install = _yaml(ROLE / "tasks/install.yml")
    block = next(task for task in install if "block" in task)["block"]
    apt = next(task["ansible.builtin.apt"] for task in block if "ansible.builtin.apt" in task)
    assert apt["install_recommends"] is True
    package = next(
        task["ansible.builtin.apt"]
        for task in _yaml(ROLE / "tasks/exporter_package.yml")
        if "ansible.builtin.apt" in task
    )
    assert package["install_recommends"] is False
