"""Base-image twins in the lab: one host per twin, each booted from its recorded AMI description.

Each twin (tests/twins/*.yml, built by tests/twinlab.py, TEST DOUBLES) is built once per record
digest. One lab holds one host per twin (`labtools.reimage` swaps each host onto its twin's
image), and every assertion about a twin reads that host: the recorded driver, EFA, packages and
ParallelCluster marker, and the distribution Ansible sees (the roles choose their per-OS constants
from it).

Needs root, systemd-nspawn (the lab), gcc and dpkg-deb; CI installs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import labtools
import twinlab
from labtools import BIN, LAB_MARKS, REPO, lab, on, reimage

TWIN_LAB = labtools.lab_name("twin")
NAMES = twinlab.names()

pytestmark = [
    *LAB_MARKS,
    pytest.mark.slow,
]


def each(function: Callable[[str], Any]) -> dict[str, Any]:
    """`function(name)` for every twin at once; the results by twin name."""
    with ThreadPoolExecutor(max_workers=len(NAMES)) as pool:
        return dict(zip(NAMES, pool.map(function, NAMES), strict=True))


@pytest.fixture(scope="module")
def twins() -> Iterator[dict[str, dict[str, Any]]]:
    """One lab, one host per twin, each booted from its twin's image (built first if need be)."""
    started = time.monotonic()
    images = {name: twinlab.build(name) for name in NAMES}
    print(f"twin images ready in {time.monotonic() - started:.1f}s: {sorted(images.values())}")
    with lab(TWIN_LAB, len(NAMES)) as info:
        hosts = dict(zip(NAMES, info["hosts"], strict=True))
        each(lambda name: reimage(TWIN_LAB, hosts[name]["name"], images[name]))
        print(f"twin lab up in {time.monotonic() - started:.1f}s")
        yield {
            name: {
                "name": name,
                "record": twinlab.load(name),
                "image": image,
                "host": hosts[name],
                "info": info,
            }
            for name, image in images.items()
        }


def sh(twin: dict[str, Any], command: str, *, check: bool = True) -> str:
    return on(TWIN_LAB, twin["host"]["name"], command, check=check).strip()


def facts(twin: dict[str, Any]) -> dict[str, str]:
    """What the twin's host says about the recorded components, in one SSH round trip."""
    record: twinlab.Twin = twin["record"]
    packages = [
        package
        for component in ("dcgm", "gdrcopy", "nvidia_container_toolkit")
        for package in ((record.component(component) or {}).get("packages") or {})
    ]
    script = "; ".join(
        [
            '. /etc/os-release; echo "os=$ID $VERSION_ID"',
            'echo "smi=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader)"',
            # The nvidia_driver role's own probe for a driver installed outside apt.
            'echo "module=$(cat /sys/module/nvidia/version 2>/dev/null || modinfo -F version nvidia)"',
            'echo "efa=$(head -n 1 /opt/amazon/efa_installed_packages)"',
            'echo "marker=$(cat /opt/parallelcluster/.bootstrapped 2>/dev/null)"',
            *(f"echo \"pkg:{p}=$(dpkg-query --show --showformat='${{Version}}' {p})\"" for p in packages),
        ]
    )
    return dict(line.split("=", 1) for line in sh(twin, script).splitlines())


@pytest.mark.parametrize("name", NAMES)
def test_twin_boots_as_the_recorded_image(twins: dict[str, dict[str, Any]], name: str) -> None:
    twin = twins[name]
    record: twinlab.Twin = twin["record"]
    found = facts(twin)
    assert found["os"] == f"ubuntu {record.record['os_release']['VERSION_ID']}"
    driver = record.component("nvidia_driver")
    efa = record.component("efa_installer")
    assert driver is not None and efa is not None
    assert found["smi"] == found["module"] == driver["version"]
    assert found["efa"] == f"# EFA installer version: {efa['version']}"
    for component in ("dcgm", "gdrcopy", "nvidia_container_toolkit"):
        for package, version in ((record.component(component) or {}).get("packages") or {}).items():
            assert found[f"pkg:{package}"] == version
    pcluster = record.parallelcluster
    assert found["marker"] == (pcluster["marker"] if pcluster else "")


def test_ansible_sees_the_recorded_distributions(twins: dict[str, dict[str, Any]]) -> None:
    """The roles pick their per-OS constants from these facts: each twin must read as its Ubuntu."""
    env = next(iter(twins.values()))["info"]["env"]
    result = subprocess.run(
        [
            str(BIN / "ansible"),
            "all",
            "-i",
            ",".join(twin["host"]["ip"] for twin in twins.values()) + ",",
            "-m",
            "ansible.builtin.setup",
            "-a",
            "filter=ansible_distribution*",
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={**os.environ, **env, "ANSIBLE_STDOUT_CALLBACK": "json", "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    hosts = json.loads(result.stdout)["plays"][0]["tasks"][0]["hosts"]
    for twin in twins.values():
        facts = hosts[twin["host"]["ip"]]["ansible_facts"]
        expected = twin["record"].record["os_release"]["VERSION_ID"]
        assert (facts["ansible_distribution"], facts["ansible_distribution_version"]) == ("Ubuntu", expected)
