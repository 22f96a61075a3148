#!/usr/bin/env python3
"""Inventory at fleet scale: gpuforge.gpu.ec2_fleet and amazon.aws.aws_ec2 (cold, cached) vs raw boto3.

For each --instances size, one run:

1. setup: starts its own moto_server (the EC2 test double) on a free loopback port and creates a
   ParallelCluster-shaped fleet of that many running hosts (gpuforge_lab.bench.ec2fleet: two clusters,
   1 head node each, four fifths p5.48xlarge with 32 network interfaces, one fifth p4d.24xlarge
   with 4, six subnets) with RunInstances MaxCount batches of --batch (a reservation each);
2. moto's own time: a recording proxy (gpuforge_lab.bench.replay, its own process) sits between every
   client and moto. The first pass of each kind of request goes to moto and is timed there (the
   "moto" rows); every timed case after that is answered from the proxy's memory, so the figures
   are the clients' own work (HTTP on loopback, XML parsing, Ansible) and not the emulator's;
3. times, --repeat times each: raw boto3 paging of describe_instances with the inventory's
   filters; ansible-inventory --list with inventory/aws_ec2.yml and with the plugin
   (inventory/ec2_fleet.yml's settings), each with --flush-cache (cold) and then from the cache
   (jsonfile, in a temporary directory); and ansible-inventory on an empty inventory (the floor).

Pages: moto counts MaxResults in reservations, AWS in instances (up to 1,000). With reservations of
--batch 10 instances, aws_ec2 (no MaxResults: moto's default of 100) and the plugin (page_size 100
here) both get pages of 1,000 instances, as AWS would page them.

--no-aws-ec2 leaves out the two aws_ec2.yml cases and moto's pass for them: at 5,000 hosts on 2 loaded
CPUs they take most of an hour (moto's pass alone about 10 minutes), so a --repeat 3 run of the plugin
against boto3 fits where the full run does not. Each timed case is printed as it ends, so a long run
that is stopped still leaves its figures.

moto may take minutes to answer a large describe; every client gets --read-timeout (the plugin
through its read_timeout option, aws_ec2 through a sitecustomize shim on PYTHONPATH) and a single
attempt, so a slow answer is measured, never retried. The shim exists only here.

Run: .venv/bin/python bench/inventory.py --instances 500 5000 --repeat 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from gpuforge_lab.bench import ec2fleet
from gpuforge_lab.bench.replay import STATS_PATH
from gpuforge_lab.bench.timing import Sample, load_average, run_timed, table, time_call
from gpuforge_lab.moto import HOST, MotoServer, free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SHIM = """\
# bench/inventory.py: raise botocore's default read timeout for the slow emulator (moto).
import botocore.config

botocore.config.Config.OPTION_DEFAULTS["read_timeout"] = {timeout}
"""
# inventory/ec2_fleet.yml's settings, with moto's paging (see the docstring) and a longer read timeout.
PLUGIN_CONFIG = """\
plugin: gpuforge.gpu.ec2_fleet
cache: true
cache_plugin: ansible.builtin.jsonfile
cache_timeout: 300
cache_prefix: ec2_fleet
page_size: {page_size}
read_timeout: {timeout}
max_attempts: 1
"""
CASES = (
    "boto3 paginated describe_instances",
    "aws_ec2.yml, cold (--flush-cache)",
    "aws_ec2.yml, cached",
    "ec2_fleet plugin, cold (--flush-cache)",
    "ec2_fleet plugin, cached",
    "ansible-inventory, empty inventory (floor)",
)


def boto3_describe(endpoint: str, read_timeout: int, page_size: int) -> int:
    """What the inventories do, minus Ansible: page through describe_instances with their filters."""
    config = Config(read_timeout=read_timeout, retries={"total_max_attempts": 1})
    ec2 = boto3.session.Session().client("ec2", region_name="us-east-1", endpoint_url=endpoint, config=config)
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[
            {"Name": "instance-state-name", "Values": ["running"]},
            {"Name": "tag-key", "Values": ["parallelcluster:cluster-name"]},
        ],
        PaginationConfig={"PageSize": page_size},
    )
    return sum(len(r["Instances"]) for page in pages for r in page["Reservations"])


def replay_stats(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + STATS_PATH, timeout=10) as reply:  # noqa: S310 (loopback)
        stats: dict[str, float] = json.loads(reply.read())
        return stats


def start_replay(upstream: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuforge_lab.bench.replay", "--port", str(port), "--upstream", upstream],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://{HOST}:{port}"
    for _ in range(100):
        try:
            replay_stats(url)
            return proc, url
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    proc.terminate()
    raise SystemExit(f"bench: the replay proxy did not answer on {url}; see {log}")


def hosts_in(stdout: str) -> int:
    data: dict[str, Any] = json.loads(stdout)
    return len(data.get("_meta", {}).get("hostvars", {}))


class Notes(list[str]):
    """The run's notes, each printed as it is added (a long run that is stopped keeps what it printed)."""

    def append(self, note: str) -> None:
        print(note, flush=True)
        super().append(note)


def measure(total: int, args: argparse.Namespace) -> tuple[list[list[object]], list[str]]:
    notes = Notes()
    page_size = 1000 // args.batch
    with tempfile.TemporaryDirectory(prefix="gpuforge-bench-inv-") as tmp_name:
        tmp = Path(tmp_name)
        server = MotoServer(port=free_port(), log_path=tmp / "moto.log")
        server.start()
        replay: subprocess.Popen[bytes] | None = None
        try:
            os.environ.update(server.env())
            os.environ.pop("AWS_PROFILE", None)
            ec2 = boto3.client(
                "ec2",
                endpoint_url=server.url,
                config=Config(read_timeout=args.read_timeout, retries={"total_max_attempts": 1}),
            )
            setup = ec2fleet.build(ec2, ec2fleet.shape(total), batch=args.batch)
            notes.append(f"{total} hosts: setup (moto RunInstances, batches of {args.batch}) {setup:.0f} s")
            replay, url = start_replay(server.url, tmp / "replay.log")
            shim = tmp / "shim"
            shim.mkdir()
            (shim / "sitecustomize.py").write_text(SHIM.format(timeout=args.read_timeout))
            inv = tmp / "inventory"
            inv.mkdir()
            shutil.copy(REPO / "inventory/aws_ec2.yml", inv / "aws_ec2.yml")
            (inv / "group_vars").symlink_to(REPO / "inventory/group_vars")
            (inv / "ec2_fleet.yml").write_text(
                PLUGIN_CONFIG.format(page_size=page_size, timeout=args.read_timeout)
            )
            env = {
                **server.env(),
                "AWS_ENDPOINT_URL": url,
                "AWS_URL": url,
                "ANSIBLE_INVENTORY_CACHE_CONNECTION": str(tmp / "inv-cache"),
                "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "true",
                "PYTHONPATH": str(shim),
                "AWS_MAX_ATTEMPTS": "1",
            }
            ansible_inventory = str(BIN / "ansible-inventory")
            aws_ec2 = [ansible_inventory, "-i", str(inv / "aws_ec2.yml"), "--list"]
            plugin = [ansible_inventory, "-i", str(inv / "ec2_fleet.yml"), "--list"]
            floor_inv = tmp / "empty.yml"
            floor_inv.write_text("all:\n  hosts: {}\n")
            floor = [ansible_inventory, "-i", str(floor_inv), "--list"]

            # Priming: each kind of request reaches moto once; its time there is moto's own.
            before = replay_stats(url)["upstream_seconds"]
            found = 0

            def describe() -> None:
                nonlocal found
                found = boto3_describe(url, args.read_timeout, page_size)

            direct = time_call(describe)
            moto_boto3 = replay_stats(url)["upstream_seconds"] - before
            before = replay_stats(url)["upstream_seconds"]
            note = (
                f"{total} hosts: moto's own time for one describe pass: {moto_boto3:.1f} s as boto3 and the "
                f"plugin ask (boto3 against moto: {direct:.1f} s)"
            )
            if args.aws_ec2:
                aws_ec2_direct, _ = run_timed([*aws_ec2, "--flush-cache"], env=env, cwd=REPO)
                moto_aws_ec2 = replay_stats(url)["upstream_seconds"] - before
                note += (
                    f", {moto_aws_ec2:.1f} s as aws_ec2 asks "
                    f"(aws_ec2 cold against moto: {aws_ec2_direct:.1f} s)"
                )
            notes.append(note)

            cases = [c for c in CASES if args.aws_ec2 or not c.startswith("aws_ec2")]
            samples = {label: Sample(label) for label in cases}
            counts: dict[str, int] = {}
            sizes: dict[str, float] = {}
            for repeat in range(1, args.repeat + 1):
                samples[CASES[0]].seconds.append(time_call(describe))
                counts[CASES[0]] = found
                print(f"  run {repeat}: {CASES[0]}: {samples[CASES[0]].seconds[-1]:.2f} s", flush=True)
                for label, cmd in (
                    (CASES[1], [*aws_ec2, "--flush-cache"]),
                    (CASES[2], aws_ec2),
                    (CASES[3], [*plugin, "--flush-cache"]),
                    (CASES[4], plugin),
                    (CASES[5], floor),
                ):
                    if label not in samples:
                        continue
                    took, out = run_timed(cmd, env=env, cwd=REPO)
                    samples[label].seconds.append(took)
                    counts[label] = hosts_in(out.stdout)
                    sizes[label] = len(out.stdout) / 1e6
                    del out
                    print(f"  run {repeat}: {label}: {took:.2f} s, load {load_average()}", flush=True)
            stats = replay_stats(url)
            notes.append(
                f"{total} hosts: the proxy forwarded {stats['forwarded']:.0f} requests to moto "
                f"and answered {stats['served']:.0f} from memory"
            )
        finally:
            if replay is not None:
                replay.terminate()
                replay.wait()
            server.stop()
    boto = samples[CASES[0]].median
    rows: list[list[object]] = [
        [
            total,
            s.label,
            counts[s.label],
            f"{sizes[s.label]:.1f}" if s.label in sizes else "",
            s.median,
            s.spread,
            s.median / boto,
        ]
        for s in samples.values()
    ]
    return rows, notes


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--instances", type=int, nargs="+", default=[500, 5000])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--batch", type=int, default=10, help="instances per RunInstances call (a reservation)"
    )
    parser.add_argument("--read-timeout", type=int, default=1800, help="seconds (botocore's default is 60)")
    parser.add_argument(
        "--no-aws-ec2",
        dest="aws_ec2",
        action="store_false",
        help="leave out the aws_ec2.yml cases (the plugin against boto3 only)",
    )
    args = parser.parse_args()

    print(f"command: .venv/bin/python bench/inventory.py {' '.join(sys.argv[1:])}")
    print(f"load before: {load_average()}")
    rows: list[list[object]] = []
    notes: list[str] = []
    for total in args.instances:
        got_rows, got_notes = measure(total, args)
        rows += got_rows
        notes += got_notes
        print(
            table(["hosts", "case", "found", "output MB", "median s", "spread s", "x boto3"], got_rows),
            flush=True,
        )
    print(f"\nmedian of {args.repeat} run(s); load after: {load_average()}\n")
    print(table(["hosts", "case", "found", "output MB", "median s", "spread s", "x boto3"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
