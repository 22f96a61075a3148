"""The base-image twin records (tests/twins/*.yml) and what tests/twinlab.py makes of them.

No lab needed: the records are checked for what makes them trustworthy (a public source, the
components the bake decides on, the test-double label) and the overlay each becomes is read back
the way the roles read the real image (the EFA record's first line, the plugin's banner, the
module's .modinfo, dpkg's view of the dummy packages).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import twinlab
from gpuforge import paths, versions

COMPONENTS = {
    "nvidia_driver",
    "nvidia_fabricmanager",
    "cuda",
    "efa_installer",
    "aws_ofi_nccl",
    "nccl",
    "nccl_tests",
    "dcgm",
    "gdrcopy",
    "nvidia_container_toolkit",
    "docker",
}
TWINS = twinlab.names()
needs_build_tools = pytest.mark.skipif(
    not (shutil.which("gcc") or shutil.which("cc")) or not shutil.which("dpkg-deb"),
    reason="building a twin needs gcc and dpkg-deb (apt-get install gcc)",
)


def test_every_supported_base_has_a_twin() -> None:
    assert TWINS == ["dlami-ubuntu2204", "dlami-ubuntu2404", "pcluster-ubuntu2204"]


@pytest.mark.parametrize("name", TWINS)
def test_record_is_a_labelled_test_double_with_public_sources(name: str) -> None:
    path = twinlab.RECORDS / f"{name}.yml"
    assert "TEST DOUBLE" in path.read_text().split("\n", 3)[1]
    twin = twinlab.load(name)
    sources = twin.record["base"]["sources"]
    assert sources and all(re.match(r"^https://", source) for source in sources)
    assert set(twin.record["components"]) == COMPONENTS
    assert twin.record["os_release"]["ID"] == "ubuntu"
    assert twin.flavor in {"dlami", "pcluster"}
    assert (twin.parallelcluster is not None) == (twin.flavor == "pcluster")


@pytest.mark.parametrize("name", TWINS)
def test_recorded_versions_are_exact_releases(name: str) -> None:
    """A record names releases, never ranges or 'latest' (the same rule as versions.yml)."""
    for component, value in twinlab.load(name).record["components"].items():
        if value is None:
            continue
        # A component whose own release the notes do not give (Docker on Ubuntu 22.04) records only
        # the packages they name; every version it does record must still be exact.
        versions = [value["version"]] if "version" in value else list(value.get("versions", []))
        versions += list((value.get("packages") or {}).values())
        assert versions, component
        for version in versions:
            assert re.match(r"^([0-9]+:)?[0-9]+(\.[0-9]+)+(-[0-9A-Za-z.+~]+)?$", str(version)), (
                component,
                version,
            )


@pytest.mark.parametrize("name", TWINS)
def test_record_is_of_the_x86_64_image_and_names_its_kernel(name: str) -> None:
    """gpuforge's targets are x86_64 (data/instance_types.yml): a twin records that image, its kernel
    (or says in gaps that no source gives it), and uses an aarch64 page only as a declared stand-in."""
    base = twinlab.load(name).record["base"]
    assert base["architecture"] == "x86_64"
    gaps = " ".join(base.get("gaps") or [])
    if base["kernel"] is None:
        assert "kernel" in gaps
    else:
        assert re.match(r"^[0-9]+\.[0-9]+\.[0-9]+-[0-9]+-aws$", base["kernel"]), base["kernel"]
    for source in base["sources"]:
        if "arm64" in source or "aarch64" in source:
            assert source in gaps, f"{source}: an aarch64 source must be declared under gaps"


def test_docker_is_recorded_where_the_release_notes_show_it() -> None:
    """The DLAMI ships Docker CE (its notes list docker-ce-* updates); the ParallelCluster cookbook
    installs no Docker, so that twin carries none and the toolkit's engine decisions see both cases."""
    for name in TWINS:
        twin = twinlab.load(name)
        docker = twin.component("docker")
        assert (docker is not None) == (twin.flavor == "dlami"), name
        if docker is not None:
            assert any(package.startswith("docker-") for package in docker["packages"])


def test_pcluster_twin_matches_the_cli_release_it_is_for() -> None:
    """ParallelCluster takes only an AMI of its own release: marker and tags must agree with the pin."""
    pinned = re.search(
        r"^aws-parallelcluster==(\S+)$",
        (paths.repo_root() / "requirements/constraints.txt").read_text(),
        re.MULTILINE,
    )
    assert pinned is not None
    pcluster = twinlab.load("pcluster-ubuntu2204").parallelcluster
    assert pcluster is not None
    assert pcluster["marker"] == f"aws-parallelcluster-cookbook-{pinned[1]}"
    assert pcluster["tags"]["parallelcluster:version"] == pinned[1]
    assert pcluster["tags"]["parallelcluster:os"] == "ubuntu2204"


def test_pcluster_twin_carries_the_dcgm_packages_the_cookbook_installs() -> None:
    """The cookbook installs datacenter-gpu-manager-4-core and, beside it, -4-cuda13, both at its
    dcgm_version (aws-parallelcluster-cookbook resources/nvidia_dcgm/partial/_nvidia_dcgm_debian.rb,
    lines 19 and 47), so the dcgm role meets both on the ParallelCluster AMI."""
    dcgm = twinlab.load("pcluster-ubuntu2204").component("dcgm")
    assert dcgm is not None
    assert set(dcgm["packages"]) == {"datacenter-gpu-manager-4-core", "datacenter-gpu-manager-4-cuda13"}
    assert set(dcgm["packages"].values()) == {f"1:{dcgm['version']}-1"}


def test_dlami_twins_carry_the_dlamis_own_nccl_tests_and_nccl() -> None:
    """The DLAMI ships nccl-tests built for its CUDA 13.0 and EFA stack, and the NCCL it is built with
    outside dpkg, where AWS's sample runs them (awsome-distributed-training nccl-tests-ami.sbatch lines
    16-17); the nccl_tests role looks there by default. The ParallelCluster AMI carries none."""
    defaults = yaml.safe_load((paths.repo_root() / "roles/nccl_tests/defaults/main.yml").read_text())
    cuda = versions.load().version("cuda")
    default_dir = defaults["nccl_tests_base_dirs"][0].replace("{{ gpuforge_versions.cuda.version }}", cuda)
    for name in TWINS:
        twin = twinlab.load(name)
        tests = twin.component("nccl_tests")
        assert (tests is not None) == (twin.flavor == "dlami"), name
        if tests is not None:
            assert tests["directory"] == default_dir == "/usr/local/cuda-13.0/efa/test-cuda-13.0"
            assert tests["nccl"]["library"] == "/usr/local/cuda-13.0/lib/libnccl.so.2"
            assert tests["links_mpi"] is True
            assert "13.0" in (twin.component("cuda") or {}).get("versions", [])


def _cli_pin() -> str:
    pinned = re.search(
        r"^aws-parallelcluster==(\S+)$",
        (paths.repo_root() / "requirements/constraints.txt").read_text(),
        re.MULTILINE,
    )
    assert pinned is not None
    return pinned[1]


def test_pcluster_next_release_is_recorded_beside_the_cli_release() -> None:
    """ParallelCluster 3.16.3's AMI, recorded beside 3.16.1's while the CLI stays at 3.16.1 (the newest
    on the package index): what its release notes change (driver and fabric manager 595.112.07, EFA
    installer 1.51.0 with aws-ofi-nccl 1.22.0, marker and tags), every other row 3.16.1's. Once the CLI
    pin reaches it, the record must be folded into the twin the lab bakes."""
    twin = twinlab.load("pcluster-ubuntu2204")
    upcoming = twin.record["next_release"]
    assert upcoming["release"] == "3.16.3"
    assert not twinlab.at_least(_cli_pin(), upcoming["release"]), (
        f"the CLI pin reached {upcoming['release']}: fold next_release into the twin's record"
    )
    assert "https://github.com/aws/aws-parallelcluster/releases/tag/v3.16.3" in upcoming["sources"]
    assert all(source.startswith("https://") for source in upcoming["sources"])
    nxt = twinlab.release(twin)
    assert nxt.name == "pcluster-ubuntu2204-3.16.3" and nxt.image != twin.image
    versions_of = {name: (nxt.component(name) or {}).get("version") for name in twin.record["components"]}
    assert {name: versions_of[name] for name in upcoming["components"]} == {
        "nvidia_driver": "595.112.07",
        "nvidia_fabricmanager": "595.112.07",
        "efa_installer": "1.51.0",
        "aws_ofi_nccl": "1.22.0",
    }
    for name in set(twin.record["components"]) - set(upcoming["components"]):
        assert nxt.component(name) == twin.component(name), name
    pcluster = nxt.parallelcluster
    assert pcluster is not None and pcluster["marker"] == "aws-parallelcluster-cookbook-3.16.3"
    assert pcluster["tags"]["parallelcluster:version"] == "3.16.3"
    assert pcluster["units"] == (twin.parallelcluster or {})["units"]
    for component, value in upcoming["components"].items():
        for version in [value["version"], *(value.get("packages") or {}).values()]:
            assert re.match(r"^([0-9]+:)?[0-9]+(\.[0-9]+)+(-[0-9A-Za-z.+~]+)?$", str(version)), component


BASES = {"x86_64", "aarch64", "unsourced"}


@pytest.mark.parametrize("name", [name for name in TWINS if name.startswith("dlami-")])
def test_every_dlami_row_says_where_it_comes_from(name: str) -> None:
    """The DLAMI twins take some rows from an aarch64 page (no x86_64 notes of those releases are
    reachable): every component row (and the OS) says whether it is an x86_64 fact, an aarch64
    stand-in or unsourced, and names its source where it has one; an x86_64 row never cites an
    aarch64 page, an aarch64 row cites one the record declares under gaps."""
    record = twinlab.load(name).record
    provenance = record["provenance"]
    rows = {component for component, value in record["components"].items() if value is not None}
    assert set(provenance) == rows | {"os_release"}
    gaps = " ".join(record["base"]["gaps"])
    for row, origin in provenance.items():
        assert origin["basis"] in BASES, row
        source = str(origin.get("source", ""))
        if origin["basis"] == "unsourced":
            assert "note" in origin and not source.startswith("https://"), row
            continue
        assert source, row
        if source.startswith("https://"):
            assert source in record["base"]["sources"], (row, source)
        arm = "arm64" in source or "aarch64" in source
        assert arm == (origin["basis"] == "aarch64"), (row, source)
        if arm:
            assert source in gaps, (row, source)


def test_digest_changes_with_the_record() -> None:
    twin = twinlab.load("dlami-ubuntu2204")
    edited = twinlab.Twin(twin.name, twin.record, twin.text + b"# edited\n")
    assert twin.image.startswith("twin-dlami-ubuntu2204-") and edited.image != twin.image


@needs_build_tools
@pytest.mark.parametrize("name", [*TWINS, "pcluster-ubuntu2204 next_release"])
def test_overlay_reads_back_as_the_roles_read_the_real_image(name: str, tmp_path: Path) -> None:
    base, _, upcoming = name.partition(" ")
    twin = twinlab.release(twinlab.load(base)) if upcoming else twinlab.load(base)
    out = twinlab.overlay(twin, "6.8.0-twin", tmp_path)
    files = {path: content for path, (content, _) in out.files.items()}

    os_release = dict(
        line.split("=", 1) for line in files["usr/lib/os-release"].decode().splitlines() if line
    )
    assert (
        os_release["ID"] == '"ubuntu"'
        and os_release["VERSION_ID"] == f'"{twin.record["os_release"]["VERSION_ID"]}"'
    )

    driver = twin.component("nvidia_driver")
    assert driver is not None
    smi = tmp_path / "nvidia-smi"
    smi.write_bytes(files["usr/bin/nvidia-smi"])
    query = subprocess.run(
        ["sh", str(smi), "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    assert query.stdout.strip() == driver["version"]
    module = files["lib/modules/6.8.0-twin/updates/dkms/nvidia.ko"]
    assert f"version={driver['version']}".encode() in module and module.startswith(b"\x7fELF")

    efa = twin.component("efa_installer")
    assert efa is not None
    # The efa role's probe: 'EFA installer version: *([0-9.]+)' in /opt/amazon/efa_installed_packages.
    first = files["opt/amazon/efa_installed_packages"].decode().splitlines()[0]
    assert re.search(r"EFA installer version: *([0-9.]+)", first)[1] == efa["version"]  # type: ignore[index]

    plugin = twin.component("aws_ofi_nccl")
    assert plugin is not None
    library = files[plugin["library"].lstrip("/")]
    # The aws_ofi_nccl role's probe: the first 'aws-ofi-nccl X.Y.Z' banner in the library.
    assert re.findall(rb"aws-ofi-nccl ([0-9]+\.[0-9]+\.[0-9]+)", library)[0].decode() == plugin["version"]

    cuda = twin.component("cuda")
    assert cuda is not None
    assert out.symlinks["usr/local/cuda"] == f"cuda-{cuda['default']}"
    for version in cuda["versions"]:
        assert f"usr/local/cuda-{version}/include/cuda.h" in files

    tests = twin.component("nccl_tests")
    if tests is not None:
        # The nccl_tests role's probe: one NUL-delimited X.Y.Z beside the 2.17.4+ banner; libmpi and libnccl
        # among the binary's DT_NEEDED entries (readelf -d), each where the launch's library path finds it.
        binary = files[f"{tests['directory'].lstrip('/')}/all_reduce_perf"]
        assert binary.startswith(b"\x7fELF") and b"# nccl-tests version %s" in binary
        assert re.findall(rb"(?<=\0)([0-9]+\.[0-9]+\.[0-9]+)(?=\0)", binary) == [tests["version"].encode()]
        (tmp_path / "all_reduce_perf").write_bytes(binary)
        dynamic = subprocess.run(
            ["readelf", "-d", str(tmp_path / "all_reduce_perf")], capture_output=True, text=True, check=True
        ).stdout
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+)\]", dynamic)
        assert "libnccl.so.2" in needed
        assert ("libmpi.so.40" in needed) == tests["links_mpi"]
        assert files[tests["nccl"]["library"].lstrip("/")].startswith(b"\x7fELF")
        if tests["links_mpi"]:
            assert files["opt/amazon/openmpi/lib/libmpi.so.40"].startswith(b"\x7fELF")

    assert ("opt/parallelcluster/.bootstrapped" in files) == (twin.flavor == "pcluster")


@needs_build_tools
def test_dummy_packages_carry_the_recorded_versions(tmp_path: Path) -> None:
    twin = twinlab.load("dlami-ubuntu2204")
    out = twinlab.overlay(twin, "6.8.0-twin", tmp_path)
    recorded = {
        name: version
        for component in twinlab.PACKAGED
        for name, version in (twin.component(component) or {"packages": {}})["packages"].items()
    }
    assert {name: version for name, (version, _) in out.packages.items()} == recorded
    version, files = out.packages["datacenter-gpu-manager-4-core"]
    deb = twinlab._build_deb("datacenter-gpu-manager-4-core", version, files, tmp_path)
    fields = subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True, check=True
    )
    assert fields.stdout.strip() == "1:4.7.0-1"
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    assert "./lib/systemd/system/nvidia-dcgm.service" in listing and twinlab.MARKER in listing


@needs_build_tools
def test_pcluster_twin_carries_the_cookbooks_nvidia_unit(tmp_path: Path) -> None:
    """The cookbook's parallelcluster_nvidia.service (since 3.6.1) is on the twin, so the nvidia_driver
    role meets it as on a ParallelCluster GPU node; the DLAMI twins have no such unit."""
    for name in TWINS:
        twin = twinlab.load(name)
        work = tmp_path / name
        work.mkdir()
        out = twinlab.overlay(twin, "6.8.0-twin", work)
        path = "etc/systemd/system/parallelcluster_nvidia.service"
        assert (path in out.files) == (twin.flavor == "pcluster"), name
        if path in out.files:
            unit, mode = out.files[path]
            lines = unit.decode().splitlines()
            assert "ExecStart=/usr/bin/nvidia-persistenced --user root" in lines
            assert "WantedBy=multi-user.target" in lines and mode == 0o644
            assert twinlab.MARKER in unit.decode()


def test_twin_code_stays_out_of_the_shipped_package() -> None:
    """Twins are test doubles: nothing under scripts/ (the package) may name them."""
    shipped = paths.repo_root() / "scripts"
    hits = [
        path
        for path in shipped.rglob("*.py")
        if "twinlab" in path.read_text() or "tests/twins" in path.read_text()
    ]
    assert hits == []
    assert (
        yaml.safe_load((twinlab.RECORDS / "dlami-ubuntu2204.yml").read_text())["name"] == "dlami-ubuntu2204"
    )
