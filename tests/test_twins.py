"""The bake on base-image twins: lab hosts booted from recorded descriptions of the real AMIs.

Each twin (tests/twins/*.yml, built by tests/twinlab.py, TEST DOUBLES) is built once per record
digest and booted as a 1-host lab, one twin at a time (a module fixture per twin). Every assertion
about a twin reads the same lab host; the bake itself is the real `gpuforge bake --local`.

Needs root, systemd-nspawn (the lab), gcc and dpkg-deb; CI installs them.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

import labtools
import twinlab
from labtools import BIN, LAB_MARKS, REPO, lab, on

TWIN_LAB = labtools.lab_name("twin")

pytestmark = [*LAB_MARKS, pytest.mark.slow]


@pytest.fixture(scope="module", params=twinlab.names())
def twin(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """A 1-host lab booted from the twin's image (built first if this record never was)."""
    name: str = request.param
    started = time.monotonic()
    image = twinlab.build(name)
    print(f"twin {name}: image {image} ready in {time.monotonic() - started:.1f}s")
    with lab(TWIN_LAB, 1, image=image) as info:
        yield {"name": name, "record": twinlab.load(name), "info": info, "host": info["hosts"][0]}


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


def test_twin_boots_as_the_recorded_image(twin: dict[str, Any]) -> None:
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


def test_ansible_sees_the_recorded_distribution(twin: dict[str, Any]) -> None:
    """The roles pick their per-OS constants from these facts: the twin must read as its Ubuntu."""
    env = twin["info"]["env"]
    result = subprocess.run(
        [
            str(BIN / "ansible"),
            "all",
            "-i",
            f"{twin['host']['ip']},",
            "-m",
            "ansible.builtin.setup",
            "-a",
            "filter=ansible_distribution*",
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={**os.environ, **env},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    version = twin["record"].record["os_release"]["VERSION_ID"]
    assert re.search(r"\bansible_distribution\"?: \"?Ubuntu\b", result.stdout), result.stdout
    assert re.search(rf"\bansible_distribution_version\"?: [\"']?{re.escape(version)}\b", result.stdout)
