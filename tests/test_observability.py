"""Prometheus config, alert rules (promtool), the Grafana dashboard and the EFA textfile collector.

promtool is the real rule engine (Debian package `prometheus`); the promtool tests skip, saying
why, only where it is not installed. The EFA collector runs on a fake sysfs tree: a test double
for /sys/class/infiniband on a host with EFA devices, which this machine has not.
"""

from __future__ import annotations

import csv
import importlib.machinery
import importlib.util
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
OBS = ROOT / "observability"
PROM = OBS / "prometheus"
RULES = PROM / "rules" / "gpuforge-alerts.yml"
RULE_TESTS = PROM / "tests" / "gpuforge-alerts.test.yml"
DASHBOARD = OBS / "grafana" / "gpuforge-gpu.json"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (apt-get install prometheus provides it)"
)


def load_efa_collector() -> ModuleType:
    spec = importlib.util.spec_from_file_location("efa_textfile", OBS / "node-exporter" / "efa_textfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def known_metrics() -> set[str]:
    """Every metric observability/metrics.yml documents, read from each exporter's own list."""
    exporters = yaml.safe_load((OBS / "metrics.yml").read_text())["gpuforge_metrics"]
    known: set[str] = set()
    for name, spec in exporters.items():
        known.update(spec.get("metrics", []))
        source = spec.get("metrics_from")
        if source == "dcgm-exporter/counters.csv":
            rows = csv.reader(
                line for line in (OBS / source).read_text().splitlines() if not line.startswith("#")
            )
            known.update(row[0].strip() for row in rows if row)
        elif source == "node-exporter/efa_textfile.py":
            collector = load_efa_collector()
            known.update(metric for metric, _ in collector.COUNTERS.values())
            known.add(collector.UP_METRIC)
        elif source is not None:
            pytest.fail(f"metrics.yml: exporter {name} names an unknown metrics_from {source}")
    return known


_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (functions, labels, keywords and literals removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery selectors
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana variables
    names = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name in _KEYWORDS or re.fullmatch(r"\d+[smhdwy]|[eE]", name):
            continue
        names.add(name)
    return names


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def dashboard_targets() -> Iterator[tuple[str, str]]:
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


@needs_promtool
def test_rules_and_config_pass_promtool_check() -> None:
    rules = promtool("check", "rules", str(RULES))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = promtool("check", "config", str(PROM / "prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr


@needs_promtool
def test_alert_unit_tests_pass() -> None:
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    for rule in alert_rules():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']} is never shown firing"
        assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']} is never shown quiet"


# Each mutation breaks one alert's threshold or condition; the unit tests must notice.
MUTATIONS = [
    ("GPUUtilizationLow threshold", "DCGM_FI_DEV_GPU_UTIL < 60", "DCGM_FI_DEV_GPU_UTIL < 10"),
    (
        "GPUUtilizationLow memory condition",
        "\n          and on (instance, gpu) DCGM_FI_DEV_FB_USED > 1024",
        "",
    ),
    ("GPUTemperatureHigh boundary", "DCGM_FI_DEV_GPU_TEMP > 85", "DCGM_FI_DEV_GPU_TEMP >= 85"),
    ("GPUXidHardware list", "or DCGM_FI_DEV_XID_ERRORS == 79\n", "\n"),
    ("GPUXidApplication unless", "unless (", "and ("),
    ("GPUExporterDown job", 'up{job="dcgm-exporter", instance_type=~', "up{instance_type=~"),
    (
        "GPUExporterDown GPU types only",
        'instance_type=~"(p|g|gr)[0-9][a-z0-9-]*[.].+"',
        'instance_type=~".+"',
    ),
    ("GPURowRemapFailure", "DCGM_FI_DEV_ROW_REMAP_FAILURE > 0", "DCGM_FI_DEV_ROW_REMAP_FAILURE > 1"),
    ("GPUUncorrectableECC", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL > 0", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL > 5"),
    ("NVLinkErrors recovery", "RECOVERY_ERROR_COUNT_TOTAL[10m]) > 0", "RECOVERY_ERROR_COUNT_TOTAL[10m]) > 1"),
    (
        "NVLinkErrors CRC",
        "CRC_FLIT_ERROR_COUNT_TOTAL[10m]) > 1000",
        "CRC_FLIT_ERROR_COUNT_TOTAL[10m]) > 9000",
    ),
    ("EFADeviceCountDrop", "gpuforge_efa_devices < max_over_time", "gpuforge_efa_devices > max_over_time"),
    ("EFAPacketLoss threshold", ") > 0.001", ") > 0.01"),
    ("EFAPacketLoss retransmits", "\n          or\n", "\n          and\n"),
    ("StorageNearQuota threshold", ") < 0.10", ") < 0.01"),
    ("StorageNearQuota mountpoints", 'mountpoint=~"/fsx.*|', 'mountpoint=~"/.*|/fsx.*|'),
]


@needs_promtool
@pytest.mark.parametrize(("what", "original", "mutant"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_unit_tests_catch_a_broken_rule(tmp_path: Path, what: str, original: str, mutant: str) -> None:
    copy = tmp_path / "prometheus"
    shutil.copytree(PROM, copy)
    rules = copy / "rules" / "gpuforge-alerts.yml"
    unit_tests = str(copy / "tests" / "gpuforge-alerts.test.yml")
    assert promtool("test", "rules", unit_tests).returncode == 0, "the unmutated copy must pass"
    text = rules.read_text()
    assert original in text, f"mutation for {what} no longer matches the rules"
    rules.write_text(text.replace(original, mutant))
    assert promtool("check", "rules", str(rules)).returncode == 0, "mutant must still be a valid rule"
    result = promtool("test", "rules", unit_tests)
    assert result.returncode != 0, f"unit tests did not notice: {what}"


def test_metric_name_extraction() -> None:
    expr = 'sum by (node, device) (rate(a_total{x=~"b|c"}[$__rate_interval])) / on (node) b > 0.001 or up'
    assert metric_names(expr) == {"a_total", "b", "up"}


def test_rules_use_only_documented_metrics() -> None:
    known = known_metrics()
    for rule in alert_rules():
        used = metric_names(rule["expr"])
        assert used, f"{rule['alert']}: no metric found in {rule['expr']!r}"
        assert used <= known, f"{rule['alert']} uses undocumented {sorted(used - known)}"


def test_dashboard_parses_and_uses_only_documented_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "gpuforge-gpu"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "cluster", "node"} <= variables
    known = known_metrics()
    targets = list(dashboard_targets())
    assert {title for title, _ in targets} == {p["title"] for p in dashboard["panels"]}
    for title, expr in targets:
        used = metric_names(expr)
        assert used, f"panel {title!r}: no metric in {expr!r}"
        assert used <= known, f"panel {title!r} uses undocumented {sorted(used - known)}"


def test_every_alerted_metric_is_on_the_dashboard() -> None:
    on_dashboard = set().union(*(metric_names(expr) for _, expr in dashboard_targets()))
    for rule in alert_rules():
        assert metric_names(rule["expr"]) <= on_dashboard, f"{rule['alert']} watches metrics no panel shows"


def fake_sysfs(root: Path, devices: dict[str, str], counters: dict[str, int]) -> Path:
    """A /sys/class/infiniband look-alike: name -> driver, each with port 1 and hw_counters."""
    sysfs = root / "class" / "infiniband"
    for name, driver in devices.items():
        driver_dir = root / "bus" / "pci" / "drivers" / driver
        driver_dir.mkdir(parents=True, exist_ok=True)
        device = sysfs / name
        (device / "device").mkdir(parents=True)
        (device / "device" / "driver").symlink_to(driver_dir)
        hw = device / "ports" / "1" / "hw_counters"
        hw.mkdir(parents=True)
        for counter, value in counters.items():
            (hw / counter).write_text(f"{value}\n")
    return sysfs


def test_efa_collector_reads_only_efa_devices(tmp_path: Path) -> None:
    collector = load_efa_collector()
    counters = {
        "tx_pkts": 1000,
        "rx_pkts": 990,
        "rx_drops": 3,
        "retrans_pkts": 7,
        "tx_bytes": 5,
        "rx_bytes": 6,
    }
    sysfs = fake_sysfs(tmp_path, {"rdmap0s6": "efa", "rdmap1s6": "efa", "mlx5_0": "mlx5_core"}, counters)
    text = collector.collect(sysfs)
    assert "gpuforge_efa_devices 2" in text.splitlines()
    assert 'gpuforge_efa_rx_drops_total{device="rdmap1s6",port="1"} 3' in text
    assert "mlx5_0" not in text
    emitted = {line.split("{")[0].split()[0] for line in text.splitlines() if not line.startswith("#")}
    assert emitted <= known_metrics()
    for metric, _ in collector.COUNTERS.values():
        assert f"# TYPE {metric} counter" in text


def test_efa_collector_on_a_host_without_efa_reports_zero_devices(tmp_path: Path) -> None:
    collector = load_efa_collector()
    text = collector.collect(tmp_path / "absent")
    assert [line for line in text.splitlines() if not line.startswith("#")] == ["gpuforge_efa_devices 0"]


def test_efa_collector_writes_the_textfile(tmp_path: Path) -> None:
    collector = load_efa_collector()
    sysfs = fake_sysfs(tmp_path / "sys", {"rdmap0s6": "efa"}, {"rx_pkts": 10, "rx_drops": 0})
    out = tmp_path / "textfile"
    assert collector.main(["--sysfs", str(sysfs), "--out", str(out)]) == 0
    prom = out / "efa.prom"
    assert prom.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in out.iterdir()] == ["efa.prom"]
    if PROMTOOL is not None:
        lint = subprocess.run(
            [PROMTOOL, "check", "metrics"],
            input=prom.read_text(),
            capture_output=True,
            text=True,
            check=False,
        )
        assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_efa_collector_units_verify(tmp_path: Path) -> None:
    for unit in ("gpuforge-efa-textfile.service", "gpuforge-efa-textfile.timer"):
        shutil.copy(OBS / "node-exporter" / unit, tmp_path / unit)
    units = [str(tmp_path / "gpuforge-efa-textfile.service"), str(tmp_path / "gpuforge-efa-textfile.timer")]
    result = subprocess.run(
        ["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=60, check=False
    )
    # Unknown keys are only warnings to systemd-analyze, so any output counts as a failure.
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
        result.stdout + result.stderr
    )
    service = (OBS / "node-exporter" / "gpuforge-efa-textfile.service").read_text()
    assert "efa_textfile.py --out /var/lib/node_exporter/textfile_collector" in service


def _health_script() -> ModuleType:
    path = ROOT / "roles" / "health" / "files" / "gpuforge-health"
    loader = importlib.machinery.SourceFileLoader("gpuforge_health_obs", str(path))
    spec = importlib.util.spec_from_loader("gpuforge_health_obs", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_xid_alerts_split_as_the_health_checks_classify() -> None:
    """The paging XIDs are exactly the health script's hardware XIDs (NVIDIA catalog) plus Xid 154."""
    health = _health_script()
    hardware = {xid for xid, bucket in health.XID_CATALOG.items() if bucket in health.HARDWARE_BUCKETS} | {
        154
    }
    rules = {rule["alert"]: rule["expr"] for rule in alert_rules()}
    page = {int(x) for x in re.findall(r"DCGM_FI_DEV_XID_ERRORS == (\d+)", rules["GPUXidHardware"])}
    application = rules["GPUXidApplication"]
    unless = {
        int(x) for x in re.findall(r"DCGM_FI_DEV_XID_ERRORS == (\d+)", application.split("unless", 1)[1])
    }
    assert page == hardware == unless
    assert not {13, 31, 43, 45} & page
    severities = {rule["alert"]: rule["labels"]["severity"] for rule in alert_rules()}
    assert (severities["GPUXidHardware"], severities["GPUXidApplication"]) == ("page", "ticket")


def test_gpu_exporter_is_scraped_and_alerted_only_on_gpu_instance_types() -> None:
    """One regex of GPU instance types in the scrape config and the alert, true to data/instance_types.yml."""
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "dcgm-exporter")
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert [r["source_labels"] for r in keep] == [["__meta_ec2_instance_type"]]
    regex = keep[0]["regex"]
    down = next(rule for rule in alert_rules() if rule["alert"] == "GPUExporterDown")
    assert f'instance_type=~"{regex}"' in down["expr"]
    types = yaml.safe_load((ROOT / "data" / "instance_types.yml").read_text())["gpuforge_instance_types"]
    for name, spec in types.items():
        assert bool(re.fullmatch(regex, name)) == bool(spec.get("gpus")), name
    for name in ("p6-b200.48xlarge", "g6e.12xlarge", "p4de.24xlarge"):
        assert re.fullmatch(regex, name), name
    for name in ("trn1.32xlarge", "c7i.large", "m5.xlarge"):
        assert not re.fullmatch(regex, name), name


def test_dashboard_units() -> None:
    """MiB for framebuffer memory, W and MHz on their own axes (DCGM's units)."""
    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
    assert panels["GPU memory used"]["fieldConfig"]["defaults"]["unit"] == "mbytes"  # Grafana's MiB
    power = panels["GPU power (W) and SM clock (MHz)"]
    assert [t["expr"].split("{")[0] for t in power["targets"]] == [
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_SM_CLOCK",
    ]
    defaults = power["fieldConfig"]["defaults"]
    assert (defaults["unit"], defaults["custom"]["axisPlacement"]) == ("watt", "left")
    (override,) = power["fieldConfig"]["overrides"]
    assert override["matcher"] == {"id": "byFrameRefID", "options": "B"}
    props = {p["id"]: p["value"] for p in override["properties"]}
    assert (props["unit"], props["custom.axisPlacement"]) == ("rotmhz", "right")


def test_the_dcgm_role_collects_every_counter_the_alerts_and_dashboard_use() -> None:
    """The dcgm role's collectors file carries every field of observability/dcgm-exporter/counters.csv."""

    def fields(text: str) -> set[str]:
        return {line.split(",")[0].strip() for line in text.splitlines() if line.startswith("DCGM_FI_")}

    role = ROOT / "roles" / "dcgm" / "templates" / "etc" / "dcgm-exporter" / "default-counters.csv.j2"
    assert fields((OBS / "dcgm-exporter" / "counters.csv").read_text()) <= fields(role.read_text())
