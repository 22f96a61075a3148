"""Verifier for the NVIDIA roles on lab hosts (no GPU): real packages, files, units and reports.

The lab cannot reach NVIDIA, so DCGM and the container toolkit come from TEST FIXTURE apt
repositories built by tests/fixtures/nvidia/prepare.yml (with files/build-fixture-repos.sh there):
those tests prove the roles'
repository trust, pinning and holds, not NVIDIA's binaries. The driver userspace is Debian's real
non-free packaging of the pinned release.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from gpuforge import versions

testinfra_hosts = ["all"]

SCENARIO = Path(__file__).resolve().parent.parent
PINS = versions.load().components
FIXTURE_FPR = "1BFC70D46F4EA877C7A9426A21D9BFD25F4C1F80"
# nvidia_driver_debian_package_version: the lab's stand-in packaging of the production pin.
DEB_VERSION = PINS["nvidia_driver"]["version"] + "-1"
DRIVER_PACKAGES = [
    "nvidia-smi",
    "libnvidia-ml1",
    "libcuda1",
    "libnvidia-ptxjitcompiler1",
    "libnvidia-pkcs11-openssl3",
    "libnvidia-cfg1",
    "nvidia-alternative",
]
TOOLKIT_PACKAGES = [
    "nvidia-container-toolkit",
    "nvidia-container-toolkit-base",
    "libnvidia-container-tools",
    "libnvidia-container1",
]


def _report(host, name: str) -> dict:
    report = host.file(f"/etc/gpuforge/reports/{name}.json")
    assert report.exists and (report.user, report.group) == ("root", "root") and report.mode == 0o644
    return json.loads(report.content_string)


def _held(host, package: str) -> bool:
    # dpkg prints multi-arch packages as name:arch.
    fields = host.check_output(f"dpkg --get-selections {package}").split()
    return len(fields) == 2 and fields[0].split(":")[0] == package and fields[1] == "hold"


@pytest.mark.parametrize("package", DRIVER_PACKAGES)
def test_driver_userspace_is_the_pinned_debian_release(host, package):
    """Each driver userspace package is installed at the pinned Debian version and held."""
    pkg = host.package(package)
    assert pkg.is_installed
    assert pkg.version == DEB_VERSION
    assert _held(host, package)


def test_persistenced_pinned_and_enabled_not_running(host):
    """nvidia-persistenced is at its pin, held and enabled; without a GPU it cannot run."""
    pkg = host.package("nvidia-persistenced")
    assert pkg.version == DEB_VERSION
    assert _held(host, "nvidia-persistenced")
    service = host.service("nvidia-persistenced")
    assert service.is_enabled
    assert not service.is_running


def test_persistenced_starts_with_persistence_mode(host):
    """gpuforge's drop-in replaces the packaged start line: persistence mode on for every GPU."""
    dropin = host.file("/etc/systemd/system/nvidia-persistenced.service.d/gpuforge-persistence-mode.conf")
    assert dropin.exists and (dropin.user, dropin.group) == ("root", "root") and dropin.mode == 0o644
    exec_start = host.check_output("systemctl show -p ExecStart nvidia-persistenced.service")
    assert "--persistence-mode" in exec_start and "--no-persistence-mode" not in exec_start


@pytest.mark.parametrize(
    ("instance_type", "nvswitch_target"),
    [("c5n.large", False), ("p5.48xlarge", True)],
    ids=["head", "compute"],
)
def test_nvswitch_boot_unit_follows_the_targets(host, instance_type, nvswitch_target):
    """An NVSwitch target gets the boot-time detection, enabled; on this host (no GPU) it starts nothing."""
    hardware = json.loads(host.file("/etc/gpuforge/hardware.json").content_string)
    if hardware["instance_type"] != instance_type:
        pytest.skip(f"this host is a {hardware['instance_type']}")
    script = host.file("/usr/local/sbin/gpuforge-nvswitch-services")
    assert script.exists is nvswitch_target
    if nvswitch_target:
        assert host.service("gpuforge-nvswitch-services").is_enabled
        with host.sudo():
            run = host.run("/usr/local/sbin/gpuforge-nvswitch-services")
        assert run.rc == 0 and "no NVSwitch fabric" in run.stdout


@pytest.mark.parametrize("package", [*DRIVER_PACKAGES, "nvidia-persistenced"])
def test_driver_packages_are_the_lab_stand_ins(host, package):
    """Debian 12 ships only R535, so the lab's driver packages are TEST-FIXTURE stand-ins built at the
    production pin (molecule/nvidia/files/build-fixture-repos.sh), never Debian's own."""
    assert host.file(f"/usr/share/doc/{package}/GPUFORGE-TEST-FIXTURE").exists


def test_no_kernel_module_built_in_the_lab(host):
    """No DKMS module package is installed in the lab (no headers for the host kernel)."""
    for package in ("nvidia-kernel-dkms", "nvidia-open-kernel-dkms"):
        assert not host.package(package).is_installed


def test_nvidia_smi_reports_no_device(host):
    """nvidia-smi is installed and honestly fails without a GPU; nothing fakes its output."""
    smi = host.file("/usr/bin/nvidia-smi")
    assert smi.exists
    result = host.run("nvidia-smi")
    assert result.rc != 0


@pytest.mark.parametrize(
    ("instance_type", "fabricmanager"),
    [("c5n.large", "not needed (no NVSwitch target)"), ("p5.48xlarge", "not available on Debian")],
    ids=["head", "compute"],
)
def test_driver_report_says_hardware_checks_skipped(host, instance_type, fabricmanager):
    """The driver report records the pinned version, fabric manager status and skipped checks."""
    hardware = json.loads(host.file("/etc/gpuforge/hardware.json").content_string)
    if hardware["instance_type"] != instance_type:
        pytest.skip(f"this host is a {hardware['instance_type']}")
    report = _report(host, "nvidia_driver")
    assert report["pinned_version"] == PINS["nvidia_driver"]["version"]
    assert report["installed_version"] == PINS["nvidia_driver"]["version"]
    assert report["packaging"] == "apt"
    assert report["fabricmanager"] == fabricmanager
    assert report["hardware_checks"] == {"nvidia_smi": "skipped: no GPU present"}


@pytest.mark.parametrize("repo", ["nvidia-cuda", "nvidia-container-toolkit"])
def test_repositories_trust_only_the_pinned_key(host, repo):
    """Each NVIDIA source is deb822 with Signed-By a key whose fingerprint is the pinned one."""
    source = host.file(f"/etc/apt/sources.list.d/{repo}.sources")
    assert source.exists and (source.user, source.group) == ("root", "root") and source.mode == 0o644
    assert f"Signed-By: /etc/apt/keyrings/{repo}.asc" in source.content_string
    key = host.file(f"/etc/apt/keyrings/{repo}.asc")
    assert (key.user, key.group) == ("root", "root") and key.mode == 0o644
    with host.sudo():
        colons = host.check_output(
            f"gpg --batch --homedir /var/cache/gpuforge/gnupg --with-colons --import-options show-only "
            f"--import /etc/apt/keyrings/{repo}.asc"
        )
    fprs = [line.split(":")[9] for line in colons.splitlines() if line.startswith("fpr:")]
    assert fprs[0] == FIXTURE_FPR


@pytest.mark.parametrize(
    ("path", "mode"),
    [
        # Downloaded keys wait here until their fingerprint matched the pin; apt never reads them.
        ("/var/cache/gpuforge/apt-keys", 0o755),
        # gpg's home for reading fingerprints: private, as gpg itself requires of a homedir.
        ("/var/cache/gpuforge/gnupg", 0o700),
        ("/etc/gpuforge/reports", 0o755),
        ("/etc/dcgm-exporter", 0o755),
    ],
)
def test_directories_the_roles_create(host, path, mode):
    """Key staging, gpg home, reports and exporter config: root:root with the roles' modes."""
    with host.sudo():
        directory = host.file(path)
        assert directory.is_directory
        assert (directory.user, directory.group) == ("root", "root")
        assert directory.mode == mode


@pytest.mark.parametrize("repo", ["nvidia-cuda", "nvidia-container-toolkit"])
def test_staged_signing_keys(host, repo):
    """The staged copy of each signing key is root-owned and not writable by others."""
    staged = host.file(f"/var/cache/gpuforge/apt-keys/{repo}.asc")
    assert staged.is_file
    assert (staged.user, staged.group) == ("root", "root")
    assert staged.mode == 0o644


@pytest.mark.parametrize("package", TOOLKIT_PACKAGES)
def test_container_toolkit_pinned_and_held(host, package):
    """The toolkit packages (test fixtures) are at the pinned version and held."""
    pkg = host.package(package)
    assert pkg.version == PINS["nvidia_container_toolkit"]["package_version"]
    assert _held(host, package)
    assert host.file(f"/usr/share/doc/{package}/GPUFORGE-TEST-FIXTURE").exists


def test_container_toolkit_report_no_engine(host):
    """No container engine in the lab: no runtime registered, GPU check reported skipped."""
    report = _report(host, "nvidia_container_toolkit")
    assert report["platform"] == "lab"
    assert report["runtimes_registered"] == []
    assert report["hardware_checks"] == {"nvidia_container_cli_info": "skipped: no GPU present"}
    assert not host.file("/etc/docker/daemon.json").exists


@pytest.mark.parametrize("package", ["datacenter-gpu-manager-4-core", "datacenter-gpu-manager-4-cuda13"])
def test_dcgm_pinned_held_enabled(host, package):
    """DCGM 4 (fixtures) is at its pin with epoch, held; nvidia-dcgm enabled, not running."""
    pkg = host.package(package)
    assert pkg.version == PINS["dcgm"]["package_version"]
    assert _held(host, package)
    service = host.service("nvidia-dcgm")
    assert service.is_enabled
    assert not service.is_running


EXPORTER_PACKAGE = "datacenter-gpu-manager-exporter"
EXPORTER_UNIT = "nvidia-dcgm-exporter.service"
EXPORTER_DROPIN = f"/etc/systemd/system/{EXPORTER_UNIT}.d/gpuforge.conf"


def test_dcgm_exporter_package_is_the_pinned_release_held(host):
    """The default method: NVIDIA's exporter package (fixture) at the pinned exporter release, held,
    its binary the fixture stub."""
    pkg = host.package(EXPORTER_PACKAGE)
    assert pkg.is_installed
    assert pkg.version == PINS["dcgm_exporter"]["package_version"]
    assert _held(host, EXPORTER_PACKAGE)
    binary = host.file("/usr/bin/dcgm-exporter")
    fixture = SCENARIO.parent.parent / "tests/fixtures/nvidia/files/dcgm-exporter-fixture"
    assert binary.sha256sum == hashlib.sha256(fixture.read_bytes()).hexdigest()
    # No binary of the opt-in binary method, no gpuforge unit of the container/binary methods.
    assert not host.file("/usr/local/bin/dcgm-exporter").exists
    assert not host.file("/etc/systemd/system/dcgm-exporter.service").exists


def test_dcgm_exporter_unit_uses_the_hosts_engine(host):
    """The package's unit, through gpuforge's drop-in, connects to nv-hostengine, serves :9400 with the
    managed collectors file, is valid, enabled and not started (no GPU)."""
    dropin = host.file(EXPORTER_DROPIN)
    assert (dropin.user, dropin.group) == ("root", "root") and dropin.mode == 0o644
    shown = host.check_output(f"systemctl show --property=ExecStart,Requires,After {EXPORTER_UNIT}")
    assert "--remote-hostengine-info localhost:5555" in shown
    assert "--address :9400" in shown
    assert "--collectors /etc/dcgm-exporter/gpuforge-counters.csv" in shown
    assert shown.count("argv[]=") == 1, "the package's own command line must be cleared"
    requires = next(line for line in shown.splitlines() if line.startswith("Requires="))
    assert "nvidia-dcgm.service" in requires.split("=", 1)[1].split()
    # The package's unit file with its drop-ins, as systemd loads it.
    assert host.run(f"systemd-analyze verify /lib/systemd/system/{EXPORTER_UNIT}").rc == 0
    service = host.service("nvidia-dcgm-exporter")
    assert service.is_enabled
    assert not service.is_running
    assert not host.socket("tcp://0.0.0.0:9400").is_listening


def test_dcgm_collectors_file_is_well_formed(host):
    """Every collector line is 'DCGM_FI_* , gauge|counter, help'."""
    csv = host.file("/etc/dcgm-exporter/gpuforge-counters.csv")
    assert (csv.user, csv.group) == ("root", "root") and csv.mode == 0o644
    rows = [line for line in csv.content_string.splitlines() if line.strip() and not line.startswith("#")]
    assert rows
    for row in rows:
        field, kind, help_text = (part.strip() for part in row.split(",", 2))
        assert field.startswith("DCGM_FI_")
        assert kind in {"gauge", "counter"}
        assert help_text


def test_dcgm_report_says_hardware_checks_skipped(host):
    """The DCGM report says which checks were skipped and why."""
    report = _report(host, "dcgm")
    assert report["platform"] == "lab"
    assert report["pinned_version"] == PINS["dcgm"]["package_version"]
    assert report["exporter"] == {
        "enabled": True,
        "version": PINS["dcgm_exporter"]["version"],
        "install_method": "package",
        "unit": "nvidia-dcgm-exporter.service",
        "remote_hostengine": "localhost:5555",
        "port": 9400,
    }
    assert report["hardware_checks"] == {
        "dcgmi_discovery": "skipped: no GPU present",
        "exporter_metrics": "skipped: no GPU present (service enabled, not started)",
    }
