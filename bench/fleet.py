#!/usr/bin/env python3
"""Fleet convergence: site.yml on lab hosts, this project's ansible.cfg vs Ansible's defaults.

For each fleet size and each configuration, on a fresh lab (so every "first run" really is one):
`ansible all -m ping` (the floor: connect, run one module, return), site.yml first run, and
site.yml again (the idempotent rerun, which must report changed=0). Configurations:

- project:  ./ansible.cfg (forks 25, pipelining, SSH ControlPersist, smart gathering + fact cache);
- defaults: a cfg that only sets what is needed to find roles, collections and the inventory
  (and skips host key checks for the throwaway lab hosts), so forks=5, no pipelining, linear;
- mitogen:  ./ansible.cfg plus ANSIBLE_STRATEGY=mitogen_linear, the project's opt-in (the
  strategy comes through plugins/strategy; pip install '.[mitogen]'), when asked for (--mitogen).

Every configuration gets its own empty fact cache, so nothing measured leans on an earlier run.
Hosts start from plain Debian 12 (site.yml installs the whole stack), or with --golden from a
golden image baked once at the start (`gpuforge-lab bake --save-image`, for the lab's head and
compute instance types; not part of the figures, bench/readiness.py times it): the production
shape, where ParallelCluster starts every node from the golden AMI and site.yml then configures
it. Golden hosts take the golden fast path (docs/manifest.md); the "fast path" column counts the
hosts that did on the rerun. --profile adds ansible.posix.profile_tasks to the rerun and prints
its slowest tasks (the rerun's time then includes the callback's small overhead).
Run (as root; labs bench1, bench4, bench16, bench-bake):
  .venv/bin/python bench/fleet.py --nodes 1 4 16 [--golden] [--mitogen]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gpuforge.errors import ExternalError
from gpuforge_lab.bench import labrun
from gpuforge_lab.bench.timing import load_average, run_timed, table

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEFAULTS_CFG = """\
# Ansible's defaults (forks 5, no pipelining, linear strategy, implicit gathering, no fact
# cache) plus only what is needed to find this repository's roles, collections and inventory.
[defaults]
roles_path = {repo}/roles
inventory = {repo}/inventory/aws_ec2.yml
collections_path = {repo}/collections:~/.ansible/collections:/usr/share/ansible/collections
host_key_checking = False
interpreter_python = auto_silent

[inventory]
enable_plugins = amazon.aws.aws_ec2
"""
SITE_VARS = ["-e", f"@{labrun.FIXTURE_VARS}"]


def configs(tmp: Path, mitogen: bool) -> dict[str, dict[str, str]]:
    defaults = tmp / "defaults.cfg"
    defaults.write_text(DEFAULTS_CFG.format(repo=REPO))
    out = {
        "project": {"ANSIBLE_CONFIG": str(REPO / "ansible.cfg")},
        "defaults": {"ANSIBLE_CONFIG": str(defaults)},
    }
    if mitogen:
        # Exactly what a user opts into: the project cfg finds the strategy in plugins/strategy.
        out["mitogen"] = {"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_STRATEGY": "mitogen_linear"}
    return out


def measure(
    nodes: int, name: str, env: dict[str, str], playbook: Path, image: str | None, profile: bool
) -> list[object]:
    lab = labrun.up(f"bench{nodes}", nodes, image=image)
    try:
        run_env = {**lab.env(), **env}
        # The inventory is not what is measured here: fill its cache once (the ping warms it too).
        run_timed([str(BIN / "ansible-inventory"), "--list", "--flush-cache"], env=run_env, cwd=REPO)
        # The lab's stand-ins for NVIDIA's repositories (untimed: a real node reaches the real ones).
        labrun.prepare_fixtures(run_env)
        ping, out = run_timed(
            [str(BIN / "ansible"), "all", "-m", "ansible.builtin.ping"], env=run_env, cwd=REPO
        )
        pinged = out.stdout.count("SUCCESS")
        first, out1 = run_timed(
            [str(BIN / "ansible-playbook"), str(playbook), *SITE_VARS], env=run_env, cwd=REPO, check=False
        )
        hosts1, changed1, bad1 = labrun.recap_totals(out1.stdout)
        profiled = {
            "ANSIBLE_CALLBACKS_ENABLED": "ansible.posix.profile_tasks",
            "PROFILE_TASKS_TASK_OUTPUT_LIMIT": "15",
        }
        rerun, out2 = run_timed(
            [str(BIN / "ansible-playbook"), str(playbook), *SITE_VARS],
            env={**run_env, **(profiled if profile else {})},
            cwd=REPO,
            check=False,
        )
        hosts2, changed2, bad2 = labrun.recap_totals(out2.stdout)
        fast = out2.stdout.count("gpuforge: fast path")
        if profile:
            print(f"[{name} x{nodes}] slowest tasks of the rerun:\n{_profile(out2.stdout)}", flush=True)
        for result in (out1, out2):
            if result.returncode != 0:
                print(
                    f"[{name} x{nodes}] site.yml exited {result.returncode}:\n{result.stdout[-2000:]}",
                    file=sys.stderr,
                )
    finally:
        labrun.down(lab.name)
    ok = "ok" if (pinged == nodes and hosts1 == hosts2 == nodes and bad1 == bad2 == 0) else "FAILED"
    return [nodes, name, ping, first, rerun, changed1, changed2, fast, ok]


def _profile(stdout: str) -> str:
    """profile_tasks' summary: the lines after the last ==== rule that name a task and its seconds."""
    tail = stdout.rsplit("=" * 20, 1)[-1]
    return "\n".join(line for line in tail.splitlines() if line.rstrip().endswith("s") and " -" in line)


def measure_row(
    nodes: int, name: str, env: dict[str, str], tmp: Path, playbook: Path, image: str | None, profile: bool
) -> list[object]:
    facts = tmp / f"facts-{name}-{nodes}"
    try:
        row = measure(
            nodes, name, {**env, "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(facts)}, playbook, image, profile
        )
    except ExternalError as exc:
        # Keep the other sizes' figures; say what broke in this row.
        row = [nodes, name, "-", "-", "-", "-", "-", "-", f"FAILED: {str(exc).splitlines()[-1][:100]}"]
    print("  " + " ".join(str(c) if not isinstance(c, float) else f"{c:.1f}" for c in row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--mitogen", action="store_true", help="also time the opt-in mitogen_linear strategy")
    parser.add_argument("--only", nargs="+", help="configurations to run (default: all)")
    parser.add_argument(
        "--playbook", type=Path, default=REPO / "site.yml", help="playbook to time (default: site.yml)"
    )
    parser.add_argument(
        "--golden", action="store_true", help="start every fleet from a golden lab image baked first"
    )
    parser.add_argument(
        "--profile", action="store_true", help="print the rerun's slowest tasks (ansible.posix.profile_tasks)"
    )
    args = parser.parse_args()
    if args.mitogen and importlib.util.find_spec("ansible_mitogen") is None:
        parser.error(
            "--mitogen needs mitogen in this environment: "
            "pip install -c requirements/constraints.txt '.[mitogen]'"
        )
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout
    start = "a golden image" if args.golden else "plain Debian 12"
    print(f"gpuforge {rev.strip()}, {args.playbook}, hosts from {start}; load before: {load_average()}")
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="gpuforge-bench-fleet-") as tmp_dir:
        tmp = Path(tmp_dir)
        image = f"fleet-golden-{os.getpid()}" if args.golden else None
        try:
            if image:
                seconds = labrun.bake_image(image, tmp)
                print(f"  golden image {image} baked in {seconds:.1f} s (not in the figures)", flush=True)
            for nodes in args.nodes:
                for name, env in configs(tmp, args.mitogen).items():
                    if not args.only or name in args.only:
                        rows.append(measure_row(nodes, name, env, tmp, args.playbook, image, args.profile))
        finally:
            if image:
                labrun.gpuforge_lab("image", "rm", image)
    print(f"\nload after: {load_average()}\n")
    base = {(r[0], r[1]): r for r in rows}
    out_rows = []
    for r in rows:
        ref = base.get((r[0], "defaults"))
        ratio_first = (
            f"{ref[3] / r[3]:.2f}x" if ref and isinstance(ref[3], float) and isinstance(r[3], float) else "-"
        )
        ratio_rerun = (
            f"{ref[4] / r[4]:.2f}x" if ref and isinstance(ref[4], float) and isinstance(r[4], float) else "-"
        )
        floor = f"{r[3] / r[2]:.1f}x" if isinstance(r[2], float) and isinstance(r[3], float) else "-"
        rerun_floor = f"{r[4] / r[2]:.1f}x" if isinstance(r[2], float) and isinstance(r[4], float) else "-"
        out_rows.append([*r[:5], ratio_first, ratio_rerun, floor, rerun_floor, r[5], r[6], r[7], r[8]])
    print(
        table(
            [
                "hosts",
                "config",
                "ping s",
                "site first s",
                "site rerun s",
                "speed-up first vs defaults",
                "speed-up rerun vs defaults",
                "first / ping",
                "rerun / ping",
                "changed (first)",
                "changed (rerun)",
                "fast path (rerun)",
                "result",
            ],
            out_rows,
        )
    )
    return 0 if all(r[-1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
