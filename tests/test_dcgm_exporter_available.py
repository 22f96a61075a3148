"""The dcgm role's check that NVIDIA's repository offers the exact dcgm-exporter package version
(roles/dcgm/tasks/exporter_available.yml) before it changes anything on the node.

It is the check nvidia_driver makes for its pin (roles/nvidia_apt_repo/tasks/available.yml): apt-cache
madison is a test double here, a script printing the versions a case's repository offers, put first on
the PATH of the tasks file run on the control host.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuforge import versions
from localplay import REPO, record, run_cases

ROLE = REPO / "roles/dcgm"
PINS = versions.load().components["dcgm_exporter"]
PACKAGE_VERSION = str(PINS["package_version"])
CHECK_MODE_FRESH = "check-mode-without-the-repository"
CUDA_REPO = "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64  Packages"

FAKE_DPKG_QUERY = """#!/bin/sh
# TEST DOUBLE of dpkg-query --show --showformat=FORMAT PACKAGE: FORMAT with ${{db:Status-Abbrev}} and
# ${{Version}} filled from the case's package record ("<status abbreviation> <version>"), or not known to
# dpkg (exit 1). dpkg prints a version for a package removed with its configuration files left ("rc").
here=$(dirname "$0")
[ -s "$here/installed" ] || {{ echo "dpkg-query: no packages found matching $3" >&2; exit 1; }}
read -r status version < "$here/installed"
format=${{2#--showformat=}}
printf %s "$format" | sed -e "s/\\${{db:Status-Abbrev}}/$status /" -e "s/\\${{Version}}/$version/"
"""

FAKE_APT_CACHE = """#!{python}
# TEST DOUBLE of apt-cache: 'madison PACKAGE' prints the versions this case's repository offers.
import os, sys
here = os.path.dirname(os.path.abspath(__file__))
if sys.argv[1:2] != ["madison"]:
    sys.exit("fake apt-cache: unexpected " + " ".join(sys.argv[1:]))
for version in open(os.path.join(here, "offered")).read().split():
    print(f"{{sys.argv[2]}} | {{version}} | {repo}")
"""

# case -> (versions of datacenter-gpu-manager-exporter the repository offers, its dpkg status and version)
CASES: dict[str, tuple[list[str], str]] = {
    "offers-the-pin": (["4.8.4.3955-1", PACKAGE_VERSION, "4.8.2-1"], ""),
    # A build of the same exporter release with another number is not the pinned package.
    "offers-another-build-of-the-release": ([PACKAGE_VERSION.replace("-1", ".4100-1"), "4.8.2-1"], ""),
    # The two other namings of 4.10.0 NVIDIA might use (its DCGM packages carry an epoch): refused, named.
    "offers-a-numbered-build": (["4.10.0.4321-1"], ""),
    "offers-the-release-with-an-epoch": (["1:4.10.0-1"], ""),
    "offers-nothing": ([], ""),
    # The pin is already installed: nothing is asked of the repositories (NVIDIA may drop old builds).
    "installed-pin-needs-no-repository": ([], f"ii {PACKAGE_VERSION}"),
    "installed-older-build-still-checked": ([], "ii 4.8.2-1"),
    # Removed with its configuration files left: dpkg-query still shows the version; it is not installed.
    "removed-pin-still-checked": ([], f"rc {PACKAGE_VERSION}"),
    # Check mode on a fresh host: the CUDA repository's sources file is not written yet, madison lists
    # nothing; the check is reported, not failed.
    CHECK_MODE_FRESH: ([], ""),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("exporter-available")
    cases: dict[str, list[dict[str, Any]]] = {}
    role_vars = yaml.safe_load((ROLE / "vars/main.yml").read_text())
    for case, (offered, installed) in CASES.items():
        directory = root / case
        directory.mkdir()
        (directory / "offered").write_text(" ".join(offered) + "\n")
        (directory / "installed").write_text(installed)
        if case != CHECK_MODE_FRESH:
            # The CUDA repository's deb822 file, as nvidia_apt_repo writes it (only its presence is read).
            (directory / "nvidia-cuda.sources").write_text("# TEST FIXTURE\n")
        (directory / "dpkg-query").write_text(FAKE_DPKG_QUERY.format())
        (directory / "dpkg-query").chmod(0o755)
        fake = directory / "apt-cache"
        fake.write_text(FAKE_APT_CACHE.format(python=sys.executable, repo=CUDA_REPO))
        fake.chmod(0o755)
        cases[case] = [
            {
                "environment": {"PATH": f"{directory}:{Path(sys.executable).parent}:/usr/bin:/bin"},
                "block": [
                    {
                        # The tasks file alone: the role's dependencies (the driver) must not run here.
                        "ansible.builtin.include_tasks": str(ROLE / "tasks/exporter_available.yml"),
                        "vars": {
                            "_dcgm_exporter_package": role_vars["_dcgm_exporter_package"],
                            "dcgm_exporter_package_version": PACKAGE_VERSION,
                            "nvidia_apt_repo_sources_dir": str(directory),
                        },
                    },
                    record(case, "passed"),
                ],
            }
        ]
    return run_cases(root, cases, {"gpuforge_versions": {}, "gpuforge_common_imds_enabled": False})


@pytest.mark.parametrize("case", ["offers-the-pin", "installed-pin-needs-no-repository", CHECK_MODE_FRESH])
def test_the_pinned_package_version_passes(outcomes: dict[str, Any], case: str) -> None:
    assert outcomes[case] == "passed"


@pytest.mark.parametrize(
    "case",
    [
        "offers-another-build-of-the-release",
        "offers-a-numbered-build",
        "offers-the-release-with-an-epoch",
        "offers-nothing",
        "installed-older-build-still-checked",
        "removed-pin-still-checked",
    ],
)
def test_a_repository_without_the_exact_version_stops_the_role_naming_what_it_offers(
    outcomes: dict[str, Any], case: str
) -> None:
    message = " ".join(str(outcomes[case]).split())
    assert message != "passed", f"{case}: the role went on without {PACKAGE_VERSION} in the repository"
    assert f"datacenter-gpu-manager-exporter {PACKAGE_VERSION} is not in the configured apt" in message
    assert f"they offer: {', '.join(CASES[case][0]) or 'nothing'}" in message
    assert "dcgm_exporter_package_version" in message and "nothing was installed" in message


def test_the_check_runs_before_the_role_changes_anything() -> None:
    """main.yml checks the exporter package right after validating the inputs, before DCGM is installed
    (install.yml) or the exporter's drop-in and package are written (exporter.yml)."""
    imports = [
        task.get("ansible.builtin.import_tasks")
        for task in yaml.safe_load((ROLE / "tasks/main.yml").read_text())
        if "ansible.builtin.import_tasks" in task
    ]
    assert imports[:3] == ["validate.yml", "exporter_available.yml", "install.yml"]
    available = next(
        task
        for task in yaml.safe_load((ROLE / "tasks/main.yml").read_text())
        if task.get("ansible.builtin.import_tasks") == "exporter_available.yml"
    )
    # Configure-only runs install the exporter package too (exporter.yml is tagged configure).
    assert set(available["tags"]) == {"install", "configure"}


def test_the_role_installs_exactly_the_checked_version() -> None:
    """No version chosen from what the repository lists: the one versions.yml pins, checked above."""
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    pinned = "{{ gpuforge_versions.dcgm_exporter.package_version }}"
    assert defaults["dcgm_exporter_package_version"] == pinned
    package_tasks = yaml.safe_load((ROLE / "tasks/exporter_package.yml").read_text())
    install = next(task for task in package_tasks if "ansible.builtin.apt" in task)
    assert install["ansible.builtin.apt"]["name"] == (
        "{{ _dcgm_exporter_package }}={{ dcgm_exporter_package_version }}"
    )
    assert "madison" not in (ROLE / "tasks/exporter_package.yml").read_text()
