#!/usr/bin/env python3
"""Inventory at fleet scale: the amazon.aws.aws_ec2 plugin (cold and cached) vs raw boto3.

Starts its own moto_server (the test double for EC2) on a free loopback port, creates
--instances instances tagged as ParallelCluster tags its nodes, then times, --repeat times each:

- boto3: a paginated describe_instances with the same filters as inventory/aws_ec2.yml;
- ansible-inventory --list on inventory/aws_ec2.yml with --flush-cache (cold);
- ansible-inventory --list again (cached: the jsonfile cache in a temporary directory);
- ansible-inventory --list on an empty static inventory (the floor: Ansible's start-up).

moto answers describe_instances in one unpaged response (AWS pages at up to 1000) and takes
~15 ms per instance on this shared 2-core machine, so 5,000 instances outlast botocore's
default 60 s read timeout. Every client here (boto3 and, through a sitecustomize shim on
PYTHONPATH, the plugin's) gets --read-timeout instead, and no retries, so a slow answer is
measured rather than retried into a pile-up. That shim is for the emulator only.

Run: .venv/bin/python bench/inventory.py --instances 5000 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from gpuforge import aws
from gpuforge.bench.timing import Sample, load_average, run_timed, table, time_call
from gpuforge.lab.moto import MotoServer, free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CLUSTER = "bench"
BATCH = 500
SHIM = """\
# bench/inventory.py: raise botocore's default read timeout for the slow emulator (moto).
import botocore.config

botocore.config.Config.OPTION_DEFAULTS["read_timeout"] = {timeout}
"""


def populate(total: int) -> float:
    """Create `total` instances (1 head node, the rest compute) in batches; return seconds taken."""
    ec2 = aws.client("ec2")
    image = ec2.describe_images(Owners=["amazon"], MaxResults=5)["Images"][0]["ImageId"]
    start = time.perf_counter()
    made = 0
    while made < total:
        # The first instance is the head node; the rest are compute nodes, BATCH per call.
        node_type = "HeadNode" if made == 0 else "Compute"
        count = 1 if made == 0 else min(BATCH, total - made)
        tags = [
            {"Key": "parallelcluster:cluster-name", "Value": CLUSTER},
            {"Key": "parallelcluster:node-type", "Value": node_type},
        ]
        if node_type == "Compute":
            tags += [
                {"Key": "parallelcluster:queue-name", "Value": "gpu"},
                {"Key": "parallelcluster:compute-resource-name", "Value": "p5-48xlarge"},
            ]
        ec2.run_instances(
            ImageId=image,
            InstanceType="p5.48xlarge" if node_type == "Compute" else "c5.2xlarge",
            MinCount=count,
            MaxCount=count,
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
        )
        made += count
    return time.perf_counter() - start


def boto3_describe(read_timeout: int, page_size: int | None) -> int:
    """What the plugin does, minus Ansible: paginate describe_instances with the inventory's filters."""
    config = Config(read_timeout=read_timeout, retries={"total_max_attempts": 1})
    ec2 = boto3.session.Session().client("ec2", region_name=aws.region(), config=config)
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[
            {"Name": "instance-state-name", "Values": ["running"]},
            {"Name": "tag-key", "Values": ["parallelcluster:cluster-name"]},
        ],
        PaginationConfig={"PageSize": page_size} if page_size else {},
    )
    return sum(len(r["Instances"]) for page in pages for r in page["Reservations"])


def inventory_hosts(stdout: str) -> int:
    data: dict[str, Any] = json.loads(stdout)
    return len(data.get("_meta", {}).get("hostvars", {}))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--instances", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--read-timeout", type=int, default=900, help="seconds (botocore's default is 60)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="gpuforge-bench-inv-") as tmp:
        server = MotoServer(port=free_port(), log_path=Path(tmp) / "moto.log")
        server.start()
        try:
            os.environ.update(server.env())
            os.environ.pop("AWS_PROFILE", None)
            print(f"load before: {load_average()}")
            created = populate(args.instances)
            print(f"created {args.instances} instances in moto in {created:.1f}s")
            shim = Path(tmp) / "shim"
            shim.mkdir()
            (shim / "sitecustomize.py").write_text(SHIM.format(timeout=args.read_timeout))
            env = {
                **server.env(),
                "ANSIBLE_INVENTORY_CACHE_CONNECTION": str(Path(tmp) / "inv-cache"),
                "PYTHONPATH": str(shim),
                "AWS_MAX_ATTEMPTS": "1",
            }
            inv = [str(BIN / "ansible-inventory"), "-i", "inventory/aws_ec2.yml", "--list"]
            floor_inv = Path(tmp) / "empty.yml"
            floor_inv.write_text("all:\n  hosts: {}\n")

            boto = Sample("boto3 paginated describe_instances")
            paged = Sample("boto3, pages of 1000 (as AWS pages)")
            cold = Sample("aws_ec2 plugin, cold (--flush-cache)")
            cached = Sample("aws_ec2 plugin, cached")
            floor = Sample("ansible-inventory on an empty inventory (floor)")
            counts: dict[str, int] = {}
            for _ in range(args.repeat):
                found = 0

                def describe() -> None:
                    nonlocal found
                    found = boto3_describe(args.read_timeout, None)

                boto.seconds.append(time_call(describe))
                counts[boto.label] = found

                def describe_paged() -> None:
                    nonlocal found
                    found = boto3_describe(args.read_timeout, 1000)

                paged.seconds.append(time_call(describe_paged))
                counts[paged.label] = found
                took, out = run_timed([*inv, "--flush-cache"], env=env, cwd=REPO)
                cold.seconds.append(took)
                counts[cold.label] = inventory_hosts(out.stdout)
                took, out = run_timed(inv, env=env, cwd=REPO)
                cached.seconds.append(took)
                counts[cached.label] = inventory_hosts(out.stdout)
                took, _ = run_timed(
                    [str(BIN / "ansible-inventory"), "-i", str(floor_inv), "--list"], env=env, cwd=REPO
                )
                floor.seconds.append(took)
                counts[floor.label] = 0
        finally:
            server.stop()

    rows = [
        [s.label, counts[s.label], s.median, s.spread, s.median / boto.median]
        for s in (boto, paged, cold, cached, floor)
    ]
    print(f"\n{args.instances} instances, median of {args.repeat} runs; load after: {load_average()}\n")
    print(table(["case", "hosts", "median s", "spread s", "x boto3"], rows))
    print(f"\ncold / cached: {cold.median / cached.median:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
