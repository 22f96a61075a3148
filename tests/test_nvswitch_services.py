"""The boot-time NVSwitch decision (roles/nvidia_driver/files/usr/local/sbin/gpuforge-nvswitch-services).

One image serves every target: the fabric manager is installed for NVSwitch targets and left
disabled, and this script starts it at boot only where NVSwitch hardware is present. The hosts here
are test doubles: a fake sysfs PCI tree (GPUFORGE_SYSFS) shaped like each instance type's devices,
and a fake systemctl on PATH that records what it was asked to do.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "roles/nvidia_driver/files/usr/local/sbin/gpuforge-nvswitch-services"
UNIT = REPO / "roles/nvidia_driver/files/etc/systemd/system/gpuforge-nvswitch-services.service"

FAKE_SYSTEMCTL = """#!/bin/sh
# Test double for systemctl: records its arguments; `cat` succeeds only if the unit is "installed".
echo "$*" >> "$FAKE_SYSTEMCTL_LOG"
if [ "$1" = cat ]; then
  [ -n "$FAKE_FABRICMANAGER_INSTALLED" ]
  exit $?
fi
exit 0
"""

NVIDIA, MELLANOX, OTHER = "0x10de", "0x15b3", "0x1d0f"
GPU, BRIDGE, IB, NET = "0x030200", "0x068000", "0x020700", "0x020000"

# Device sets shaped like each type (vendor, class, count).
HOSTS = {
    # g5.2xlarge builder: one A10G, an ENA NIC, no NVSwitch.
    "g5.2xlarge": [(NVIDIA, GPU, 1), (OTHER, NET, 1)],
    # g6e.48xlarge: eight L40S on PCIe, no NVSwitch.
    "g6e.48xlarge": [(NVIDIA, GPU, 8), (OTHER, NET, 4)],
    # p5.48xlarge: HGX H100, NVSwitch bridges.
    "p5.48xlarge": [(NVIDIA, GPU, 8), (NVIDIA, BRIDGE, 4), (OTHER, NET, 32)],
    # p6-b200.48xlarge: HGX B200, NVLink 5 managed through ConnectX InfiniBand controllers.
    "p6-b200.48xlarge": [(NVIDIA, GPU, 8), (MELLANOX, IB, 4), (OTHER, NET, 8)],
    # p5.4xlarge: one H100 of an HGX board; a single GPU needs no fabric manager.
    "p5.4xlarge": [(NVIDIA, GPU, 1), (NVIDIA, BRIDGE, 4)],
}


def _sysfs(root: Path, devices: list[tuple[str, str, int]]) -> Path:
    n = 0
    for vendor, klass, count in devices:
        for _ in range(count):
            dev = root / "bus/pci/devices" / f"0000:{n:02x}:00.0"
            dev.mkdir(parents=True)
            (dev / "vendor").write_text(vendor + "\n")
            (dev / "class").write_text(klass + "\n")
            n += 1
    return root


def _run(
    tmp_path: Path, host: str, fabricmanager_installed: bool = True
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(FAKE_SYSTEMCTL)
    (bin_dir / "systemctl").chmod(0o755)
    log = tmp_path / "systemctl.log"
    log.touch()
    proc = subprocess.run(
        [str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "GPUFORGE_SYSFS": str(_sysfs(tmp_path / "sys", HOSTS[host])),
            "FAKE_SYSTEMCTL_LOG": str(log),
            "FAKE_FABRICMANAGER_INSTALLED": "yes" if fabricmanager_installed else "",
        },
    )
    return proc, log.read_text().splitlines()


@pytest.mark.parametrize("host", ["g5.2xlarge", "g6e.48xlarge", "p5.4xlarge"])
def test_without_nvswitch_the_fabric_manager_stays_stopped(tmp_path: Path, host: str) -> None:
    proc, calls = _run(tmp_path, host)
    assert proc.returncode == 0, proc.stderr
    assert "no NVSwitch fabric" in proc.stdout and "nvidia-fabricmanager not started" in proc.stdout
    assert calls == []


@pytest.mark.parametrize("host", ["p5.48xlarge", "p6-b200.48xlarge"])
def test_on_nvswitch_hardware_the_fabric_manager_is_started(tmp_path: Path, host: str) -> None:
    proc, calls = _run(tmp_path, host)
    assert proc.returncode == 0, proc.stderr
    assert "starting nvidia-fabricmanager" in proc.stdout
    assert calls == ["cat nvidia-fabricmanager.service", "start --no-block nvidia-fabricmanager.service"]


def test_nvswitch_hardware_without_the_fabric_manager_is_an_error(tmp_path: Path) -> None:
    """An image not baked for this type: the boot unit fails visibly instead of leaving GPUs unusable."""
    proc, calls = _run(tmp_path, "p5.48xlarge", fabricmanager_installed=False)
    assert proc.returncode == 1
    assert "nvidia-fabricmanager is not installed" in proc.stderr
    assert calls == ["cat nvidia-fabricmanager.service"]


def test_the_unit_runs_the_script_once_per_boot() -> None:
    text = UNIT.read_text()
    assert "Type=oneshot" in text and "RemainAfterExit=yes" in text
    assert "ExecStart=/usr/local/sbin/gpuforge-nvswitch-services" in text
    assert "WantedBy=multi-user.target" in text


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean() -> None:
    subprocess.run(["shellcheck", str(SCRIPT)], check=True)
