#!/usr/bin/env python3
"""Write EFA device counters as Prometheus metrics for node_exporter's textfile collector.

node_exporter's infiniband collector reads ports/N/counters/, which the EFA driver does not
provide; EFA exposes its counters under ports/N/hw_counters/ instead. This script reads those
and writes them atomically to <dir>/efa.prom, for node_exporter started with
--collector.textfile.directory=<dir>. Run it every 15 s (systemd timer or cron). Standard
library only, so it runs on any node without gpuforge installed.

    efa_textfile.py [--sysfs /sys/class/infiniband] [--out /var/lib/node_exporter/textfile_collector]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

# hw_counters file -> (metric, help). Counters absent on older EFA devices are skipped.
COUNTERS = {
    "tx_pkts": ("gpuforge_efa_tx_packets_total", "Packets sent by the EFA device port."),
    "rx_pkts": ("gpuforge_efa_rx_packets_total", "Packets received by the EFA device port."),
    "rx_drops": ("gpuforge_efa_rx_drops_total", "Received packets the EFA device port dropped."),
    "retrans_pkts": (
        "gpuforge_efa_retransmitted_packets_total",
        "Packets the EFA port retransmitted.",
    ),
    "tx_bytes": ("gpuforge_efa_tx_bytes_total", "Bytes sent by the EFA device port."),
    "rx_bytes": ("gpuforge_efa_rx_bytes_total", "Bytes received by the EFA device port."),
}
UP_METRIC = "gpuforge_efa_devices"


def is_efa(device: Path) -> bool:
    """EFA devices are bound to the efa driver (device/driver -> .../efa)."""
    driver = device / "device" / "driver"
    return driver.exists() and driver.resolve().name == "efa"


def collect(sysfs: Path) -> str:
    """The metrics text for every EFA device port under sysfs."""
    samples: dict[str, list[str]] = {metric: [] for metric, _ in COUNTERS.values()}
    devices = sorted(d for d in sysfs.iterdir() if is_efa(d)) if sysfs.is_dir() else []
    for device in devices:
        for port in sorted((device / "ports").iterdir()):
            counters = port / "hw_counters"
            for name, (metric, _) in COUNTERS.items():
                path = counters / name
                if path.is_file():
                    value = int(path.read_text().strip())
                    samples[metric].append(f'{metric}{{device="{device.name}",port="{port.name}"}} {value}')
    lines = [
        f"# HELP {UP_METRIC} EFA devices found in sysfs (0 on a host without EFA).",
        f"# TYPE {UP_METRIC} gauge",
        f"{UP_METRIC} {len(devices)}",
    ]
    for metric, help_text in COUNTERS.values():
        if samples[metric]:
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter", *samples[metric]]
    return "\n".join(lines) + "\n"


def write_atomically(text: str, out_dir: Path) -> Path:
    """Write via a temporary file and rename, so node_exporter never reads half a file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "efa.prom"
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".efa.prom.")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    Path(tmp).chmod(0o644)
    Path(tmp).replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sysfs", type=Path, default=Path("/sys/class/infiniband"))
    parser.add_argument("--out", type=Path, default=Path("/var/lib/node_exporter/textfile_collector"))
    args = parser.parse_args(argv)
    try:
        write_atomically(collect(args.sysfs), args.out)
    except (OSError, ValueError) as exc:
        print(f"efa_textfile: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
