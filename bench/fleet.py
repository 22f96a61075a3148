#!/usr/bin/env python3
"""Fleet convergence: site.yml on lab hosts, this project's ansible.cfg vs Ansible's defaults.

For each fleet size and each configuration, on a fresh lab (so every "first run" really is one):
`ansible all -m ping` (the floor: connect, run one module, return), site.yml first run, and
site.yml again (the idempotent rerun, which must report changed=0). Configurations:

- project:  ./ansible.cfg (forks 25, pipelining, SSH ControlPersist, smart gathering + fact cache);
- defaults: a cfg that only sets what is needed to find roles, collections and the inventory
  (and skips host key checks for the throwaway lab hosts), so forks=5, no pipelining, linear;
- mitogen:  ./ansible.cfg plus the mitogen_linear strategy (--mitogen PATH, a pip --target dir),
  when asked for.

Every configuration gets its own empty fact cache, so nothing measured leans on an earlier run.
Run (as root; labs bench1, bench4, bench16):
  .venv/bin/python bench/fleet.py --nodes 1 4 16 [--mitogen /tmp/mitogen]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from gpuforge.bench import labrun
from gpuforge.bench.timing import load_average, run_timed, table
from gpuforge.errors import ExternalError

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEFAULTS_CFG = """\
# Ansible's defaults (forks 5, no pipelining, linear strategy, implicit gathering, no fact
# cache) plus only what is needed to find this repository's roles, collections and inventory.
[defaults]
roles_path = {repo}/roles
inventory = {repo}/inventory/aws_ec2.yml
collections_path = {repo}/.cache/collections:~/.ansible/collections:/usr/share/ansible/collections
host_key_checking = False
interpreter_python = auto_silent

[inventory]
enable_plugins = amazon.aws.aws_ec2
"""
SITE_VARS = ["-e", f"@{labrun.FIXTURE_VARS}"]


def configs(tmp: Path, mitogen: Path | None) -> dict[str, dict[str, str]]:
    defaults = tmp / "defaults.cfg"
    defaults.write_text(DEFAULTS_CFG.format(repo=REPO))
    out = {
        "project": {"ANSIBLE_CONFIG": str(REPO / "ansible.cfg")},
        "defaults": {"ANSIBLE_CONFIG": str(defaults)},
    }
    if mitogen is not None:
        out["mitogen"] = {
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_STRATEGY_PLUGINS": str(mitogen / "ansible_mitogen" / "plugins" / "strategy"),
            "ANSIBLE_STRATEGY": "mitogen_linear",
            "PYTHONPATH": str(mitogen),
        }
    return out


def measure(nodes: int, name: str, env: dict[str, str], playbook: Path) -> list[object]:
    lab = labrun.up(f"bench{nodes}", nodes)
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
        rerun, out2 = run_timed(
            [str(BIN / "ansible-playbook"), str(playbook), *SITE_VARS], env=run_env, cwd=REPO, check=False
        )
        hosts2, changed2, bad2 = labrun.recap_totals(out2.stdout)
        for result in (out1, out2):
            if result.returncode != 0:
                print(
                    f"[{name} x{nodes}] site.yml exited {result.returncode}:\n{result.stdout[-2000:]}",
                    file=sys.stderr,
                )
    finally:
        labrun.down(lab.name)
    ok = "ok" if (pinged == nodes and hosts1 == hosts2 == nodes and bad1 == bad2 == 0) else "FAILED"
    return [nodes, name, ping, first, rerun, changed1, changed2, ok]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--mitogen", type=Path, help="directory holding ansible_mitogen (pip install --target)"
    )
    parser.add_argument("--only", nargs="+", help="configurations to run (default: all)")
    parser.add_argument(
        "--playbook", type=Path, default=REPO / "site.yml", help="playbook to time (default: site.yml)"
    )
    args = parser.parse_args()
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout
    print(f"gpuforge {rev.strip()}, playbook {args.playbook}; load before: {load_average()}")
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="gpuforge-bench-fleet-") as tmp_dir:
        tmp = Path(tmp_dir)
        for nodes in args.nodes:
            for name, env in configs(tmp, args.mitogen).items():
                if args.only and name not in args.only:
                    continue
                facts = tmp / f"facts-{name}-{nodes}"
                try:
                    row = measure(
                        nodes, name, {**env, "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(facts)}, args.playbook
                    )
                except ExternalError as exc:
                    # Keep the other sizes' figures; say what broke in this row.
                    first_line = str(exc).splitlines()[-1][:100]
                    row = [nodes, name, "-", "-", "-", "-", "-", f"FAILED: {first_line}"]
                rows.append(row)
                print(
                    "  " + " ".join(str(c) if not isinstance(c, float) else f"{c:.1f}" for c in row),
                    flush=True,
                )
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
        out_rows.append([*r[:5], ratio_first, ratio_rerun, floor, r[5], r[6], r[7]])
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
                "changed (first)",
                "changed (rerun)",
                "result",
            ],
            out_rows,
        )
    )
    return 0 if all(r[-1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
