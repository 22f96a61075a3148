"""TEST DOUBLES: base-image twins, lab images made from recorded descriptions of real AMIs.

A record (tests/twins/<name>.yml) says what a supported base image contains, with its public
sources. `build(name)` turns it into a lab image (`gpuforge-lab up --image`): a copy of the lab's
Debian 12 root filesystem overlaid with the record's os-release, dpkg entries (dummy packages built
with dpkg-deb), files, version banners and stub binaries. Only Debian's archive is reachable here,
so a twin is not Ubuntu: it tests gpuforge's decisions on the image (adopt, install, refuse), not
Ubuntu's packaging. Nothing here is shipped or read by production code.

An image is built once and cached under a name carrying a digest of everything it is made from
(the record, this file, the Debian rootfs recipe, the running kernel), so a test run reuses it and
a changed record makes a new one (the stale one is removed).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpuforge_lab import images as lab_images
from gpuforge_lab import rootfs as lab_rootfs
from gpuforge_lab.artifacts import fixtures as artifact_fixtures

RECORDS = Path(__file__).resolve().parent / "twins"
MARKER = "GPUFORGE-TWIN"  # in every file a twin adds, so no one mistakes it for the real thing
# Where the runfile installer's DKMS build puts the module (the cookbook runs it with --dkms).
MODULE_DIR = "lib/modules/{kernel}/updates/dkms"


# The components a record lists as dpkg packages (name -> version). Docker's are dpkg entries only:
# no dockerd stub, since a twin has no engine to register the NVIDIA runtime with or to restart.
PACKAGED = ("nvidia_fabricmanager", "dcgm", "gdrcopy", "nvidia_container_toolkit", "docker")


def names() -> list[str]:
    return sorted(path.stem for path in RECORDS.glob("*.yml"))


@dataclass(frozen=True)
class Twin:
    name: str
    record: dict[str, Any]
    text: bytes

    @property
    def flavor(self) -> str:
        return str(self.record["flavor"])

    def component(self, name: str) -> dict[str, Any] | None:
        value = self.record["components"][name]
        return dict(value) if value else None

    @property
    def parallelcluster(self) -> dict[str, Any] | None:
        value = self.record.get("parallelcluster")
        return dict(value) if value else None

    @property
    def digest(self) -> str:
        parts = [
            self.text,
            Path(__file__).read_bytes(),
            lab_rootfs.recipe_key().encode(),
            os.uname().release.encode(),
        ]
        return hashlib.sha256(b"\0".join(parts)).hexdigest()[:10]

    @property
    def image(self) -> str:
        return f"twin-{self.name}-{self.digest}"


def load(name: str) -> Twin:
    path = RECORDS / f"{name}.yml"
    text = path.read_bytes()
    record = yaml.safe_load(text)
    if record.get("name") != name:
        raise ValueError(f"{path}: name {record.get('name')!r} does not match the file name")
    return Twin(name, record, text)


def release(twin: Twin) -> Twin:
    """The twin of the release a record holds beside its own (next_release: a base image gpuforge's CLI
    pin cannot use yet): its components and ParallelCluster marker and tags replace the recorded ones,
    every other row is the recorded release's. Named <name>-<release>, so its lab image is its own."""
    upcoming = twin.record.get("next_release")
    if not upcoming:
        raise ValueError(f"{twin.name}: the record holds no next_release")
    record = dict(twin.record)
    record["base"] = {**record["base"], "image": upcoming["image"]}
    record["components"] = {**record["components"], **upcoming["components"]}
    if record.get("parallelcluster"):
        record["parallelcluster"] = {**record["parallelcluster"], **upcoming.get("parallelcluster", {})}
    name = f"{twin.name}-{upcoming['release']}"
    record["name"] = name
    return Twin(name, record, twin.text + f"\n# next_release {upcoming['release']}\n".encode())


# What a twin adds to the tree: files (path -> (content, mode)) and dummy packages.


@dataclass
class Overlay:
    files: dict[str, tuple[bytes, int]]
    packages: dict[str, tuple[str, dict[str, tuple[bytes, int]]]]  # name -> (version, files)
    symlinks: dict[str, str]

    def add(self, path: str, content: str | bytes, mode: int = 0o644) -> None:
        self.files[path.lstrip("/")] = (content.encode() if isinstance(content, str) else content, mode)


def _script(body: str) -> str:
    return f"#!/bin/sh\n# {MARKER}: a stub standing in for the real binary of a recorded base image.\n{body}"


def overlay(twin: Twin, kernel: str, workdir: Path) -> Overlay:
    """Everything the record says the image holds, as files and dummy packages."""
    out = Overlay({}, {}, {})
    os_release = "".join(f'{key}="{value}"\n' for key, value in twin.record["os_release"].items())
    out.add("/usr/lib/os-release", os_release)
    osr = twin.record["os_release"]
    out.add(
        "/etc/lsb-release",
        f"DISTRIB_ID={osr['NAME']}\nDISTRIB_RELEASE={osr['VERSION_ID']}\n"
        f'DISTRIB_CODENAME={osr["VERSION_CODENAME"]}\nDISTRIB_DESCRIPTION="{osr["PRETTY_NAME"]}"\n',
    )
    out.add(
        "/etc/gpuforge-twin.json",
        json.dumps({"twin": twin.name, "digest": twin.digest, "marker": MARKER}) + "\n",
    )
    _driver(out, twin.component("nvidia_driver"), kernel, workdir)
    _cuda(out, twin.component("cuda"))
    _efa(out, twin.component("efa_installer"), twin.component("aws_ofi_nccl"), workdir)
    _nccl_tests(out, twin.component("nccl_tests"), workdir)
    for name in PACKAGED:
        _packages(out, name, twin.component(name))
    pcluster = twin.parallelcluster
    if pcluster:
        # The cookbook's bootstrap check reads this marker (entrypoints.rb).
        out.add("/opt/parallelcluster/.bootstrapped", pcluster["marker"] + "\n")
        # Units the cookbook writes on a GPU node (parallelcluster_nvidia.service), marked as twins'.
        for path, unit in (pcluster.get("units") or {}).items():
            out.add(path, f"# {MARKER}: as the recorded base image carries it.\n{unit}")
    return out


def _driver(out: Overlay, driver: dict[str, Any] | None, kernel: str, workdir: Path) -> None:
    if driver is None:
        return
    version = driver["version"]
    if driver["installed_by"] != "runfile":
        raise ValueError(f"driver installed_by {driver['installed_by']!r}: only runfile twins are modelled")
    out.add(
        "/usr/bin/nvidia-smi",
        _script(
            f'case "$*" in\n'
            f'  *--version*) echo "NVIDIA-SMI version : {version}"; echo "DRIVER version : {version}" ;;\n'
            f'  *driver_version*) echo "{version}" ;;\n'
            f'  *) echo "| NVIDIA-SMI {version}    Driver Version: {version}    ({MARKER}: no GPU) |" ;;\n'
            f"esac\n"
        ),
        0o755,
    )
    # The runfile installs the persistence daemon but no unit for it (only NVIDIA's sample init
    # scripts), so the image has the binary and no nvidia-persistenced.service.
    out.add(
        "/usr/bin/nvidia-persistenced",
        _script(f'echo "nvidia-persistenced {version} ({MARKER}: no GPU)" >&2\nexit 1\n'),
        0o755,
    )
    # The runfile installer's own uninstaller: what tells a runfile install apart. Its log
    # (/var/log/nvidia-installer.log) is not on the image: an AMI build removes every file under
    # /var/log (aws-parallelcluster-cookbook files/ami_cleanup.sh), as gpuforge's sanitize.sh does.
    out.add(
        "/usr/bin/nvidia-uninstall",
        _script('echo "nvidia-uninstall (twin): nothing to do" >&2\nexit 1\n'),
        0o755,
    )
    # A module object whose .modinfo carries the version, so `modinfo -F version nvidia` answers
    # as on the real image (lab hosts share the control host's kernel, so no module is loaded).
    source = workdir / "nvidia-modinfo.c"
    fields = {
        "version": version,
        # The open kernel modules are dual-licensed, the proprietary ones are "NVIDIA".
        "license": "Dual MIT/GPL" if driver["kernel_module"] == "open" else "NVIDIA",
        "name": "nvidia",
        "description": f"{MARKER} stand-in",
    }
    source.write_text(
        "".join(
            f'static const char m{i}[] __attribute__((section(".modinfo"), used, aligned(1))) = "{k}={v}";\n'
            for i, (k, v) in enumerate(fields.items())
        )
    )
    module = workdir / "nvidia.ko"
    subprocess.run([_compiler(), "-c", "-o", str(module), str(source)], check=True, capture_output=True)
    out.add(f"/{MODULE_DIR.format(kernel=kernel)}/nvidia.ko", module.read_bytes())


def _compiler() -> str:
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise RuntimeError("building a twin needs a C compiler (apt-get install gcc)")
    return found


def _cuda(out: Overlay, cuda: dict[str, Any] | None) -> None:
    if cuda is None:
        return
    for version in cuda["versions"]:
        major, minor = version.split(".")[:2]
        prefix = f"/usr/local/cuda-{version}"
        out.add(
            f"{prefix}/version.json", json.dumps({"cuda": {"name": "CUDA SDK", "version": version}}) + "\n"
        )
        out.add(
            f"{prefix}/include/cuda.h",
            f"/* {MARKER}: stands in for CUDA {version}'s header; only the version macro. */\n"
            f"#define CUDA_VERSION {int(major) * 1000 + int(minor) * 10}\n",
        )
        out.add(
            f"{prefix}/bin/nvcc",
            _script(
                'echo "nvcc: NVIDIA (R) Cuda compiler driver"\n'
                f'echo "Cuda compilation tools, release {version}"\n'
            ),
            0o755,
        )
    out.symlinks["usr/local/cuda"] = f"cuda-{cuda['default']}"


def _efa(out: Overlay, efa: dict[str, Any] | None, plugin: dict[str, Any] | None, workdir: Path) -> None:
    if efa is not None:
        out.add(
            "/opt/amazon/efa_installed_packages",
            f"# EFA installer version: {efa['version']}\n# Debug packages installed: no\n"
            f"# Packages installed:\n# {MARKER}: recorded, nothing was installed\n",
        )
        # A full (not --minimal) EFA install ships Open MPI 4 under /opt/amazon/openmpi (openmpi40-aws;
        # EFA release notes, 1.51.0: "openmpi40-aws-4.1.8-1"; ParallelCluster and the DLAMI document
        # mpirun there). The header is what the nccl_tests role builds against (MPI_HOME).
        out.add(
            "/opt/amazon/openmpi/include/mpi.h",
            f"/* {MARKER}: Open MPI's header, recorded; no MPI inside */\n#define OMPI_MAJOR_VERSION 4\n",
        )
        out.add(
            "/opt/amazon/openmpi/bin/mpirun",
            _script(f'echo "{MARKER}: mpirun stand-in" >&2; exit 1\n'),
            0o755,
        )
    if plugin is not None:
        # A real ELF shared object carrying the plugin's start-up banner, as the EFA fixture's is.
        out.add(plugin["library"], artifact_fixtures.standin_plugin(plugin["version"], workdir), 0o755)


# A base image's own nccl-tests build: an ELF program carrying the strings the nccl_tests role reads
# from the real one (the 2.17.4+ banner format, NCCL_TESTS_VERSION) and linked against stand-in shared
# libraries with the sonames the real one needs (libnccl.so.2, and libmpi.so.40 when built with MPI), so
# that its dynamic section names them (DT_NEEDED, which the role reads with readelf) and ldd resolves
# them where the twin puts them; run, it says it is a stand-in and fails. That the role's reading of the
# release (one X.Y.Z string beside the banner) holds for a real DLAMI binary is not verified: no such
# binary was available (the twins' records say so).
NCCL_TESTS_STANDIN = """/* {marker}: stands in for a base image's all_reduce_perf; runs no collective. */
#include <stdio.h>
{strings}
int main(void) {{
    fprintf(stderr, "{marker}: all_reduce_perf stand-in, no GPU\\n");
    return 1;
}}
"""
STANDIN_LIBRARY = (
    "/* {marker}: stands in for {soname}; no symbols anyone calls. */\nint {symbol}(void) {{ return 0; }}\n"
)
NCCL_SONAME = "libnccl.so.2"
MPI_SONAME = "libmpi.so.40"


def nccl_tests_standin(
    workdir: Path, version: str | None, *, links_mpi: bool, extra: tuple[str, ...] = ()
) -> dict[str, bytes]:
    """TEST DOUBLE of a base image's all_reduce_perf and the libraries it needs, by file name
    ('all_reduce_perf', libnccl.so.2, libmpi.so.40 when links_mpi): the banner's format string and
    `version` (None: a build from before the banner, neither) and `extra` X.Y.Z strings, each its own
    NUL-terminated string as in the binary's string tables."""
    workdir.mkdir(parents=True, exist_ok=True)
    strings = (
        [] if version is None else ["# nccl-tests version %s nccl-headers=%d nccl-library=%d\\n", version]
    )
    strings += list(extra)
    built: dict[str, bytes] = {}
    libraries = [NCCL_SONAME] + ([MPI_SONAME] if links_mpi else [])
    for soname in libraries:
        source = workdir / f"{soname}.c"
        symbol = "gpuforge_twin_" + soname.split(".")[0].removeprefix("lib")
        source.write_text(STANDIN_LIBRARY.format(marker=MARKER, soname=soname, symbol=symbol))
        library = workdir / soname
        subprocess.run(
            [_compiler(), "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(library), str(source)],
            check=True,
            capture_output=True,
        )
        built[soname] = library.read_bytes()
    source = workdir / "all_reduce_perf.c"
    source.write_text(
        NCCL_TESTS_STANDIN.format(
            marker=MARKER,
            strings="\n".join(
                f'__attribute__((used)) static const char s{i}[] = "{text}";'
                for i, text in enumerate(strings)
            ),
        )
    )
    binary = workdir / "all_reduce_perf"
    # --no-as-needed: the program calls nothing in them, and the toolchain would drop them otherwise.
    subprocess.run(
        [_compiler(), "-O0", "-o", str(binary), str(source), f"-L{workdir}", "-Wl,--no-as-needed"]
        + [f"-l:{soname}" for soname in libraries],
        check=True,
        capture_output=True,
    )
    built["all_reduce_perf"] = binary.read_bytes()
    return built


def _nccl_tests(out: Overlay, tests: dict[str, Any] | None, workdir: Path) -> None:
    if tests is None:
        return
    built = nccl_tests_standin(workdir / "nccl-tests", tests["version"], links_mpi=tests["links_mpi"])
    out.add(f"{tests['directory']}/all_reduce_perf", built["all_reduce_perf"], 0o755)
    # Where the launch finds its libraries: its NCCL in the directory AWS's sample puts on LD_LIBRARY_PATH
    # (recorded in the twin), Open MPI's in the EFA installer's /opt/amazon/openmpi/lib.
    out.add(tests["nccl"]["library"], built[NCCL_SONAME], 0o755)
    if tests["links_mpi"]:
        out.add(f"/opt/amazon/openmpi/lib/{MPI_SONAME}", built[MPI_SONAME], 0o755)


# Files each recorded package carries besides its marker, by package name.
def _package_files(name: str, version: str) -> dict[str, tuple[bytes, int]]:
    upstream = version.split(":")[-1].split("-")[0]
    if name == "datacenter-gpu-manager-4-core":
        unit = (
            f"[Unit]\nDescription={MARKER} nvidia-dcgm (no GPU software inside)\n\n"
            "[Service]\nExecStart=/bin/false\n\n[Install]\nWantedBy=multi-user.target\n"
        )
        return {
            "lib/systemd/system/nvidia-dcgm.service": (unit.encode(), 0o644),
            "usr/bin/dcgmi": (_script(f'echo "Version : {upstream}"\n').encode(), 0o755),
        }
    if name.startswith("nvidia-fabricmanager"):
        # The unit and binary the nvidia_driver role and the ParallelCluster cookbook look for.
        unit = (
            f"[Unit]\nDescription={MARKER} NVIDIA fabric manager (no NVSwitch software inside)\n\n"
            "[Service]\nExecStart=/bin/false\n\n[Install]\nWantedBy=multi-user.target\n"
        )
        return {
            "lib/systemd/system/nvidia-fabricmanager.service": (unit.encode(), 0o644),
            "usr/bin/nv-fabricmanager": (
                _script(f'echo "{MARKER}: nv-fabricmanager {upstream} stand-in"\n').encode(),
                0o755,
            ),
        }
    if name == "nvidia-container-toolkit-base":
        banner = f'echo "NVIDIA Container Toolkit CLI version {upstream}"\n'
        return {"usr/bin/nvidia-ctk": (_script(banner).encode(), 0o755)}
    return {}


def _packages(out: Overlay, component: str, value: dict[str, Any] | None) -> None:
    if value is None:
        return
    for name, version in value["packages"].items():
        out.packages[name] = (str(version), _package_files(name, str(version)))


def _build_deb(name: str, version: str, files: dict[str, tuple[bytes, int]], workdir: Path) -> Path:
    root = workdir / "pkg" / name
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: all\n"
        "Maintainer: gpuforge test doubles <twins@gpuforge.invalid>\n"
        f"Description: {MARKER}: {name} as a recorded base image carries it\n"
        " Marker content only; made by tests/twinlab.py for the lab, never for production.\n"
    )
    doc = root / "usr/share/doc" / name / MARKER
    doc.parent.mkdir(parents=True)
    doc.write_text(f"{name} {version}: recorded, not installed\n")
    for path, (content, mode) in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(mode)
    deb = workdir / f"{name}.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)], check=True, capture_output=True
    )
    return deb


def apply(out: Overlay, tree: Path, workdir: Path) -> None:
    """Write the overlay into `tree` (a copy of the lab rootfs) and register its packages with dpkg."""
    # Debian links /etc/os-release to ../usr/lib/os-release, as Ubuntu does: keep the link.
    for path, (content, mode) in out.files.items():
        target = tree / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        target.write_bytes(content)
        target.chmod(mode)
    for path, dest in out.symlinks.items():
        link = tree / path
        link.unlink(missing_ok=True)
        link.symlink_to(dest)
    debs = [
        _build_deb(name, version, files, workdir) for name, (version, files) in sorted(out.packages.items())
    ]
    if debs:
        staged = tree / "tmp" / "twin-debs"
        staged.mkdir()
        for deb in debs:
            shutil.copy(deb, staged / deb.name)
        subprocess.run(
            ["chroot", str(tree), "sh", "-c", "dpkg -i /tmp/twin-debs/*.deb"], check=True, capture_output=True
        )
        shutil.rmtree(staged)
    kernel_modules = list((tree / "lib/modules").glob(f"*/{MODULE_DIR.split('/', 3)[-1]}/nvidia.ko"))
    for module in kernel_modules:
        kernel = module.relative_to(tree / "lib/modules").parts[0]
        subprocess.run(["chroot", str(tree), "depmod", kernel], check=True, capture_output=True)


def build(name: str) -> str:
    """The lab image of twin `name` (built once per record digest); its image name.

    Several test workers may ask at once: a lock per twin makes one build and the others reuse it.
    """
    twin = load(name)
    root = lab_images.images_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".twin-{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_locked(twin, root)


def _build_locked(twin: Twin, root: Path) -> str:
    name = twin.name
    final = root / twin.image
    if (final / lab_images.METADATA).is_file():
        return twin.image
    for stale in root.glob(f"twin-{name}-*"):
        # The image cache is machine-wide: another checkout's lab may still boot from an older
        # digest (an overlay's lower layer). Only an image no host mounts is removed.
        if not lab_images.in_use(stale):
            shutil.rmtree(stale)
    # Under the same lock `gpuforge-lab up` and `make lab-rootfs` take around building the Debian tree.
    base = lab_rootfs.ensure_rootfs()
    partial = root / f".{twin.image}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tree = partial / "rootfs"
    started = time.monotonic()
    subprocess.run(["cp", "--archive", "--reflink=auto", f"{base}/.", str(tree)], check=True)
    (tree / ".gpuforge-complete").unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpuforge-twin-") as work:
        apply(overlay(twin, os.uname().release, Path(work)), tree, Path(work))
    info = lab_images.ImageInfo(
        name=twin.image,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        source_lab="twin",
        source_host=twin.name,
        versions_hash="",
        sanitized=lab_images.is_sanitized(tree),
        size_bytes=0,
    )
    # "twin" is ignored by ImageInfo.read; it tells people (and `lab image list --json`) what this is.
    metadata = {**info.to_json(), "twin": {"record": twin.name, "digest": twin.digest, "seconds": 0.0}}
    metadata["twin"]["seconds"] = round(time.monotonic() - started, 1)
    (partial / lab_images.METADATA).write_text(json.dumps(metadata, indent=2) + "\n")
    partial.rename(final)
    return twin.image


def at_least(version: str, floor: str) -> bool:
    """Release `version` is `floor` or newer, number by number (an epoch "1:" is ignored)."""

    def numbers(text: str) -> list[int]:
        return [int(part) for part in re.findall(r"[0-9]+", re.sub(r"^[0-9]+:", "", text))]

    return numbers(version) >= numbers(floor)
