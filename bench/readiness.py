#!/usr/bin/env python3
"""Node readiness: nodes started from the golden image (a lab bake) vs bare nodes.

What a new node costs before it can take jobs, both ways, with the same command a fleet gets
(`ansible-playbook site.yml`: install what is missing, then configure Slurm, NCCL and health):

1. image: a 1-host lab (`rdbake`) gets the NVIDIA test fixtures and is baked with
   `gpuforge-lab bake --save-image` (the real Packer build, sanitizer included). Timed once:
   it is what the image costs, paid per image, not per node.
2. bare: for each fleet size N, a fresh N-host lab (`rdbare`) from plain Debian 12.
3. golden: a fresh N-host lab (`rdgold`) booted from that image (`gpuforge-lab up --image`).

For 2 and 3: `lab up` (timed: boot until every host answers SSH), the NVIDIA fixtures (untimed:
the lab's stand-in for NVIDIA's repositories, which a real node reaches over the network), then
site.yml (timed), its changed-task count, and a rerun that must report changed=0 (untimed).
Packages come through the lab's caching proxy (/var/cache/gpuforge/packages): when it is warm
no download is timed, which favours the bare node (it downloads far more on a real network).

Run (as root; labs rdbake, rdbare, rdgold; image rdgolden-<pid>, removed at the end):
  .venv/bin/python bench/readiness.py --nodes 1 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gpuforge.errors import ExternalError
from gpuforge_lab import state
from gpuforge_lab.bench import labrun
from gpuforge_lab.bench.timing import load_average, run_timed, table

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SITE = ["site.yml", "-e", f"@{labrun.FIXTURE_VARS}"]


def cache_size() -> str:
    cache = state.cache_root() / "packages"
    files = [p for p in cache.rglob("*") if p.is_file()] if cache.is_dir() else []
    return f"{len(files)} files, {sum(p.stat().st_size for p in files) / 2**20:.0f} MiB"


def measure(nodes: int, variant: str, image: str | None) -> list[object]:
    name = "rdgold" if image else "rdbare"
    up_seconds, out = run_timed(
        [str(BIN / "gpuforge-lab"), "up", "--name", name, "--nodes", str(nodes), "--json"]
        + (["--image", image] if image else []),
        cwd=REPO,
    )
    lab = labrun.Lab(name=name, info=json.loads(out.stdout))
    try:
        env = lab.env()
        run_timed([str(BIN / "ansible-inventory"), "--list", "--flush-cache"], env=env, cwd=REPO)
        labrun.prepare_fixtures(env)
        site_seconds, first = run_timed(
            [str(BIN / "ansible-playbook"), *SITE], env=env, cwd=REPO, check=False, timeout=7200
        )
        hosts, changed, bad = labrun.recap_totals(first.stdout)
        _, second = run_timed(
            [str(BIN / "ansible-playbook"), *SITE], env=env, cwd=REPO, check=False, timeout=7200
        )
        _, rerun_changed, rerun_bad = labrun.recap_totals(second.stdout)
        for result in (first, second):
            if result.returncode != 0:
                print(f"[{variant} x{nodes}] site.yml exited {result.returncode}:\n{result.stdout[-2000:]}")
    finally:
        labrun.down(name)
    ok = hosts == nodes and bad == rerun_bad == 0 and rerun_changed == 0
    return [
        nodes,
        variant,
        up_seconds,
        site_seconds,
        up_seconds + site_seconds,
        f"{changed / max(hosts, 1):.0f}",
        rerun_changed,
        "ok" if ok else "FAILED",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 4], help="fleet sizes (default 1 4)")
    args = parser.parse_args()
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO, check=False
    ).stdout.strip()
    print(f"gpuforge {rev}; load before: {load_average()}; package cache: {cache_size()}", flush=True)
    image = f"rdgolden-{os.getpid()}"
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="gpuforge-bench-readiness-") as tmp_dir:
        try:
            bake_seconds = labrun.bake_image(image, Path(tmp_dir), lab_name="rdbake")
            print(f"  image bake (1 host, Packer + sanitize + save): {bake_seconds:.1f} s", flush=True)
            for nodes in args.nodes:
                for variant, source in (("bare", None), ("golden", image)):
                    try:
                        row = measure(nodes, variant, source)
                    except ExternalError as exc:
                        row = [
                            nodes,
                            variant,
                            "-",
                            "-",
                            "-",
                            "-",
                            "-",
                            f"FAILED: {str(exc).splitlines()[-1][:100]}",
                        ]
                    rows.append(row)
                    print(
                        "  " + " ".join(f"{c:.1f}" if isinstance(c, float) else str(c) for c in row),
                        flush=True,
                    )
        finally:
            labrun.gpuforge_lab("image", "rm", image)
    print(f"\nload after: {load_average()}; package cache: {cache_size()}\n")
    bare = {r[0]: r for r in rows if r[1] == "bare"}
    out_rows = []
    for r in rows:
        ref = bare.get(r[0])
        faster = (
            f"{ref[4] / r[4]:.2f}x" if ref and isinstance(ref[4], float) and isinstance(r[4], float) else "-"
        )
        out_rows.append([*r[:5], faster, *r[5:]])
    print(
        table(
            [
                "hosts",
                "start from",
                "lab up s",
                "site.yml s",
                "ready s",
                "x faster than bare",
                "changed tasks per host",
                "changed (rerun)",
                "result",
            ],
            out_rows,
        )
    )
    for nodes, ref in bare.items():
        gold = next((r for r in rows if r[0] == nodes and r[1] == "golden"), None)
        if gold and isinstance(ref[4], float) and isinstance(gold[4], float) and ref[4] > gold[4]:
            saved = ref[4] - gold[4]
            print(
                f"{nodes} host(s): the image saves {saved:.0f} s per start of {nodes} node(s); "
                f"its {bake_seconds:.0f} s bake is repaid after {bake_seconds / saved:.1f} such starts"
            )
    return 0 if all(r[-1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
