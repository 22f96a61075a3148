"""gpuforge-health (roles/health/files/gpuforge-health) against fake tools.

nvidia-smi, dcgmi and fi_info are stand-ins (test doubles: small scripts printing what the real
tools print), because this machine has no GPU or EFA. The checks, their parsing and the exit
status are the real script's.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "roles" / "health" / "files" / "gpuforge-health"


def _load() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("gpuforge_health", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpuforge_health", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


HEALTH = _load()


def fake_tool(directory: Path, name: str, stdout: str, rc: int = 0) -> str:
    path = directory / name
    path.write_text(f"#!/bin/sh\ncat <<'OUT'\n{stdout}\nOUT\nexit {rc}\n")
    path.chmod(0o755)
    return str(path)


def smi_rows(temperatures: list[int]) -> str:
    return "\n".join(f"{i}, {t}" for i, t in enumerate(temperatures))


def fi_info_domains(count: int) -> str:
    return "\n".join(
        f"provider: efa\n    fabric: efa\n    domain: rdmap{16 + i}s27-rdm\n    version: 122.0"
        for i in range(count)
    )


@pytest.fixture
def config(tmp_path: Path) -> dict[str, Any]:
    """A p5.48xlarge-like node configuration, as the role writes it, with tools in tmp_path."""
    log = tmp_path / "kern.log"
    log.write_text("kernel: Linux version 6.8.0\n")
    return {
        "gpu_present": True,
        "efa_present": True,
        "expected_gpus": 8,
        "expected_efa": 32,
        "max_temperature_c": 85,
        "dcgm_level": {"adhoc": 1, "prolog": 0, "epilog": 0},
        "timeout_s": 10,
        "dcgm_timeout_s": 10,
        "xid_actions": {"48": "reset", "79": "reboot", "64": "isolate"},
        "paths": [{"path": str(tmp_path), "min_free_gib": 0, "required": True}],
        "kernel_log_file": str(log),
        "tools": {
            "nvidia-smi": fake_tool(tmp_path, "nvidia-smi", smi_rows([40] * 8)),
            "dcgmi": fake_tool(tmp_path, "dcgmi", "| Memory    | Pass |"),
            "fi_info": fake_tool(tmp_path, "fi_info", fi_info_domains(32)),
        },
    }


def by_check(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["check"]: r for r in results}


def test_healthy_node_passes_every_check(config: dict[str, Any]) -> None:
    """All hardware present and as the instance type says: every check passes."""
    results = by_check(HEALTH.run_checks(config, "adhoc"))
    assert {name: r["status"] for name, r in results.items()} == {
        "gpu_count": "pass",
        "gpu_temperature": "pass",
        "gpu_xid": "pass",
        "dcgm_diag": "pass",
        "efa_devices": "pass",
        f"path {config['paths'][0]['path']}": "pass",
    }


def test_no_hardware_is_never_a_pass(config: dict[str, Any]) -> None:
    """Without GPU and EFA every hardware check says not_present, naming what the type should have."""
    config.update(gpu_present=False, efa_present=False)
    results = by_check(HEALTH.run_checks(config, "adhoc"))
    for name in ("gpu_count", "gpu_temperature", "gpu_xid", "dcgm_diag", "efa_devices"):
        assert results[name]["status"] == "not_present", name
    assert "the instance type has 8" in results["gpu_count"]["detail"]
    assert "the instance type has 32" in results["efa_devices"]["detail"]


@pytest.mark.parametrize(
    ("temperatures", "count_status", "temp_status"),
    [([40] * 7, "fail", "pass"), ([40] * 7 + [90], "pass", "fail"), ([85] * 8, "pass", "fail")],
    ids=["missing-gpu", "hot-gpu", "at-limit"],
)
def test_gpu_count_and_temperature(
    config: dict[str, Any], tmp_path: Path, temperatures: list[int], count_status: str, temp_status: str
) -> None:
    """A GPU short fails the count; a GPU at or above 85 C fails the temperature check."""
    config["tools"]["nvidia-smi"] = fake_tool(tmp_path, "nvidia-smi", smi_rows(temperatures))
    results = by_check(HEALTH.check_gpus(config))
    assert results["gpu_count"]["status"] == count_status
    assert results["gpu_temperature"]["status"] == temp_status


def test_nvidia_smi_missing_or_failing_fails(
    config: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU without a working nvidia-smi is a failure, not a skip."""
    config["tools"]["nvidia-smi"] = fake_tool(tmp_path, "nvidia-smi", "NVIDIA-SMI has failed", rc=9)
    assert {r["status"] for r in HEALTH.check_gpus(config)} == {"fail"}
    config["tools"]["nvidia-smi"] = str(tmp_path / "absent")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert all("not found" in r["detail"] for r in HEALTH.check_gpus(config))


@pytest.mark.parametrize(
    ("lines", "status", "action"),
    [
        ([], "pass", "none"),
        (["NVRM: Xid (PCI:0000:10:1c): 13, pid=4242, Graphics Exception"], "pass", "none"),
        (["NVRM: Xid (PCI:0000:10:1c): 48, pid=1, DBE"], "fail", "reset"),
        (
            [
                "NVRM: Xid (PCI:0000:10:1c): 48, pid=1",
                "NVRM: Xid (PCI:0000:97:00): 79, pid=0, fallen off the bus",
            ],
            "fail",
            "reboot",
        ),
        (
            ["NVRM: Xid (PCI:0000:10:1c): 79, pid=0", "NVRM: Xid (PCI:0000:10:1c): 64, pid=0"],
            "fail",
            "isolate",
        ),
    ],
    ids=["clean", "app-error", "reset", "reboot-wins", "isolate-wins"],
)
def test_xid_classification(config: dict[str, Any], lines: list[str], status: str, action: str) -> None:
    """XIDs in the kernel log are classified; the worst action decides."""
    Path(config["kernel_log_file"]).write_text("".join(f"[  12.3] {line}\n" for line in lines))
    (result,) = HEALTH.check_xid(config)
    assert (result["status"], result["action"]) == (status, action)


def test_dcgm_levels(config: dict[str, Any], tmp_path: Path) -> None:
    """The prolog skips dcgmi (level 0); ad hoc runs it and a failed test fails the check."""
    assert HEALTH.check_dcgm(config, 0)[0]["status"] == "skipped"
    assert HEALTH.check_dcgm(config, 1)[0]["status"] == "pass"
    config["tools"]["dcgmi"] = fake_tool(tmp_path, "dcgmi", "| Memory    | Fail - GPU 3 |", rc=226)
    (result,) = HEALTH.check_dcgm(config, 2)
    assert result["status"] == "fail" and "GPU 3" in result["detail"]


@pytest.mark.parametrize(("domains", "status"), [(32, "pass"), (31, "fail")])
def test_efa_device_count(config: dict[str, Any], tmp_path: Path, domains: int, status: str) -> None:
    """fi_info -p efa must list the instance type's EFA device count."""
    config["tools"]["fi_info"] = fake_tool(tmp_path, "fi_info", fi_info_domains(domains))
    (result,) = HEALTH.check_efa(config)
    assert result["status"] == status
    assert f"{domains} of 32" in result["detail"]


def test_paths(config: dict[str, Any], tmp_path: Path) -> None:
    """A missing required path or one short of free space fails; a missing optional one is not_present."""
    config["paths"] = [
        {"path": str(tmp_path / "checkpoints"), "required": True},
        {"path": str(tmp_path / "fsx"), "required": False},
        {"path": str(tmp_path), "min_free_gib": 10**9},
    ]
    statuses = [r["status"] for r in HEALTH.check_paths(config)]
    assert statuses == ["fail", "not_present", "fail"]


def test_prolog_exit_status_and_reason(config: dict[str, Any], tmp_path: Path) -> None:
    """As a prolog the script exits 1 on a failure and says why on stderr (slurmd keeps it)."""
    config["tools"]["nvidia-smi"] = fake_tool(tmp_path, "nvidia-smi", smi_rows([40] * 7))
    path = tmp_path / "health.json"
    path.write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--config", str(path), "--mode", "prolog"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert "gpu_count: 7 of 8 GPUs" in proc.stderr
    healthy = dict(
        config,
        tools=dict(config["tools"], **{"nvidia-smi": fake_tool(tmp_path, "ok-smi", smi_rows([40] * 8))}),
    )
    path.write_text(json.dumps(healthy))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--config", str(path), "--mode", "prolog", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0
    report = json.loads(proc.stdout)
    assert report["healthy"] is True
    assert by_check(report["results"])["dcgm_diag"]["status"] == "skipped"
