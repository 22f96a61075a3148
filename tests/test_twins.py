"""Base-image twins in the lab, and the bake on them.

Each twin (tests/twins/*.yml, built by tests/twinlab.py, TEST DOUBLES) is built once per record
digest. One lab holds one host per twin (`labtools.reimage` swaps each host onto its twin's
image). The hosts are baked at the same time, each by its own real `gpuforge-lab bake` (the
lab shares two cores: three bakes side by side take far less than three in a row), relaunched
(new host keys, as an instance of the sanitized image gets) and baked once more, which must change
nothing. Every other assertion reads those two bakes. The cases that need a changed host (a
component below its floor, a pin below the installed release) run one role, on one twin, after.

Needs root, systemd-nspawn (the lab), gcc, dpkg-deb and packer; CI installs them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import labtools
import torchdouble
import twinlab
from gpuforge import versions
from gpuforge_lab import host, state
from gpuforge_lab.bench import labrun
from labtools import BIN, LAB_MARKS, REPO, gpuforge_lab, lab, on, playbook, recap, reimage, relaunch

TWIN_LAB = labtools.lab_name("twin")
NAMES = twinlab.names()
# The twin the role-level cases (below the floor, pin below the installed release) change.
CHANGED_TWIN = "dlami-ubuntu2204"
needs_bake = pytest.mark.skipif(
    shutil.which("packer") is None, reason="the bake needs packer (apt-get install packer)"
)

pytestmark = [
    *LAB_MARKS,
    pytest.mark.slow,
]


# The packages a role installs where the component it owns is below its floor (the dcgm role: core and
# the CUDA-flavoured package, roles/dcgm/vars/main.yml, for the CUDA of versions.yml); other components
# replace every recorded package.
ROLE_PACKAGES = {
    "dcgm": {
        "datacenter-gpu-manager-4-core",
        f"datacenter-gpu-manager-4-cuda{versions.load().version('cuda').split('.')[0]}",
    }
}


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
        for component in twinlab.PACKAGED
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
    for component in twinlab.PACKAGED:
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


# The bake: `gpuforge-lab bake` on every twin, then the same bake again on the relaunched hosts.

# Packer prefixes what the ansible provisioner prints ("[  1m02s]     null.lab: ..."); without the
# prefix the lines are ansible-playbook's own, PLAY RECAP included.
_PACKER_PREFIX = re.compile(r"^\[\s*\d+m\d+s\]\s+(?:null\.lab: )?", re.MULTILINE)


def bake_recap(result: subprocess.CompletedProcess[str]) -> dict[str, int]:
    stats = recap(_PACKER_PREFIX.sub("", result.stderr))
    assert len(stats) == 1, result.stderr[-4000:]
    return next(iter(stats.values()))


def bake(twin: dict[str, Any], work: Path, lab_vars: Path) -> subprocess.CompletedProcess[str]:
    record: twinlab.Twin = twin["record"]
    started = time.monotonic()
    result = gpuforge_lab(
        "bake",
        "--flavor",
        record.flavor,
        "--lab",
        TWIN_LAB,
        "--host",
        twin["host"]["name"],
        "--work-dir",
        str(work),
        "--extra-vars",
        str(lab_vars),
        env={"GPUFORGE_LAB_ARTIFACTS": twin["info"]["env"]["GPUFORGE_LAB_ARTIFACTS"]},
        without_aws=True,
        timeout=1500,
    )
    print(f"twin {twin['name']}: bake in {time.monotonic() - started:.1f}s (exit {result.returncode})")
    return result


def host_tree(twin: dict[str, Any]) -> tuple[Path, Path]:
    """The host's writable layer and its merged root, read from the control host."""
    lab_state = state.load(TWIN_LAB)
    assert lab_state is not None
    (node,) = [h for h in lab_state.hosts if h.name == twin["host"]["name"]]
    directory = host.host_dir(lab_state, node)
    return directory / "upper", directory / "rootfs"


def dpkg_versions(root: Path) -> dict[str, str]:
    """Installed package versions from the dpkg database of a tree."""
    found: dict[str, str] = {}
    for stanza in (root / "var/lib/dpkg/status").read_text().split("\n\n"):
        lines = [line for line in stanza.splitlines() if ": " in line and not line[0].isspace()]
        fields = dict(line.split(": ", 1) for line in lines)
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            found[fields["Package"]] = fields["Version"]
    return found


@pytest.fixture(scope="module")
def baked(
    twins: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """Every twin prepared (signed NVIDIA fixture repositories), baked, relaunched and baked again."""
    tmp = tmp_path_factory.mktemp("twin-bakes")
    started = time.monotonic()
    env = next(iter(twins.values()))["info"]["env"]
    prepare = playbook(env, labrun.FIXTURE_PLAYBOOK, timeout=900)
    assert prepare.returncode == 0, prepare.stdout[-3000:]
    # No assertion here reads torch: the pytorch role installs the kilobyte TEST DOUBLE of its wheel.
    lab_vars = torchdouble.bake_vars(env["GPUFORGE_LAB_ARTIFACTS"], tmp)
    print(f"twins prepared in {time.monotonic() - started:.1f}s")

    def first(name: str) -> dict[str, Any]:
        twin = twins[name]
        result = bake(twin, tmp / name / "first", lab_vars)
        # Each test asserts the bake succeeded.
        upper, merged = host_tree(twin)
        overlay = twinlab.overlay(twin["record"], os.uname().release, (tmp / name / "overlay"))
        manifest = merged / "etc/gpuforge/manifest.json"
        return {
            "first": result,
            "run_dir": Path(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else None,
            "after": dpkg_versions(merged),
            # A file the twin recorded shows up in the host's writable layer once anything rewrote it.
            "touched": sorted(path for path in overlay.files if os.path.lexists(upper / path)),
            # What the node would tell a cluster: read now, before the second bake rewrites it.
            "manifest": json.loads(manifest.read_text()) if result.returncode == 0 else None,
        }

    def second(name: str) -> subprocess.CompletedProcess[str] | None:
        if results[name]["first"].returncode != 0:
            return None  # nothing to bake again
        twin = twins[name]
        relaunch(TWIN_LAB, twin["host"]["name"], twin["image"])
        result = bake(twin, tmp / name / "second", lab_vars)
        relaunch(TWIN_LAB, twin["host"]["name"], twin["image"])
        return result

    for name in NAMES:
        (tmp / name / "overlay").mkdir(parents=True)
    results = each(first)
    for name, result in each(second).items():
        results[name]["second"] = result
    print(f"twins prepared and baked twice in {time.monotonic() - started:.1f}s")
    return results


@needs_bake
@pytest.mark.parametrize("name", NAMES)
def test_bake_changes_no_recorded_component_at_or_above_its_floor(
    twins: dict[str, dict[str, Any]], baked: dict[str, dict[str, Any]], name: str
) -> None:
    """Adopted, not replaced: no file the twin recorded was rewritten, no recorded package changed.
    A component recorded below its floor (the DLAMI's DCGM 4.7.0 and ParallelCluster 3.16.1's 4.6.0
    under the 4.8.0 floor) is replaced by the policy, as it must be: the packages the role installs
    change and their files are left out here. Its other packages (the DLAMI's
    datacenter-gpu-manager-4-module-diag) follow those through the Depends of NVIDIA's packages, which
    the twin's dummy packages do not carry: they stay as recorded."""
    result = baked[name]
    assert_baked(result)
    record: twinlab.Twin = twins[name]["record"]
    policy = versions.load().components
    replaced_files: set[str] = set()
    for component in twinlab.PACKAGED:
        recorded = record.component(component)
        if recorded is None:
            continue
        floor = policy.get(component, {}).get("floor")
        if recorded.get("version") and floor is not None and not twinlab.at_least(recorded["version"], floor):
            installs = ROLE_PACKAGES.get(component, set(recorded["packages"]))
            assert installs & set(recorded["packages"]), (component, "none of its packages is the role's")
            for package, version in recorded["packages"].items():
                if package in installs:
                    kept = (component, package, "below its floor, kept")
                    assert result["after"].get(package) != version, kept
                    replaced_files.update(twinlab._package_files(package, version))
                else:
                    assert result["after"].get(package) == version, (component, package)
            continue
        for package, version in recorded["packages"].items():
            assert result["after"].get(package) == version, (component, package)
    assert [path for path in result["touched"] if path not in replaced_files] == []


@needs_bake
@pytest.mark.parametrize("name", NAMES)
def test_second_bake_changes_nothing(baked: dict[str, dict[str, Any]], name: str) -> None:
    assert_baked(baked[name])
    second = baked[name]["second"]
    assert second.returncode == 0, (second.stdout + second.stderr)[-6000:]
    assert bake_recap(second)["changed"] == 0, second.stderr[-6000:]


@needs_bake
@pytest.mark.parametrize("name", NAMES)
def test_bake_runs_each_role_once(baked: dict[str, dict[str, Any]], name: str) -> None:
    """Roles others depend on (the driver, gpuforge_common) run once per bake, not again per dependent."""
    assert_baked(baked[name])
    output = baked[name]["first"].stderr
    for task in (
        "gpuforge.gpu.nvidia_driver : Write the driver report",
        "gpuforge.gpu.gpuforge_common : Read the DMI vendor",
    ):
        assert output.count(f"TASK [{task}") == 1, task


def assert_baked(result: dict[str, Any]) -> None:
    first = result["first"]
    assert first.returncode == 0, (first.stdout + first.stderr)[-6000:]


@needs_bake
@pytest.mark.parametrize("name", NAMES)
def test_aws_ofi_nccl_is_the_adopted_bundle_or_the_pinned_build(
    twins: dict[str, dict[str, Any]], baked: dict[str, dict[str, Any]], name: str
) -> None:
    """A bundle at or above the floor is used in place; one below it (ParallelCluster 3.16.1's EFA
    installer 1.49.0 bundles 1.20.0) is left alone and the pinned release is built from its
    sha512-pinned source tarball (the lab serves a TEST FIXTURE stand-in of it) into its prefix."""
    assert_baked(baked[name])
    bundle = twins[name]["record"].component("aws_ofi_nccl")
    assert bundle is not None
    policy = versions.load().components["aws_ofi_nccl"]
    _, merged = host_tree(twins[name])
    outcome = json.loads((merged / "etc/gpuforge/aws_ofi_nccl.json").read_text())
    if twinlab.at_least(bundle["version"], policy["floor"]):
        expected = {
            "source": "bundled",
            "version": bundle["version"],
            "lib_dir": str(Path(bundle["library"]).parent),
        }
    else:
        expected = {
            "source": "built",
            "version": policy["version"],
            "lib_dir": f"/opt/aws-ofi-nccl/{policy['version']}/lib",
        }
        assert (
            f"Building aws-ofi-nccl {policy['version']} (bundled: {bundle['version']})"
            in baked[name]["first"].stderr
        )
        built = (merged / expected["lib_dir"].lstrip("/") / "libnccl-net.so").read_bytes()
        assert f"aws-ofi-nccl {policy['version']} (gpuforge TEST FIXTURE".encode() in built
        assert not (merged / "var/tmp/gpuforge-aws-ofi-nccl").exists()
    assert {key: outcome[key] for key in expected} == expected
    assert outcome["bundled_version"] == bundle["version"]
    linker = (merged / "etc/ld.so.conf.d/gpuforge-aws-ofi-nccl.conf").read_text().splitlines()
    assert expected["lib_dir"] in linker


def expected_installed(record: twinlab.Twin) -> dict[str, dict[str, str]]:
    """The manifest's `installed` entries a bake must leave: adopted as recorded, or gpuforge's pin."""
    policy = versions.load().components
    expected = {}
    for component in ("nvidia_driver", "efa_installer", "dcgm", "nvidia_container_toolkit", "nccl"):
        recorded = record.component(component)
        if recorded is not None and twinlab.at_least(recorded["version"], policy[component]["floor"]):
            expected[component] = {"version": recorded["version"], "source": "base_image"}
        else:
            expected[component] = {"version": policy[component]["version"], "source": "gpuforge"}
    # The base image's own nccl-tests build (the DLAMI's), used in place at or above the floor when it
    # links MPI; else the pin, built.
    tests = record.component("nccl_tests")
    if (
        tests is not None
        and tests["links_mpi"]
        and twinlab.at_least(tests["version"], policy["nccl_tests"]["floor"])
    ):
        expected["nccl_tests"] = {"version": tests["version"], "source": "base_image"}
    else:
        expected["nccl_tests"] = {"version": policy["nccl_tests"]["version"], "source": "gpuforge"}
    return expected


@needs_bake
@pytest.mark.parametrize("name", NAMES)
def test_manifest_lists_the_actual_versions(
    twins: dict[str, dict[str, Any]], baked: dict[str, dict[str, Any]], name: str
) -> None:
    """/etc/gpuforge/manifest.json: what is really on the node and where it came from, next to the pins."""
    assert_baked(baked[name])
    manifest = baked[name]["manifest"]
    assert manifest["versions_hash"] == versions.load().digest
    installed = {
        component: manifest["installed"].get(component)
        for component in expected_installed(twins[name]["record"])
    }
    assert installed == expected_installed(twins[name]["record"])


@needs_bake
@pytest.mark.parametrize("name", NAMES)
def test_nccl_tests_is_the_base_images_build_or_the_pin(
    twins: dict[str, dict[str, Any]], baked: dict[str, dict[str, Any]], name: str
) -> None:
    """The DLAMI's own nccl-tests (recorded in its twin) is used where it is, /opt/nccl-tests/build
    linking to it and nothing built; the ParallelCluster AMI has none, and the pin is built there."""
    assert_baked(baked[name])
    tests = twins[name]["record"].component("nccl_tests")
    _, merged = host_tree(twins[name])
    build = merged / "opt/nccl-tests/build"
    stderr = baked[name]["first"].stderr
    if expected_installed(twins[name]["record"])["nccl_tests"]["source"] == "base_image":
        assert tests is not None
        assert build.is_symlink() and str(build.readlink()) == tests["directory"]
        assert not (merged / "opt/nccl-tests/gpuforge-build.json").exists()
        assert "TASK [gpuforge.gpu.nccl_tests : Build with MPI" not in stderr
    else:
        assert not build.is_symlink() and (build / "all_reduce_perf").is_file()
        assert json.loads((merged / "opt/nccl-tests/gpuforge-build.json").read_text())["version"] == (
            versions.load().version("nccl_tests")
        )


@needs_bake
def test_pcluster_twin_keeps_the_parallelcluster_marker_and_tags(
    twins: dict[str, dict[str, Any]], baked: dict[str, dict[str, Any]]
) -> None:
    """ParallelCluster accepts the baked image only with its bootstrap marker and its AMI tags."""
    (name,) = [name for name in NAMES if twins[name]["record"].flavor == "pcluster"]
    pcluster = twins[name]["record"].parallelcluster
    assert pcluster is not None
    assert_baked(baked[name])
    assert "opt/parallelcluster/.bootstrapped" not in baked[name]["touched"]
    _, merged = host_tree(twins[name])
    assert (merged / "opt/parallelcluster/.bootstrapped").read_text().strip() == pcluster["marker"]
    assert (
        "check-base: ParallelCluster base, bootstrapped as " + pcluster["marker"]
        in baked[name]["first"].stderr
    )
    # The tags the bake asks Packer to put on the image it would register.
    tags = json.loads((baked[name]["run_dir"] / "variables.json").read_text())["image_tags"]
    assert {key: tags.get(key) for key in pcluster["tags"]} == pcluster["tags"]


# One role, on one twin, after the bakes: the cases that need the host changed first.

OTHER_ROLES = "nvidia_driver,efa,nccl,aws_ofi_nccl,nccl_tests,dcgm,pytorch"
TOOLKIT_PACKAGES = (
    "nvidia-container-toolkit",
    "nvidia-container-toolkit-base",
    "libnvidia-container-tools",
    "libnvidia-container1",
)


def toolkit_run(twin: dict[str, Any], lab_vars: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """bake.yml's install phase limited to the container toolkit (and gpuforge_common's always tasks)."""
    return playbook(
        twin["info"]["env"],
        "-i",
        f"{twin['host']['ip']},",
        "playbooks/bake.yml",
        "--tags",
        "install",
        "--skip-tags",
        OTHER_ROLES,
        "-e",
        f"@{lab_vars}",
        *extra,
        timeout=900,
    )


@pytest.fixture(scope="module")
def below_floor(
    twins: dict[str, dict[str, Any]],
    baked: dict[str, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """CHANGED_TWIN with its toolkit replaced by one below the floor, then the toolkit role run."""
    twin = twins[CHANGED_TWIN]
    policy = versions.load().components["nvidia_container_toolkit"]
    old = "1.17.0-1"
    assert not twinlab.at_least(old, policy["floor"])
    tmp = tmp_path_factory.mktemp("below-floor")
    _, merged = host_tree(twin)
    # Not under /tmp: the host mounts its own tmpfs there.
    staged = merged / "var/cache/twin-old-toolkit"
    staged.mkdir()
    for package in TOOLKIT_PACKAGES:
        shutil.copy(twinlab._build_deb(package, old, {}, tmp), staged / f"{package}.deb")
    sh(twin, "dpkg -i /var/cache/twin-old-toolkit/*.deb && rm -r /var/cache/twin-old-toolkit")
    lab_vars = labrun.write_bake_vars(tmp)
    result = toolkit_run(twin, lab_vars)
    return {"twin": twin, "result": result, "lab_vars": lab_vars, "old": old, "policy": policy}


@needs_bake
def test_component_below_its_floor_is_upgraded_from_the_signed_fixture_repository(
    below_floor: dict[str, Any],
) -> None:
    result, twin, policy = below_floor["result"], below_floor["twin"], below_floor["policy"]
    assert result.returncode == 0, result.stdout[-4000:]
    said = " ".join(result.stdout.split())
    assert (
        f"nvidia_container_toolkit: install {policy['version']} (gpuforge); installed before: 1.17.0," in said
    )
    _, merged = host_tree(twin)
    found = dpkg_versions(merged)
    assert {package: found.get(package) for package in TOOLKIT_PACKAGES} == dict.fromkeys(
        TOOLKIT_PACKAGES, policy["package_version"]
    )
    # The package came from the fixture repository (signed with the fixture key the role pinned).
    assert (merged / "usr/share/doc/nvidia-container-toolkit/GPUFORGE-TEST-FIXTURE").is_file()
    installed = json.loads((merged / "etc/gpuforge/manifest.json").read_text())["installed"]
    assert installed["nvidia_container_toolkit"] == {"version": policy["version"], "source": "gpuforge"}


@needs_bake
def test_pin_below_the_installed_release_stops_with_a_clear_error(below_floor: dict[str, Any]) -> None:
    """A floor raised above the installed toolkit with a pin older than it: refuse, change nothing."""
    twin, policy = below_floor["twin"], below_floor["policy"]
    result = toolkit_run(
        twin,
        below_floor["lab_vars"],
        "-e",
        "nvidia_container_toolkit_floor=1.99.0",
        "-e",
        "nvidia_container_toolkit_version=1.18.0",
        "-e",
        "nvidia_container_toolkit_package_version=1.18.0-1",
    )
    assert result.returncode != 0
    message = " ".join(result.stdout.split())
    assert f"nvidia_container_toolkit: installed {policy['version']} is below the floor 1.99.0" in message
    assert "the pin 1.18.0 is older; gpuforge never downgrades" in message
    _, merged = host_tree(twin)
    assert dpkg_versions(merged)["nvidia-container-toolkit"] == policy["package_version"]
