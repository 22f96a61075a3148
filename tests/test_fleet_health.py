"""gpuforge-health (roles/health/files/gpuforge-health) against stand-in tools.

nvidia-smi, ibv_devinfo, fi_info, systemctl, dcgmi and scontrol are test doubles: small scripts
that print recorded outputs (tests/fixtures/health, formats from real published outputs), because
this machine has no GPU or EFA. /sys and /dev come from a fake tree. The checks, their parsing,
the verdicts and the exit status are the real script's. Every check has a case here that makes
it fail.
"""

from __future__ import annotations

import http.server
import importlib.machinery
import importlib.util
import json
import re
import resource
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "roles" / "health" / "files" / "gpuforge-health"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "health"
DATA = yaml.safe_load((REPO / "data" / "instance_types.yml").read_text())
INSTANCE_TYPES = DATA["gpuforge_instance_types"]
GPU_MODELS = DATA["gpuforge_gpu_models"]
DEFAULTS = yaml.safe_load((REPO / "roles" / "health" / "defaults" / "main.yml").read_text())


def _load() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("gpuforge_health", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpuforge_health", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


HEALTH = _load()

# A stand-in tool: a shell script that matches its arguments (without --format=...) and prints the
# recorded output with the recorded exit status, on stdout as nvidia-smi and systemctl do;
# arguments it does not know exit 2.
GPU_QUERY = "--query-gpu=index,name,persistence_mode,temperature.gpu"
REMAP_QUERY = "--query-remapped-rows=gpu_bus_id,remapped_rows.pending,remapped_rows.failure"
ECC_QUERY = "--query-gpu=index,ecc.errors.uncorrected.volatile.total,retired_pages.pending"
PCIE_QUERY = "--query-gpu=index,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
THROTTLE_QUERY = "--query-gpu=index," + ",".join(
    f"clocks_event_reasons.{f}"
    for f in ("hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown")
)
APPS_QUERY = "--query-compute-apps=pid,process_name,used_memory"
PCIE_GEN_NOW_QUERY = "--query-gpu=index,pcie.link.gen.gpucurrent"
FABRIC_QUERY = "--query-gpu=index,fabric.state,fabric.status"


class Tools:
    """The stand-in tools of one test, with their tables, in a directory of their own."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.tables: dict[str, dict[str, list[Any]]] = {}

    def set(self, tool: str, args: str, output: str, rc: int = 0) -> None:
        self.tables.setdefault(tool, {})[args] = [output, rc]
        cases = []
        for n, (key, (text, code)) in enumerate(self.tables[tool].items()):
            recorded = self.directory / f"{tool}.{n}.out"
            recorded.write_text(text)
            cases.append(f"  {shlex.quote(key)}) cat {shlex.quote(str(recorded))}; exit {code} ;;")
        script = [
            "#!/bin/sh",
            'args=""',
            'for a in "$@"; do case "$a" in --format*) ;; *) args="${args:+$args }$a" ;; esac; done',
            'case "$args" in',
            *cases,
            '  *) echo "unexpected arguments: $args"; exit 2 ;;',
            "esac",
        ]
        path = self.directory / tool
        path.write_text("\n".join(script) + "\n")
        path.chmod(0o755)

    def path(self, tool: str) -> str:
        return str(self.directory / tool)


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def rdma_device(root: Path, name: str, driver: str, ports: dict[str, str]) -> None:
    """One /sys/class/infiniband/<name>: its PCI driver link, its ports' state, NVIDIA p2p on EFA ones.

    As in sysfs, device/driver is a relative link to /sys/bus/pci/drivers/<driver>; each
    ports/<n>/state reads like "4: ACTIVE" (the kernel's ib_port_state number and name).
    """
    device = root / "sys" / "class" / "infiniband" / name / "device"
    device.mkdir(parents=True, exist_ok=True)
    (device / "driver").symlink_to(f"../../../../bus/pci/drivers/{driver}")
    if driver == "efa":
        (device / "p2p").write_text("NVIDIA\n")
    for port, state in ports.items():
        (root / "sys" / "class" / "infiniband" / name / "ports" / port).mkdir(parents=True)
        (root / "sys" / "class" / "infiniband" / name / "ports" / port / "state").write_text(state + "\n")


def fake_sys(root: Path, efa_devices: int) -> None:
    """A /sys and /dev tree as on a healthy p5: EFA modules, GDRCopy, NVIDIA peer-to-peer per device."""
    for module in ("efa", "ib_uverbs", "gdrdrv"):
        (root / "sys" / "module" / module).mkdir(parents=True, exist_ok=True)
    (root / "dev").mkdir(exist_ok=True)
    (root / "dev" / "gdrdrv").write_text("")
    for n in range(efa_devices):
        rdma_device(root, f"rdmap{n + 79}s0", "efa", {"1": "4: ACTIVE"})


def recorded_sys(root: Path, recording: str) -> None:
    """A /sys tree from a recorded device list (tests/fixtures/health/sysfs-infiniband-*.txt)."""
    for module in ("efa", "ib_uverbs", "gdrdrv", "ib_umad"):
        (root / "sys" / "module" / module).mkdir(parents=True, exist_ok=True)
    (root / "dev").mkdir(exist_ok=True)
    (root / "dev" / "gdrdrv").write_text("")
    for line in fixture(recording).splitlines():
        if line.strip() and not line.startswith("#"):
            name, driver, *ports = line.split(" ", 2)
            states = dict(p.split("=", 1) for p in ports[0].split(";")) if ports else {}
            rdma_device(root, name, driver, states)


@pytest.fixture
def tools(tmp_path: Path) -> Tools:
    """Every tool answering as on a healthy p5.48xlarge."""
    t = Tools(tmp_path / "bin")
    t.set("nvidia-smi", GPU_QUERY, fixture("smi-gpus-p5.csv"))
    t.set("nvidia-smi", REMAP_QUERY, fixture("smi-remapped-rows-p5.csv"))
    t.set("nvidia-smi", ECC_QUERY, fixture("smi-ecc-p5.csv"))
    t.set("nvidia-smi", PCIE_QUERY, fixture("smi-pcie-p5.csv"))
    t.set("nvidia-smi", THROTTLE_QUERY, fixture("smi-throttle-p5.csv"))
    t.set("nvidia-smi", APPS_QUERY, "")
    t.set("nvidia-smi", PCIE_GEN_NOW_QUERY, fixture("smi-pcie-gen-current-p5.csv"))
    t.set("nvidia-smi", FABRIC_QUERY, fixture("smi-fabric-p5.csv"))
    t.set("nvidia-smi", "nvlink --status", fixture("smi-nvlink-status-p5.txt"))
    t.set("nvidia-smi", "nvlink --errorcounters", fixture("smi-nvlink-errors-p5.txt"))
    t.set("ibv_devinfo", "", fixture("ibv_devinfo-p5.txt"))
    t.set("fi_info", "-p efa -t FI_EP_RDM", fixture("fi_info-efa-p5.txt"))
    t.set("systemctl", "is-active nvidia-fabricmanager", "active\n")
    for level in (1, 2, 3):
        t.set("dcgmi", f"diag -r {level}", "| Deployment | Pass |\n| Memory    | Pass |\n")
    return t


@pytest.fixture
def config(tmp_path: Path, tools: Tools, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A p5.48xlarge node's configuration as the role writes it, with the stand-ins and fake trees."""
    log = tmp_path / "kern.log"
    log.write_text("kernel: Linux version 6.8.0-1015-aws\n")
    fake_sys(tmp_path / "root", 32)
    # EFA needs unlimited locked memory; this test process's own limit is the host's business.
    monkeypatch.setattr(HEALTH.resource, "getrlimit", lambda _: (resource.RLIM_INFINITY,) * 2)
    return {
        "instance_type": "p5.48xlarge",
        "instance_types": INSTANCE_TYPES,
        "imds": False,
        "hardware_absent_by_design": False,
        "max_temperature_c": 85,
        "dcgm_level": {"adhoc": 3, "prolog": 1, "epilog": 0, "boot": 2},
        "timeout_s": 10,
        "dcgm_timeout_s": 10,
        "nvlink_error_limits": DEFAULTS["health_nvlink_error_limits"],
        "pcie_by_gpu_model": DEFAULTS["health_pcie_by_gpu_model"],
        "gpudirect_rdma_types": DEFAULTS["health_gpudirect_rdma_types"],
        "gpu_models": GPU_MODELS,
        "pcie_sample_interval_s": 0.05,
        "gdrcopy_required": True,
        "loopback_modes": [],
        "paths": [{"path": str(tmp_path), "min_free_gib": 0, "required": True}],
        "kernel_log_file": str(log),
        "sys_root": str(tmp_path / "root"),
        "tools": {
            name: tools.path(name) for name in ("nvidia-smi", "ibv_devinfo", "fi_info", "systemctl", "dcgmi")
        },
    }


def by_check(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["check"]: r for r in results}


def statuses(config: dict[str, Any], mode: str = "adhoc") -> dict[str, str]:
    return {r["check"]: r["status"] for r in HEALTH.run_checks(config, mode)}


HARDWARE_CHECKS = [
    "gpu_count",
    "gpu_model",
    "gpu_persistence_mode",
    "gpu_temperature",
    "gpu_row_remap",
    "gpu_ecc",
    "gpu_pcie_link",
    "gpu_clock_throttle",
    "fabric_manager",
    "nvlink_state",
    "nvlink_errors",
    "nvlink_fabric",
    "gpu_xid",
    "nvswitch_sxid",
    "dcgm_diag",
    "efa_devices",
    "efa_ports",
    "efa_libfabric",
    "efa_modules",
    "memlock_limit",
    "gdrcopy",
    "gpudirect_rdma",
]


def test_healthy_p5_passes_every_check(config: dict[str, Any]) -> None:
    """Everything the p5.48xlarge promises is there and well: every hardware check passes."""
    got = statuses(config, "prolog")
    assert {name: got[name] for name in HARDWARE_CHECKS} == dict.fromkeys(HARDWARE_CHECKS, "pass")
    assert got["gpu_leftover_processes"] == "pass"
    assert got["efa_loopback"] == "skipped"


GPU_TYPES = sorted(name for name, spec in INSTANCE_TYPES.items() if spec.get("gpus"))


@pytest.mark.parametrize("instance_type", GPU_TYPES)
def test_no_check_passes_when_promised_hardware_is_missing(
    config: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, instance_type: str
) -> None:
    """A GPU type's node with no driver, EFA or tools: the counts fail naming the promise; nothing passes."""
    spec = INSTANCE_TYPES[instance_type]
    config.update(instance_type=instance_type, tools={}, sys_root=str(tmp_path / "empty"))
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    results = by_check(HEALTH.run_checks(config, "prolog"))
    assert results["gpu_count"]["status"] == "fail"
    assert f"0 of {spec['gpus']} GPUs" in results["gpu_count"]["detail"]
    if spec.get("efa_interfaces"):
        assert results["efa_devices"]["status"] == "fail"
        assert f"0 of {spec['efa_interfaces']} EFA devices" in results["efa_devices"]["detail"]
    passed = [name for name, r in results.items() if r["status"] == "pass" and not name.startswith("path ")]
    assert passed == []


def test_absent_by_design_is_the_lab_only_way_out(config: dict[str, Any], tmp_path: Path) -> None:
    """The lab's test double turns every promised-hardware check into absent_by_design: never a pass."""
    config.update(tools={}, sys_root=str(tmp_path / "empty"), hardware_absent_by_design=True)
    results = by_check(HEALTH.run_checks(config, "prolog"))
    for name in HARDWARE_CHECKS:
        assert results[name]["status"] == "absent_by_design", name
    assert "p5.48xlarge promises 8 GPU(s)" in results["gpu_count"]["detail"]
    assert "gpuforge_lab_hardware_absent" in results["gpu_count"]["detail"]
    assert "promises 32 EFA device(s)" in results["efa_devices"]["detail"]


def test_types_without_the_hardware_skip_and_unknown_types_say_so(config: dict[str, Any]) -> None:
    """A c5n.large promises no GPU and no EFA (skipped); a type missing from the data says it is unknown."""
    config["instance_type"] = "c5n.large"
    results = by_check(HEALTH.run_checks(config, "adhoc"))
    assert results["gpu_count"] == {
        "check": "gpu_count",
        "status": "skipped",
        "detail": "c5n.large has no GPU(s)",
    }
    assert results["efa_devices"]["status"] == "skipped"
    config["instance_type"] = "x9.unknown"
    results = by_check(HEALTH.run_checks(config, "adhoc"))
    assert results["gpu_count"]["status"] == "skipped"
    assert "x9.unknown is not in data/instance_types.yml" in results["gpu_count"]["detail"]


def replace_rows(text: str, index: int, row: str) -> str:
    lines = text.splitlines()
    lines[index] = row
    return "\n".join(lines) + "\n"


# (check, tool, args, fixture, line to change (None: replace the output), new text, rc, detail)
FAILURES = [
    (
        "gpu_count",
        "nvidia-smi",
        GPU_QUERY,
        "smi-gpus-p5.csv",
        None,
        "".join(f"{i}, NVIDIA H100 80GB HBM3, Enabled, 33\n" for i in range(7)),
        0,
        "7 of 8 GPUs",
    ),
    (
        "gpu_count",
        "nvidia-smi",
        GPU_QUERY,
        "smi-gpus-p5.csv",
        None,
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
        9,
        "0 of 8 GPUs usable",
    ),
    (
        "gpu_model",
        "nvidia-smi",
        GPU_QUERY,
        "smi-gpus-p5.csv",
        3,
        "3, NVIDIA A100-SXM4-80GB, Enabled, 33",
        0,
        "GPU 3 is NVIDIA A100-SXM4-80GB (expected H100)",
    ),
    (
        "gpu_persistence_mode",
        "nvidia-smi",
        GPU_QUERY,
        "smi-gpus-p5.csv",
        5,
        "5, NVIDIA H100 80GB HBM3, Disabled, 33",
        0,
        "persistence mode off on GPU 5",
    ),
    (
        "gpu_temperature",
        "nvidia-smi",
        GPU_QUERY,
        "smi-gpus-p5.csv",
        2,
        "2, NVIDIA H100 80GB HBM3, Enabled, 85",
        0,
        "GPU 2 at 85 C (limit 85 C)",
    ),
    (
        "gpu_row_remap",
        "nvidia-smi",
        REMAP_QUERY,
        "smi-remapped-rows-p5.csv",
        1,
        "00000000:64:00.0, 1, 0",
        0,
        "row remap pending on 00000000:64:00.0 (GPU reset needed)",
    ),
    (
        "gpu_row_remap",
        "nvidia-smi",
        REMAP_QUERY,
        "smi-remapped-rows-p5.csv",
        6,
        "00000000:B9:00.0, 0, 1",
        0,
        "row remap failed on 00000000:B9:00.0 (replace the GPU)",
    ),
    (
        "gpu_ecc",
        "nvidia-smi",
        ECC_QUERY,
        "smi-ecc-p5.csv",
        4,
        "4, 2, [N/A]",
        0,
        "GPU 4: 2 uncorrectable ECC errors",
    ),
    (
        "gpu_ecc",
        "nvidia-smi",
        ECC_QUERY,
        "smi-ecc-p5.csv",
        0,
        "0, 0, Yes",
        0,
        "GPU 0: page retirement pending",
    ),
    (
        "gpu_pcie_link",
        "nvidia-smi",
        PCIE_QUERY,
        "smi-pcie-p5.csv",
        7,
        "7, 5, 8, 16",
        0,
        "GPU 7 at Gen5 x8 (expected Gen5 x16)",
    ),
    ("gpu_pcie_link", "nvidia-smi", PCIE_QUERY, "smi-pcie-p5.csv", 1, "1, 3, 16, 16", 0, "GPU 1 at Gen3 x16"),
    (
        "gpu_clock_throttle",
        "nvidia-smi",
        THROTTLE_QUERY,
        "smi-throttle-p5.csv",
        2,
        "2, Active, Not Active, Not Active, Not Active",
        0,
        "GPU 2 hw_slowdown",
    ),
    (
        "gpu_clock_throttle",
        "nvidia-smi",
        THROTTLE_QUERY,
        "smi-throttle-p5.csv",
        6,
        "6, Not Active, Active, Not Active, Not Active",
        0,
        "GPU 6 hw_thermal_slowdown",
    ),
    (
        "gpu_leftover_processes",
        "nvidia-smi",
        APPS_QUERY,
        None,
        None,
        "48213, python3, 61234\n",
        0,
        "1 process(es) still on the GPUs: pid 48213 python3",
    ),
    (
        "nvlink_state",
        "nvidia-smi",
        "nvlink --status",
        "smi-nvlink-status-p5.txt",
        20,
        "\t Link 1: <inactive>",
        0,
        "1 of 144 NVLinks inactive",
    ),
    (
        "nvlink_errors",
        "nvidia-smi",
        "nvlink --errorcounters",
        "smi-nvlink-errors-p5.txt",
        2,
        "\t Link 0: Recovery Errors: 3",
        0,
        "Recovery errors 3 (limit 0)",
    ),
    (
        "fabric_manager",
        "systemctl",
        "is-active nvidia-fabricmanager",
        None,
        None,
        "failed\n",
        3,
        "nvidia-fabricmanager is failed",
    ),
    ("dcgm_diag", "dcgmi", "diag -r 1", None, None, "| Memory    | Fail - GPU 3 |\n", 226, "Fail - GPU 3"),
    ("efa_devices", "ibv_devinfo", "", "ibv_devinfo-p5.txt", None, None, 0, "31 of 32 EFA devices"),
    (
        "efa_ports",
        "ibv_devinfo",
        "",
        "ibv_devinfo-p5.txt",
        10,
        "\t\t\tstate:\t\t\tPORT_DOWN (1)",
        0,
        "port not PORT_ACTIVE on rdmap79s0",
    ),
    (
        "efa_libfabric",
        "fi_info",
        "-p efa -t FI_EP_RDM",
        None,
        None,
        "fi_getinfo: -61 (No data available)\n",
        1,
        "0 of 32 EFA domains",
    ),
]


@pytest.mark.parametrize(
    ("check", "tool", "args", "source", "index", "text", "rc", "detail"),
    FAILURES,
    ids=[f"{f[0]}-{i}" for i, f in enumerate(FAILURES)],
)
def test_each_check_fails_on_its_fault(
    config: dict[str, Any],
    tools: Tools,
    check: str,
    tool: str,
    args: str,
    source: str | None,
    index: int | None,
    text: str | None,
    rc: int,
    detail: str,
) -> None:
    """One fault in one recorded output fails exactly the check that looks at it, saying what it saw."""
    if source is not None and text is None:
        # Drop the last EFA device from ibv_devinfo.
        output = "hca_id:".join(fixture(source).split("hca_id:")[:-1]).rstrip() + "\n"
    elif source is not None and index is not None:
        assert text is not None
        output = replace_rows(fixture(source), index, text)
    else:
        assert text is not None
        output = text
    tools.set(tool, args, output, rc)
    results = by_check(HEALTH.run_checks(config, "prolog"))
    assert results[check]["status"] == "fail", results[check]
    assert detail in results[check]["detail"]


@pytest.mark.parametrize(
    ("missing", "check", "detail"),
    [
        ("sys/module/efa", "efa_modules", "not loaded: efa"),
        ("sys/module/ib_uverbs", "efa_modules", "not loaded: ib_uverbs"),
        ("dev/gdrdrv", "gdrcopy", "gdrdrv not loaded"),
        (
            "sys/class/infiniband/rdmap83s0/device/p2p",
            "gpudirect_rdma",
            "no NVIDIA peer-to-peer on rdmap83s0",
        ),
    ],
)
def test_sysfs_checks(config: dict[str, Any], missing: str, check: str, detail: str) -> None:
    """Kernel modules, the GDRCopy device and each EFA device's GPUDirect RDMA path come from sysfs."""
    path = Path(config["sys_root"]) / missing
    if path.is_dir():
        path.rmdir()
    else:
        path.unlink()
    result = by_check(HEALTH.run_checks(config, "adhoc"))[check]
    assert result["status"] == "fail"
    assert detail in result["detail"]


def test_memlock_limit(config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """EFA needs unlimited locked memory; Debian's default 8 MiB fails."""
    monkeypatch.setattr(HEALTH.resource, "getrlimit", lambda _: (8 * 2**20, 8 * 2**20))
    result = by_check(HEALTH.run_checks(config, "adhoc"))["memlock_limit"]
    assert (result["status"], result["detail"]) == (
        "fail",
        "locked memory limited to 8192 KiB (EFA needs unlimited)",
    )


def test_nvswitch_checks_only_on_nvswitch_types(config: dict[str, Any]) -> None:
    """A g6.48xlarge (L4, no NVSwitch, no GPUDirect RDMA) does not look for fabric manager or NVLinks."""
    config["instance_type"] = "g6.48xlarge"
    got = statuses(config)
    assert {
        got[n] for n in ("fabric_manager", "nvlink_state", "nvlink_errors", "nvswitch_sxid", "gpudirect_rdma")
    } == {"skipped"}
    assert got["gpu_model"] == "fail"  # the stand-in prints H100s, the type promises L4s


def test_dcgm_level_per_mode(config: dict[str, Any], tools: Tools) -> None:
    """Prolog runs the quick level 1, after boot level 2, ad hoc level 3; 0 (the epilog here) turns it off."""
    for mode, level in (("prolog", 1), ("boot", 2), ("adhoc", 3)):
        result = by_check(HEALTH.run_checks(config, mode))["dcgm_diag"]
        assert (result["status"], result["detail"]) == ("pass", f"dcgmi diag -r {level} passed")
    assert by_check(HEALTH.run_checks(config, "epilog"))["dcgm_diag"]["status"] == "skipped"
    assert DEFAULTS["health_dcgm_level"] == {"prolog": 1, "epilog": 0, "boot": 2, "adhoc": 3}


# Kernel-log lines as published:
# - Xid 63: stas00/ml-engineering compute/accelerator/nvidia/debug.md.
# - Xid 79: NVIDIA, "Analyzing Xid Errors with the Xid Catalog", step 1.
# - Xid 119: plexus.company/guides/gpu-xid-errors/119 ("Typical kernel-log signature").
# - Xid 154: the string NVIDIA's catalog gives for it ("GPU recovery action changed from 0x0 (None) to
#   0x2 (Node Reboot Required)").
# - SXid: the NVSwitch error format of NVIDIA's Fabric Manager user guide.
XID_63 = (
    "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, "
    "reset gpu to activate."
)
XID_79 = "NVRM: Xid (PCI:0000:5a:00): 79, GPU has fallen off the bus."
XID_119 = "NVRM: Xid (PCI:0000:65:00): 119, pid='N/A', Timeout waiting for RPC from GSP"
XID_13 = "NVRM: Xid (PCI:0000:53:00): 13, pid=4242, name=python3, Graphics Exception: ESR 0x514648=0x1000f"
XID_31 = "NVRM: Xid (PCI:0000:53:00): 31, pid=4242, name=python3, Ch 00000008, intr 00000000. MMU Fault"
XID_43 = "NVRM: Xid (PCI:0000:53:00): 43, pid=4242, name=python3, Ch 00000008"
XID_45 = "NVRM: Xid (PCI:0000:53:00): 45, pid=4242, name=python3, Ch 00000008"
XID_48 = (
    "NVRM: Xid (PCI:0000:53:00): 48, pid=4242, name=python3, "
    "An uncorrectable double bit error (DBE) has been detected"
)


def xid_154(device: str, old: str, new: str) -> str:
    codes = {"None": "0x0", "GPU Reset Required": "0x1", "Node Reboot Required": "0x2", "Drain P2P": "0x3"}
    change = f"from {codes[old]} ({old}) to {codes[new]} ({new})"
    return f"NVRM: Xid ({device}): 154, GPU recovery action changed {change}"


@pytest.mark.parametrize(
    ("lines", "status", "action", "klass"),
    [
        ([], "pass", "none", None),
        ([XID_13, XID_31, XID_43, XID_45], "pass", "none", "application"),
        ([XID_63], "pass", "none", "application"),
        ([XID_48], "fail", "reset", "hardware"),
        ([XID_119], "fail", "reset", "hardware"),
        ([XID_48, XID_79], "fail", "reboot", "hardware"),
        ([XID_13, xid_154("PCI:0000:53:00", "None", "Node Reboot Required")], "fail", "reboot", "hardware"),
        (
            [
                XID_48,
                xid_154("PCI:0000:53:00", "None", "GPU Reset Required"),
                xid_154("PCI:0000:53:00", "GPU Reset Required", "None"),
            ],
            "pass",
            "none",
            "hardware",
        ),
        ([xid_154("PCI:0000:53:00", "GPU Reset Required", "None"), XID_48], "fail", "reset", "hardware"),
        (["NVRM: Xid (PCI:0000:53:00): 167, PCIE_FATAL_TIMEOUT"], "fail", "reset", "hardware"),
    ],
    ids=[
        "clean",
        "application-xids",
        "row-remap-event-only",
        "dbe",
        "gsp-timeout",
        "reboot-wins",
        "xid154-says-reboot",
        "xid154-cleared",
        "hardware-after-xid154",
        "xid-167",
    ],
)
def test_xid_classification(
    config: dict[str, Any], lines: list[str], status: str, action: str, klass: str | None
) -> None:
    """Hardware XIDs fail with NVIDIA's action, application ones do not; Xid 154 says what a GPU needs now."""
    Path(config["kernel_log_file"]).write_text(
        "".join(f"[  12.{i}] {line}\n" for i, line in enumerate(lines))
    )
    result = by_check(HEALTH.run_checks(config, "prolog"))["gpu_xid"]
    assert (result["status"], result["action"]) == (status, action)
    if klass is not None:
        assert klass in result["detail"]


def test_xid_catalog_covers_the_current_catalog() -> None:
    """Xids up to 169 from NVIDIA's catalog are classified; the application ones are not hardware."""
    catalog = HEALTH.XID_CATALOG
    assert max(catalog) >= 168 - 1 and {109, 119, 120, 136, 140, 143, 154, 155, 158} <= set(catalog)
    for app in (13, 31, 43, 45):
        assert catalog[app] not in HEALTH.HARDWARE_BUCKETS, app
    for hw in (48, 64, 74, 79, 95, 119, 140):
        assert catalog[hw] in HEALTH.HARDWARE_BUCKETS, hw


@pytest.mark.parametrize(
    ("line", "status"),
    [
        (
            "nvidia-nvswitch3: SXid (PCI:0000:c6:00.0): 24007, Fatal, Link 28 sourcetrack TCEN0 crumbstore "
            "ECC DBE Error",
            "fail",
        ),
        (
            "nvidia-nvswitch2: SXid (PCI:0000:15:00.0): 28006, Non-fatal, Link 02 MC TS crumbstore "
            "MCTO (First)",
            "pass",
        ),
    ],
    ids=["fatal", "non-fatal"],
)
def test_sxid(config: dict[str, Any], line: str, status: str) -> None:
    """A fatal NVSwitch SXid fails the node; a non-fatal one is reported."""
    Path(config["kernel_log_file"]).write_text(f"[  40.1] {line}\n")
    result = by_check(HEALTH.run_checks(config, "adhoc"))["nvswitch_sxid"]
    assert result["status"] == status
    assert line.split(": ")[2].split(",")[0] in result["detail"]


def test_a_clean_kernel_log_is_no_pass_without_the_gpus(config: dict[str, Any], tools: Tools) -> None:
    """With a GPU missing, the XID and SXid checks are not judged: their silence proves nothing."""
    tools.set(
        "nvidia-smi", GPU_QUERY, "".join(f"{i}, NVIDIA H100 80GB HBM3, Enabled, 33\n" for i in range(7))
    )
    got = by_check(HEALTH.run_checks(config, "adhoc"))
    assert got["gpu_xid"]["status"] == "skipped"
    assert got["gpu_xid"]["detail"].startswith("not judged while gpu_count fails")


def test_paths(config: dict[str, Any], tmp_path: Path) -> None:
    """A missing required path or one short of free space fails; a missing optional one is skipped."""
    config["paths"] = [
        {"path": str(tmp_path / "checkpoints"), "required": True},
        {"path": str(tmp_path / "fsx"), "required": False},
        {"path": str(tmp_path), "min_free_gib": 10**9},
    ]
    results = [r["status"] for r in HEALTH.run_checks(config, "adhoc") if r["check"].startswith("path ")]
    assert results == ["fail", "skipped", "fail"]


def run_script(config: dict[str, Any], tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The script as slurmd runs it, through a fallback --config, with a minimal environment.

    The node is a p5.48xlarge without EFA (an instance-type row of this test's own), because the
    memlock check reads the real process limit, which this machine keeps at 8 MiB.
    """
    spec = dict(INSTANCE_TYPES["p5.48xlarge"], efa_interfaces=0)
    config = dict(config, instance_type="test.p5-no-efa", instance_types={"test.p5-no-efa": spec})
    path = tmp_path / "health.json"
    path.write_text(json.dumps(config))
    return subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--config",
            str(tmp_path / "missing.json"),
            "--config",
            str(path),
            *args,
        ],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "SLURMD_NODENAME": "gpu-st-p5-48xlarge-7"},
    )


def fake_scontrol(tmp_path: Path, shown: str) -> tuple[Path, Path]:
    """A stand-in scontrol: `show node` prints `shown`, `update` records its arguments."""
    calls = tmp_path / "scontrol.calls"
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = show ]; then echo {shlex.quote(shown)}; exit 0; fi\n'
        f"printf '%s\\n' \"$@\" >> {calls}\n"
    )
    scontrol.chmod(0o755)
    return scontrol, calls


def test_prolog_failure_drains_the_node_naming_the_check(
    config: dict[str, Any], tools: Tools, tmp_path: Path
) -> None:
    """As a prolog with --drain: exit 1, the reason on stderr, scontrol drains the node naming the check."""
    tools.set(
        "nvidia-smi", GPU_QUERY, "".join(f"{i}, NVIDIA H100 80GB HBM3, Enabled, 33\n" for i in range(7))
    )
    scontrol, calls = fake_scontrol(tmp_path, "NodeName=gpu-st-p5-48xlarge-7 State=IDLE Reason=(null)")
    config["tools"]["scontrol"] = str(scontrol)
    proc = run_script(config, tmp_path, "--mode", "prolog", "--drain")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "gpu_count: 7 of 8 GPUs visible to nvidia-smi" in proc.stderr
    assert calls.read_text().splitlines() == [
        "update",
        "NodeName=gpu-st-p5-48xlarge-7",
        "State=DRAIN",
        "Reason=gpuforge-health prolog: gpu_count",
    ]
    assert "drained gpu-st-p5-48xlarge-7" in proc.stderr


def test_the_first_drain_reason_stays(config: dict[str, Any], tools: Tools, tmp_path: Path) -> None:
    """The epilog after a failed prolog fails too, but leaves the prolog's reason in place."""
    tools.set("nvidia-smi", GPU_QUERY, "NVIDIA-SMI has failed", 9)
    shown = "NodeName=gpu-st-p5-48xlarge-7 State=IDLE+DRAIN Reason=gpuforge-health prolog: gpu_count [root@t]"
    scontrol, calls = fake_scontrol(tmp_path, shown)
    config["tools"]["scontrol"] = str(scontrol)
    proc = run_script(config, tmp_path, "--mode", "epilog", "--drain")
    assert proc.returncode == 1
    assert not calls.exists()
    assert "already drained: gpuforge-health prolog: gpu_count" in proc.stderr


def test_a_controller_that_does_not_answer_is_reported_not_a_traceback(
    config: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scontrol hanging on a slow slurmctld: the drain says it did not happen, within one deadline for both
    calls (a show that answers slowly leaves the update only what is left)."""
    # The deadline outlasts scontrol's connect retries and its wait for the answer, each as long as the
    # MessageTimeout the slurm role writes; a prolog's ends before the role's BatchStartTimeout.
    timers = yaml.safe_load((REPO / "roles/slurm/vars/main.yml").read_text())["_slurm_timers"]
    assert 2 * timers["MessageTimeout"] < HEALTH.SCONTROL_TIMEOUT
    assert timers["BatchStartTimeout"] > HEALTH.PROLOG_BUDGET_S
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        '#!/bin/sh\n[ "$1" = show ] && { sleep 0.6; echo State=IDLE; exit 0; }\nexec sleep 30\n'
    )
    scontrol.chmod(0o755)
    config["tools"]["scontrol"] = str(scontrol)
    monkeypatch.setattr(HEALTH, "SCONTROL_TIMEOUT", 1.0)
    started = time.monotonic()
    said = HEALTH.drain(config, "epilog", [{"check": "gpu_count"}])
    assert time.monotonic() - started < 2.0
    assert said.startswith("scontrol update NodeName="), said
    assert said.endswith("did not answer in time: the node was not drained"), said
    # A prolog whose budget is spent does not wait at all.
    monkeypatch.setattr(HEALTH, "STARTED", time.monotonic() - HEALTH.PROLOG_BUDGET_S)
    said = HEALTH.drain(config, "prolog", [{"check": "gpu_count"}])
    assert said.startswith("scontrol show node") and said.endswith(
        "did not answer in time: the node was not drained"
    )


def test_a_show_that_fails_drains_nothing(config: dict[str, Any], tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        f'#!/bin/sh\necho "$1" >> {calls}\n'
        'echo "slurm_load_node error: Unable to contact slurm controller" >&2\nexit 1\n'
    )
    scontrol.chmod(0o755)
    config["tools"]["scontrol"] = str(scontrol)
    said = HEALTH.drain(config, "boot", [{"check": "gpu_count"}])
    assert said.endswith(
        "failed: slurm_load_node error: Unable to contact slurm controller: the node was not drained"
    )
    assert calls.read_text().split() == ["show"]


def test_drain_reason_names_causes_and_counts_consequences() -> None:
    """A node without its GPUs and EFA is drained for gpu_count and efa_devices, not 20 check names."""
    failed = [
        {"check": n} for n in ("gpu_count", "gpu_model", "gpu_xid", "efa_devices", "efa_ports", "path /x")
    ]
    assert HEALTH.drain_reason("boot", failed) == (
        "gpuforge-health boot: gpu_count, efa_devices, path /x (+3 dependent)"
    )


def test_healthy_prolog_exits_zero_and_does_not_drain(config: dict[str, Any], tmp_path: Path) -> None:
    """A healthy node: exit 0, healthy in the JSON report, no drain."""
    config["tools"]["scontrol"] = str(tmp_path / "no-scontrol")
    proc = run_script(config, tmp_path, "--mode", "prolog", "--drain", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["healthy"] is True and "drain" not in report


def test_no_configuration_is_a_clear_error(tmp_path: Path) -> None:
    """Without any configuration file the script says where it looked, without a traceback."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--config", str(tmp_path / "nope.json")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("gpuforge-health: error: no configuration found")


@pytest.mark.parametrize(
    ("client_rc", "status"), [(0, "pass"), (1, "fail")], ids=["loopback-ok", "loopback-broken"]
)
def test_efa_loopback(config: dict[str, Any], tools: Tools, client_rc: int, status: str) -> None:
    """Ad hoc and after boot, fi_pingpong over EFA between a server and a client on this node."""
    server = "-p efa -e rdm -P 47592"
    tools.set("fi_pingpong", server, "bytes   #sent   #ack     total       time     MB/sec\n")
    tools.set("fi_pingpong", f"{server} localhost", "fi_getinfo(): -61 (No data available)\n", client_rc)
    config.update(loopback_modes=["adhoc", "boot"])
    config["tools"]["fi_pingpong"] = tools.path("fi_pingpong")
    result = by_check(HEALTH.run_checks(config, "boot"))["efa_loopback"]
    assert result["status"] == status, result
    assert by_check(HEALTH.run_checks(config, "prolog"))["efa_loopback"]["status"] == "skipped"


def test_row_remapping_not_supported_is_skipped_not_failed(config: dict[str, Any], tools: Tools) -> None:
    """A GPU without a row remapper (GDDR: A10G, L4) is not drained for it, nor does it pass."""
    tools.set("nvidia-smi", REMAP_QUERY, 'Field "remapped_rows.pending" is Not Supported on this GPU\n', 2)
    result = by_check(HEALTH.run_checks(config, "adhoc"))["gpu_row_remap"]
    assert result["status"] == "skipped" and "not supported" in result["detail"]


class FakeIMDS(http.server.BaseHTTPRequestHandler):
    """IMDSv2 on loopback (a test double): a token for a PUT, the instance type for that token only."""

    instance_type = "g6.48xlarge"

    def do_PUT(self) -> None:
        ok = self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        self._reply(200 if ok else 400, "fake-token")

    def do_GET(self) -> None:
        ok = self.path == "/latest/meta-data/instance-type"
        authorized = self.headers.get("X-aws-ec2-metadata-token") == "fake-token"
        self._reply(200 if ok and authorized else 401, self.instance_type)

    def _reply(self, code: int, body: str) -> None:
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def imds() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeIMDS)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_instance_type_comes_from_imds_at_run_time(config: dict[str, Any], imds: str) -> None:
    """On EC2 the checks judge the type IMDSv2 names now (an image configured on a p5 booted as a g6)."""
    dmi = Path(config["sys_root"]) / "sys" / "class" / "dmi" / "id"
    dmi.mkdir(parents=True)
    (dmi / "board_vendor").write_text("Amazon EC2\n")
    config.update(imds=True, imds_endpoint=imds)
    assert HEALTH.resolve_instance_type(config) == "g6.48xlarge"
    results = by_check(HEALTH.run_checks(config, "adhoc"))
    assert results["nvlink_state"]["detail"] == "g6.48xlarge has no NVSwitch"
    assert results["gpu_model"]["status"] == "fail"  # the stand-in's H100s are not a g6's L4s
    # Off EC2, or with IMDS off, the recorded type stands.
    (dmi / "board_vendor").write_text("QEMU\n")
    assert HEALTH.resolve_instance_type(config) == "p5.48xlarge"
    (dmi / "board_vendor").write_text("Amazon EC2\n")
    config["imds"] = False
    assert HEALTH.resolve_instance_type(config) == "p5.48xlarge"
    # IMDS unreachable: the recorded type, not a failure to start.
    config.update(imds=True, imds_endpoint="http://127.0.0.1:9")
    assert HEALTH.resolve_instance_type(config) == "p5.48xlarge"


def test_every_gpu_model_and_rdma_type_has_its_expectation() -> None:
    """A GPU model without a PCIe expectation, or a GPUDirect type that is not a known GPU type, would
    make those checks report skipped on real nodes: every model in data/instance_types.yml has one."""
    defaults = yaml.safe_load((REPO / "roles" / "health" / "defaults" / "main.yml").read_text())
    models = {spec["gpu_model"] for spec in INSTANCE_TYPES.values() if spec.get("gpu_model")}
    assert models <= set(defaults["health_pcie_by_gpu_model"]), models - set(
        defaults["health_pcie_by_gpu_model"]
    )
    rdma = set(defaults["health_gpudirect_rdma_types"])
    assert rdma <= set(INSTANCE_TYPES)
    assert "p6-b200.48xlarge" in rdma


# --- p6-b200: EFA devices beside the NVLink management NICs ---------------------------------------


@pytest.fixture
def p6(config: dict[str, Any], tools: Tools, tmp_path: Path) -> dict[str, Any]:
    """A p6-b200.48xlarge: 8 EFA devices and 2 mlx5 NVLink management NICs (recorded, partly assumed)."""
    recorded_sys(tmp_path / "p6", "sysfs-infiniband-p6-b200.txt")
    tools.set("ibv_devinfo", "", fixture("ibv_devinfo-p6-b200.txt"))
    tools.set("fi_info", "-p efa -t FI_EP_RDM", fixture("fi_info-efa-p6-b200.txt"))
    config.update(instance_type="p6-b200.48xlarge", sys_root=str(tmp_path / "p6"))
    return config


def test_p6_b200_counts_ports_and_p2p_checks_only_efa_devices(p6: dict[str, Any]) -> None:
    """ibv_devinfo and sysfs also list the mlx5 NICs: only the 8 devices bound to efa are EFA devices."""
    got = by_check(HEALTH.run_checks(p6, "prolog"))
    assert got["efa_devices"]["status"] == "pass", got["efa_devices"]
    assert got["efa_devices"]["detail"] == (
        "8 of 8 EFA devices; not counted: mlx5_0 (mlx5_core), mlx5_1 (mlx5_core)"
    )
    assert got["efa_ports"] == {
        "check": "efa_ports",
        "status": "pass",
        "detail": "every port of 8 devices PORT_ACTIVE",
    }
    assert got["efa_libfabric"]["status"] == "pass"
    assert got["gpudirect_rdma"]["detail"] == "NVIDIA peer-to-peer on 8 EFA devices"
    assert got["gpudirect_rdma"]["status"] == "pass"


def test_p6_b200_lists_its_nvlink_management_nics(p6: dict[str, Any]) -> None:
    """The NVLink management NICs are a check of their own, listed with their ports' state."""
    got = by_check(HEALTH.run_checks(p6, "adhoc"))["nvlink_mgmt_nics"]
    assert got["status"] == "pass", got
    assert got["detail"] == "2 NVLink management NIC(s): mlx5_0: port 1 ACTIVE; mlx5_1: port 1 ACTIVE"
    assert got["nics"] == {"mlx5_0": ["port 1 ACTIVE"], "mlx5_1": ["port 1 ACTIVE"]}


def test_an_efa_port_down_on_p6_b200_is_still_caught(p6: dict[str, Any], tools: Tools) -> None:
    """Filtering the mlx5 NICs out does not hide an EFA port that is down."""
    text = fixture("ibv_devinfo-p6-b200.txt").replace("PORT_ACTIVE (4)", "PORT_DOWN (1)", 1)
    tools.set("ibv_devinfo", "", text)
    got = by_check(HEALTH.run_checks(p6, "adhoc"))["efa_ports"]
    assert (got["status"], got["detail"]) == ("fail", "port not PORT_ACTIVE on rdmap16s0")


@pytest.mark.parametrize(
    ("change", "detail"),
    [
        ("port-down", "port not ACTIVE on mlx5_1 (mlx5_0: port 1 ACTIVE; mlx5_1: port 1 DOWN)"),
        ("no-nics", "no NVLink management NIC (mlx5_core RDMA device) in /sys/class/infiniband"),
        ("no-ib_umad", "kernel module ib_umad not loaded"),
    ],
)
def test_nvlink_management_nic_faults(p6: dict[str, Any], change: str, detail: str) -> None:
    """A management NIC port not ACTIVE, no such NIC at all, or ib_umad not loaded fails the check."""
    root = Path(p6["sys_root"])
    infiniband = root / "sys" / "class" / "infiniband"
    if change == "port-down":
        (infiniband / "mlx5_1" / "ports" / "1" / "state").write_text("1: DOWN\n")
    elif change == "no-nics":
        for name in ("mlx5_0", "mlx5_1"):
            (infiniband / name / "device" / "driver").unlink()
    else:
        (root / "sys" / "module" / "ib_umad").rmdir()
    got = by_check(HEALTH.run_checks(p6, "adhoc"))["nvlink_mgmt_nics"]
    assert got["status"] == "fail"
    assert detail in got["detail"]


@pytest.mark.parametrize("instance_type", ["p5.48xlarge", "p4d.24xlarge", "g6.48xlarge", "p5.4xlarge"])
def test_types_without_nvlink_management_nics_are_not_failed(
    config: dict[str, Any], instance_type: str
) -> None:
    """Only NVSwitch types with Blackwell GPUs have the NICs; the others skip the check, never fail it."""
    config["instance_type"] = instance_type
    got = by_check(HEALTH.run_checks(config, "adhoc"))["nvlink_mgmt_nics"]
    assert got["status"] == "skipped"
    assert got["detail"].startswith(f"{instance_type} has no NVLink management NICs")


def test_every_blackwell_nvswitch_type_expects_the_nics() -> None:
    """The promise comes from data/instance_types.yml: NVSwitch and a Blackwell GPU (p6-b200 today)."""
    expecting = sorted(
        name
        for name, spec in INSTANCE_TYPES.items()
        if spec.get("nvswitch")
        and GPU_MODELS.get(spec.get("gpu_model"), {}).get("architecture") == "Blackwell"
    )
    assert expecting == ["p6-b200.48xlarge"]
    assert all(INSTANCE_TYPES[name].get("nvlink_subnet_manager") for name in expecting)


# --- NVLink fabric registration -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("instance_type", "output", "rc", "status", "detail"),
    [
        ("p5.48xlarge", fixture("smi-fabric-p5.csv"), 0, "pass", "8 GPUs registered with the NVLink fabric"),
        (
            "p5.48xlarge",
            fixture("smi-fabric-p5-in-progress.csv"),
            0,
            "fail",
            "GPU 3 fabric registration In Progress (CUDA error 802 until it completes)",
        ),
        (
            "p5.48xlarge",
            replace_rows(fixture("smi-fabric-p5.csv"), 6, "6, Completed, Insufficient Resources"),
            0,
            "fail",
            "GPU 6 fabric registration completed with status Insufficient Resources",
        ),
        (
            "p5.48xlarge",
            "".join(f"{i}, [N/A], [N/A]\n" for i in range(8)),
            0,
            "fail",
            "fabric state not reported on GPU 0, GPU 1",
        ),
        (
            "p6-b200.48xlarge",
            "".join(f"{i}, [N/A], [N/A]\n" for i in range(8)),
            0,
            "fail",
            "(Blackwell NVSwitch GPUs must report Completed)",
        ),
        (
            "p4d.24xlarge",
            "".join(f"{i}, [N/A], [N/A]\n" for i in range(8)),
            0,
            "skipped",
            "fabric state not reported on Ampere GPUs",
        ),
        ("g6.48xlarge", "", 0, "skipped", "g6.48xlarge has no NVSwitch"),
    ],
    ids=[
        "p5-completed",
        "p5-in-progress",
        "p5-error-status",
        "hopper-na",
        "blackwell-na",
        "ampere-na",
        "no-nvswitch",
    ],
)
def test_nvlink_fabric_registration(
    config: dict[str, Any], tools: Tools, instance_type: str, output: str, rc: int, status: str, detail: str
) -> None:
    """Every GPU Completed/Success passes; In Progress or an error fails; N/A passes nowhere."""
    tools.set("nvidia-smi", FABRIC_QUERY, output, rc)
    config["instance_type"] = instance_type
    got = by_check(HEALTH.run_checks(config, "adhoc"))["nvlink_fabric"]
    assert got["status"] == status, got
    assert detail in got["detail"]


# --- PCIe generation under load -------------------------------------------------------------------


def test_a_link_trained_down_a_generation_fails_under_load(config: dict[str, Any], tools: Tools) -> None:
    """pcie.link.gen.max says Gen5, but under dcgmi diag GPU 3's link runs at Gen4: fail."""
    tools.set(
        "nvidia-smi", PCIE_GEN_NOW_QUERY, replace_rows(fixture("smi-pcie-gen-current-p5.csv"), 3, "3, 4")
    )
    # boot runs dcgmi diag -r 2, whose PCIe plugin loads the link (the prolog's -r 1 does not).
    got = by_check(HEALTH.run_checks(config, "boot"))["gpu_pcie_link"]
    assert (got["status"], got["detail"]) == (
        "fail",
        "GPU 3 at Gen4 x16 under load (max Gen5) (expected Gen5 x16)",
    )


def test_the_prolog_short_diagnostic_does_not_judge_idle_links(config: dict[str, Any], tools: Tools) -> None:
    """dcgmi diag -r 1 runs software checks only (no GPU load): healthy links idling at Gen1 meanwhile
    are not judged (and never drain the node); the detail says why."""
    tools.set("nvidia-smi", PCIE_GEN_NOW_QUERY, "".join(f"{i}, 1\n" for i in range(8)))
    got = by_check(HEALTH.run_checks(config, "prolog"))["gpu_pcie_link"]
    assert (got["status"], got["detail"]) == (
        "pass",
        "every GPU at x16 or wider; generation not judged: dcgmi diag -r 1 runs software checks only "
        "and does not load the PCIe link (level 2 does); max Gen5",
    )


def test_without_load_the_generation_is_not_judged(config: dict[str, Any], tools: Tools) -> None:
    """The epilog runs no dcgmi diag: the detail says the generation was not judged, not that it passed."""
    tools.set("nvidia-smi", PCIE_GEN_NOW_QUERY, "".join(f"{i}, 1\n" for i in range(8)))
    got = by_check(HEALTH.run_checks(config, "epilog"))["gpu_pcie_link"]
    assert got["detail"] == (
        "every GPU at x16 or wider; generation not judged: no load in this mode "
        "(dcgmi diag turned off for epilog); max Gen5"
    )


def test_the_highest_generation_seen_during_the_diagnostic_counts(
    config: dict[str, Any], tools: Tools, tmp_path: Path
) -> None:
    """Idle GPUs report Gen1; the samples taken while dcgmi diag runs find Gen5, and that is judged."""
    tools.set("dcgmi", "diag -r 2", "| Deployment | Pass |\n| Memory    | Pass |\n")
    dcgmi = tmp_path / "slow-dcgmi"
    dcgmi.write_text(f'#!/bin/sh\nsleep 1\nexec {tools.path("dcgmi")} "$@"\n')
    dcgmi.chmod(0o755)
    # The first sample sees idle links (Gen1), every later one the loaded links (Gen5).
    count = tmp_path / "samples"
    smi = tmp_path / "loaded-nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = {PCIE_GEN_NOW_QUERY} ]; then\n'
        f"  echo x >> {count}\n"
        f'  if [ "$(wc -l < {count})" -eq 1 ]; then gen=1; else gen=5; fi\n'
        '  for i in 0 1 2 3 4 5 6 7; do echo "$i, $gen"; done; exit 0\n'
        "fi\n"
        f'exec {tools.path("nvidia-smi")} "$@"\n'
    )
    smi.chmod(0o755)
    config["tools"].update({"dcgmi": str(dcgmi), "nvidia-smi": str(smi)})
    got = by_check(HEALTH.run_checks(config, "boot"))
    assert len(count.read_text().splitlines()) >= 2
    assert got["gpu_pcie_link"] == {
        "check": "gpu_pcie_link",
        "status": "pass",
        "detail": "every GPU at Gen5 x16 or better (generation sampled under dcgmi diag -r 2)",
    }
    assert got["dcgm_diag"]["status"] == "pass"


# --- GDRCopy: required where the image carries it ------------------------------------------------


def dpkg_status(root: Path, package: str, status: str) -> None:
    (root / "var" / "lib" / "dpkg").mkdir(parents=True, exist_ok=True)
    stanzas = ["Package: libc6\nStatus: install ok installed\n", f"Package: {package}\nStatus: {status}\n"]
    (root / "var" / "lib" / "dpkg" / "status").write_text("\n".join(stanzas))


@pytest.mark.parametrize(
    ("image", "loaded", "status", "detail"),
    [
        ("none", False, "skipped", "auto: GDRCopy not installed on this image"),
        ("package", False, "fail", "gdrdrv not loaded (no /dev/gdrdrv; auto: GDRCopy installed (package"),
        ("package", True, "pass", "auto: GDRCopy installed (package gdrdrv-dkms installed)"),
        ("removed-package", False, "skipped", "auto: GDRCopy not installed on this image"),
        ("module", False, "fail", "auto: GDRCopy installed (module gdrdrv.ko for kernel 6.8.0-1015-aws)"),
    ],
)
def test_gdrcopy_auto_requires_it_where_the_image_carries_it(
    config: dict[str, Any], image: str, loaded: bool, status: str, detail: str
) -> None:
    """auto: an image without GDRCopy is not drained for it; one that has it must have gdrdrv loaded."""
    root = Path(config["sys_root"])
    config.update(gdrcopy_required="auto", kernel_release="6.8.0-1015-aws")
    if not loaded:
        (root / "dev" / "gdrdrv").unlink()
        (root / "sys" / "module" / "gdrdrv").rmdir()
    if image == "package":
        dpkg_status(root, "gdrdrv-dkms", "install ok installed")
    elif image == "removed-package":
        dpkg_status(root, "gdrdrv-dkms", "deinstall ok config-files")
    elif image == "module":
        module = root / "lib" / "modules" / "6.8.0-1015-aws" / "updates" / "dkms" / "gdrdrv.ko"
        module.parent.mkdir(parents=True)
        module.write_text("")
    got = by_check(HEALTH.run_checks(config, "adhoc"))["gdrcopy"]
    assert got["status"] == status, got
    assert detail in got["detail"]


@pytest.mark.parametrize(("setting", "status"), [(True, "fail"), (False, "skipped")])
def test_gdrcopy_explicit_setting_wins(config: dict[str, Any], setting: bool, status: str) -> None:
    """health_gdrcopy_required true or false decides whatever the image carries."""
    (Path(config["sys_root"]) / "dev" / "gdrdrv").unlink()
    config.update(gdrcopy_required=setting, gdrcopy_reason=f"health_gdrcopy_required {str(setting).lower()}")
    got = by_check(HEALTH.run_checks(config, "adhoc"))["gdrcopy"]
    assert got["status"] == status
    assert got["detail"].endswith(f"health_gdrcopy_required {str(setting).lower()})" if setting else "false")


def test_gdrcopy_default_is_auto() -> None:
    """The role's default decides from the image (production: the DLAMI may or may not carry GDRCopy)."""
    assert DEFAULTS["health_gdrcopy_required"] == "auto"


# --- states still settling after boot -------------------------------------------------------------
# Fabric manager is started with `systemctl start --no-block` (gpuforge-nvswitch-services) and the
# GPUs register with the fabric after it is up: a boot run waits for both, up to its deadline.


def sequenced(tools: Tools, tool: str, args: str, frames: list[tuple[str, int]]) -> Path:
    """Make `tool` answer `args` with the next frame at each call (the last one repeats) and pass every
    other call to the stand-in; every call is logged in calls.log. Returns the log."""
    directory = tools.directory / f"{tool}.sequence"
    directory.mkdir()
    for n, (text, rc) in enumerate(frames):
        (directory / f"{n}.out").write_text(text)
        (directory / f"{n}.rc").write_text(str(rc))
    log = tools.directory / "calls.log"
    wrapper = tools.directory / f"{tool}-sequenced"
    wrapper.write_text(
        "\n".join(
            [
                "#!/bin/sh",
                'args=""',
                'for a in "$@"; do case "$a" in --format*) ;; *) args="${args:+$args }$a" ;; esac; done',
                f'echo "{tool} $args" >> {shlex.quote(str(log))}',
                f'if [ "$args" != {shlex.quote(args)} ]; then exec {shlex.quote(tools.path(tool))} "$@"; fi',
                f"d={shlex.quote(str(directory))}",
                'n=$(cat "$d/next" 2>/dev/null || echo 0)',
                f'[ "$n" -lt {len(frames) - 1} ] && echo $((n + 1)) > "$d/next"',
                'cat "$d/$n.out"; exit "$(cat "$d/$n.rc")"',
            ]
        )
        + "\n"
    )
    wrapper.chmod(0o755)
    return log


def boot_frames() -> list[tuple[str, int]]:
    return [(frame.lstrip("\n"), 0) for frame in fixture("smi-fabric-p5-first-boot.txt").split("---\n")]


def recorded_first_boot(config: dict[str, Any], tools: Tools, wait_s: float) -> Path:
    """Fabric manager activating for one look, the GPUs registering over four: a p5's first boot."""
    activating = [("activating\n", 3), ("active\n", 0)]
    sequenced(tools, "systemctl", "is-active nvidia-fabricmanager", activating)
    log = sequenced(tools, "nvidia-smi", FABRIC_QUERY, boot_frames())
    config["tools"] |= {t: str(tools.directory / f"{t}-sequenced") for t in ("systemctl", "nvidia-smi")}
    config["transient_wait_s"] = {"boot": wait_s, "adhoc": 0}
    config["transient_poll_s"] = 0.05
    return log


def test_a_first_boot_with_registration_in_progress_passes(config: dict[str, Any], tools: Tools) -> None:
    """Activating, then In Progress: the boot run waits for both, then judges the links: all pass."""
    log = recorded_first_boot(config, tools, wait_s=30)
    got = by_check(HEALTH.run_checks(config, "boot"))
    for name in ("fabric_manager", "nvlink_fabric", "nvlink_state", "nvlink_errors"):
        assert got[name]["status"] == "pass", got[name]
    calls = log.read_text().splitlines()
    fabric = [n for n, call in enumerate(calls) if call == f"nvidia-smi {FABRIC_QUERY}"]
    assert len(fabric) == 4  # one per recorded frame: it stops looking once all GPUs Completed
    assert calls.index("nvidia-smi nvlink --status") > fabric[-1]


def fabric_gated_dcgmi(config: dict[str, Any], tools: Tools, log: Path) -> None:
    """dcgmi diag as DCGM judges the fabric: its software test fails every GPU whose registration is
    Not Started ("training not started") or In Progress ("training in progress"), NVIDIA/DCGM@72fa3fe
    nvvs/src/Software.cpp LogAndSetFMError and testing/python3/tests/test_nvvs_plugins.py
    notStartedCase/inProgressCase. The recorded first boot reaches Completed at its fourth poll of
    the fabric state; before that the diag fails with the state the GPUs were last seen in."""
    dcgmi = tools.directory / "dcgmi-fabric"
    polls = f"$(grep -cx {shlex.quote(f'nvidia-smi {FABRIC_QUERY}')} {shlex.quote(str(log))})"
    dcgmi.write_text(
        "\n".join(
            [
                "#!/bin/sh",
                f'echo "dcgmi $*" >> {shlex.quote(str(log))}',
                f"polls={polls}",
                'if [ "$polls" -lt 2 ]; then why="training not started"',
                'elif [ "$polls" -lt 4 ]; then why="training in progress"',
                f'else exec {shlex.quote(tools.path("dcgmi"))} "$@"; fi',
                'printf "| Software | Fail |\\n| Fabric Manager | Fail - GPU 0: %s |\\n" "$why"',
                "exit 226",
            ]
        )
        + "\n"
    )
    dcgmi.chmod(0o755)
    config["tools"]["dcgmi"] = str(dcgmi)


def test_a_first_boot_runs_dcgmi_diag_once_the_fabric_has_settled(
    config: dict[str, Any], tools: Tools
) -> None:
    """gpu_pcie_link (third check) starts dcgmi diag for its PCIe samples; on a first boot that must
    wait, as check_nvlink does, for fabric manager and registration, or the diag fails and drains."""
    log = recorded_first_boot(config, tools, wait_s=30)
    fabric_gated_dcgmi(config, tools, log)
    got = by_check(HEALTH.run_checks(config, "boot"))
    assert got["dcgm_diag"] == {"check": "dcgm_diag", "status": "pass", "detail": "dcgmi diag -r 2 passed"}
    assert got["gpu_pcie_link"]["status"] == "pass", got["gpu_pcie_link"]
    calls = log.read_text().splitlines()
    fabric = [n for n, call in enumerate(calls) if call == f"nvidia-smi {FABRIC_QUERY}"]
    assert len(fabric) == 4  # the one wait, not one per check
    assert calls.index("dcgmi diag -r 2") > fabric[-1]
    assert calls.count("dcgmi diag -r 2") == 1


def test_the_fabric_gated_diag_fails_while_registration_is_in_progress(
    config: dict[str, Any], tools: Tools
) -> None:
    """The stand-in above fails as DCGM does: adhoc waits for nothing and the diag meets Not Started."""
    log = recorded_first_boot(config, tools, wait_s=30)
    fabric_gated_dcgmi(config, tools, log)
    got = by_check(HEALTH.run_checks(config, "adhoc"))["dcgm_diag"]
    assert got["status"] == "fail"
    assert "training not started" in got["detail"], got


def test_without_a_wait_the_same_moment_fails(config: dict[str, Any], tools: Tools) -> None:
    """adhoc waits for nothing: what is still on its way is judged as it is, and fails."""
    recorded_first_boot(config, tools, wait_s=30)
    got = by_check(HEALTH.run_checks(config, "adhoc"))
    assert got["fabric_manager"]["detail"] == "nvidia-fabricmanager is activating (NVSwitch types need it)"
    assert "GPU 0 fabric registration Not Started" in got["nvlink_fabric"]["detail"]


def test_registration_still_in_progress_at_the_deadline_fails_saying_so(
    config: dict[str, Any], tools: Tools
) -> None:
    """Stuck In Progress: the run stops at its deadline and names what it waited for."""
    recorded_first_boot(config, tools, wait_s=1)
    sequenced_dir = tools.directory / "nvidia-smi.sequence"
    (sequenced_dir / "3.out").write_text(fixture("smi-fabric-p5-in-progress.csv"))
    started = time.monotonic()
    got = by_check(HEALTH.run_checks(config, "boot"))["nvlink_fabric"]
    assert time.monotonic() - started < 10
    assert got["status"] == "fail"
    assert got["detail"].startswith(
        "GPU 3 fabric registration In Progress (CUDA error 802 until it completes); "
    )
    assert re.search(r"waited \d+ s of 1 s for fabric registration of GPU 3$", got["detail"]), got


def test_fabric_manager_still_activating_at_the_deadline_fails_saying_so(
    config: dict[str, Any], tools: Tools
) -> None:
    recorded_first_boot(config, tools, wait_s=1)
    (tools.directory / "systemctl.sequence" / "1.out").write_text("activating\n")
    (tools.directory / "systemctl.sequence" / "1.rc").write_text("3")
    got = by_check(HEALTH.run_checks(config, "boot"))["fabric_manager"]
    assert got["status"] == "fail"
    assert re.fullmatch(
        r"nvidia-fabricmanager is activating \(NVSwitch types need it\); "
        r"waited \d+ s of 1 s for nvidia-fabricmanager to finish activating",
        got["detail"],
    ), got


def test_a_failed_fabric_manager_is_judged_at_once(config: dict[str, Any], tools: Tools) -> None:
    """failed is no transient state, and without fabric manager no GPU registers: no wait at all."""
    recorded_first_boot(config, tools, wait_s=60)
    (tools.directory / "systemctl.sequence" / "0.out").write_text("failed\n")
    (tools.directory / "systemctl.sequence" / "1.out").write_text("failed\n")
    started = time.monotonic()
    got = by_check(HEALTH.run_checks(config, "boot"))
    assert time.monotonic() - started < 10
    assert got["fabric_manager"]["detail"] == "nvidia-fabricmanager is failed (NVSwitch types need it)"
    assert "GPU 0 fabric registration Not Started" in got["nvlink_fabric"]["detail"]


def test_the_boot_unit_is_ordered_after_the_unit_that_queues_fabric_manager() -> None:
    """Fabric manager's start job is queued (--no-block) by gpuforge-nvswitch-services: After= on
    nvidia-fabricmanager alone orders against a job that is not yet in the queue when this one runs."""
    unit = (REPO / "roles/health/templates/etc/systemd/system/gpuforge-health-boot.service.j2").read_text()
    after = " ".join(line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("After="))
    starter = (REPO / "roles/nvidia_driver/files/usr/local/sbin/gpuforge-nvswitch-services").read_text()
    assert "systemctl start --no-block nvidia-fabricmanager.service" in starter
    assert {"gpuforge-nvswitch-services.service", "nvidia-fabricmanager.service"} <= set(after.split())
    assert DEFAULTS["health_transient_wait_s"]["boot"] > 0


def test_the_boot_unit_does_not_hold_multi_user_target() -> None:
    """A target orders itself after every unit it Wants (systemd.target(5), Default Dependencies):
    a oneshot WantedBy=multi-user.target would hold the target, and cloud-final.service after it,
    for the whole run (the fabric wait and dcgmi diag). Ordered After= the target, it does not."""
    unit = (REPO / "roles/health/templates/etc/systemd/system/gpuforge-health-boot.service.j2").read_text()
    keys = [line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#")]
    after = {u for k, v in keys if k == "After" for u in v.split()}
    wanted_by = {u for k, v in keys if k == "WantedBy" for u in v.split()}
    assert wanted_by == {"multi-user.target"}
    assert "multi-user.target" in after
    assert not [v for k, v in keys if k == "Before"]
    assert "DefaultDependencies" not in dict(keys)  # sysinit and shutdown ordering stay as they are
