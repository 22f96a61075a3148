#!/usr/bin/env python3
"""The ec2_fleet plugin's cached path at fleet scale without moto: ansible-inventory --list, warm cache.

bench/inventory.py needs moto to describe the fleet (minutes at 5,000 hosts). This script writes the
plugin's jsonfile cache directly: for each --instances size it builds the describe_instances answer
of gpuforge_lab.bench.ec2fleet's fleet shape (two clusters, a head node each, four fifths p5.48xlarge
with 32 interfaces, one fifth p4d.24xlarge, six zones) in memory, reduces each instance with the
plugin's own `record()` (what `_describe` caches), stores the records under the plugin's cache key
and times `ansible-inventory -i ec2_fleet.yml --list` --repeat times. The endpoint points at a closed
loopback port: a cache miss fails the run instead of measuring a describe. --profile FILE writes a
cProfile of one more run.

Run: .venv/bin/python bench/inventory_cached.py --instances 500 5000 --repeat 3
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpuforge_lab.bench import ec2fleet
from gpuforge_lab.bench.timing import Sample, load_average, run_timed, table

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PLUGIN = "gpuforge.gpu.ec2_fleet"
# inventory/ec2_fleet.yml's settings.
CONFIG = (REPO / "inventory/ec2_fleet.yml").read_text()
ZONES = ("us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d", "us-east-1e", "us-east-1f")


def plugin_module() -> Any:
    spec = importlib.util.spec_from_file_location("ec2_fleet_bench", REPO / "plugins/inventory/ec2_fleet.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def instances(total: int) -> list[dict[str, Any]]:
    """describe_instances' Instances of the fleet (only the fields `record()` reads)."""
    out: list[dict[str, Any]] = []

    def add(instance_type: str, tags: list[dict[str, Any]]) -> None:
        n = len(out)
        ip = f"10.{n % 6}.{n // 250 % 256}.{n % 250 + 4}"
        out.append(
            {
                "InstanceId": f"i-{n:017x}",
                "ImageId": "ami-0123456789abcdef0",
                "InstanceType": instance_type,
                "PrivateIpAddress": ip,
                "PrivateDnsName": f"ip-{ip.replace('.', '-')}.ec2.internal",
                "Placement": {"AvailabilityZone": ZONES[n % 6]},
                "Tags": tags,
            }
        )

    for cluster in ("train", "infer"):
        add(ec2fleet.HEAD_TYPE, ec2fleet._tags(None, cluster, False))
    for queue in ec2fleet.shape(total):
        for _ in range(queue.count):
            add(queue.instance_type, ec2fleet._tags(queue, queue.cluster, False))
    return out


def write_cache(cache: Path, key: str, records: list[dict[str, Any]]) -> None:
    """Store the records as the plugin does: through Ansible's cache loader (2.19 wraps the jsonfile
    plugin in an interposer with its own key schema and tagged JSON payload)."""
    from ansible.plugins.loader import cache_loader

    plugin = cache_loader.get("jsonfile", _uri=str(cache), _prefix="ec2_fleet", _timeout=300)
    plugin.set(key, records)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--instances", type=int, nargs="+", default=[5000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", type=Path, help="write a cProfile of one more run (largest size) here")
    args = parser.parse_args()
    plugin = plugin_module()
    print(f"command: .venv/bin/python bench/inventory_cached.py {' '.join(sys.argv[1:])}")
    print(f"load before: {load_average()}", flush=True)
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="gpuforge-bench-invc-") as tmp_name:
        tmp = Path(tmp_name)
        inv = tmp / "ec2_fleet.yml"
        inv.write_text(CONFIG)
        (tmp / "group_vars").symlink_to(REPO / "inventory/group_vars")
        cache = tmp / "cache"
        cache.mkdir()
        # Ansible's Cacheable.get_cache_key (ansible-core 2.19 plugins/inventory/__init__.py).
        key = f"{PLUGIN}_k{hashlib.sha256(f'{PLUGIN}{inv}'.encode()).hexdigest()[:6]}"
        env = {
            "ANSIBLE_INVENTORY_CACHE_CONNECTION": str(cache),
            "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "true",
            "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
        }
        cmd = [str(BIN / "ansible-inventory"), "-i", str(inv), "--list"]
        for total in args.instances:
            records = [plugin.record(i, "us-east-1") for i in instances(total)]
            write_cache(cache, key, records)
            sample = Sample(f"ec2_fleet plugin, cached ({total} hosts)")
            found = 0
            for _ in range(args.repeat):
                took, out = run_timed(cmd, env=env, cwd=REPO)
                found = len(json.loads(out.stdout)["_meta"]["hostvars"])
                sample.seconds.append(took)
            rows.append([total, sample.label, found, min(sample.seconds), sample.median, load_average()])
            print(table(["hosts", "case", "found", "min s", "median s", "load after"], rows[-1:]), flush=True)
        if args.profile:
            prof = [sys.executable, "-m", "cProfile", "-o", str(args.profile), *cmd]
            subprocess.run(prof, env={**os.environ, **env}, cwd=REPO, check=True, capture_output=True)
    print(f"\nminimum and median of {args.repeat} run(s); load after: {load_average()}\n")
    print(table(["hosts", "case", "found", "min s", "median s", "load after"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
