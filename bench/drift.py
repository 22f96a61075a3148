#!/usr/bin/env python3
"""Drift check vs converge: playbooks/drift.yml beside an idempotent site.yml, same lab, same run.

On a fresh lab (hosts from plain Debian 12, the lab's NVIDIA stand-ins prepared, not timed):
`site.yml` converges the hosts (first run, reported, not compared), then, timed one after the other
on the converged hosts: `site.yml` again (the idempotent rerun, changed=0), `playbooks/drift.yml`
(the drift check as a user runs it) and `playbooks/drift.yml -e gpuforge_drift_install=true`
(the deep check that also judges the install roles' files). Both drift runs must find no drift
(exit 0), and the site.yml rerun must change nothing (changed=0: a rerun that changes something is
not the idempotent baseline, and the run fails). --profile adds ansible.posix.profile_tasks to the
timed runs and prints their slowest tasks; --keep leaves the lab up afterwards (take it down with
`gpuforge-lab down --name NAME`) and --reuse runs on a lab of that name that is already up (its
fixtures prepared), leaving it up.
Run (as root; lab bench-drift):
  .venv/bin/python bench/drift.py --nodes 3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from gpuforge_lab.bench import labrun
from gpuforge_lab.bench.timing import load_average, run_timed, table

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROFILED = {
    "ANSIBLE_CALLBACKS_ENABLED": "ansible.posix.profile_tasks",
    "PROFILE_TASKS_TASK_OUTPUT_LIMIT": "12",
}
BASELINE = "site.yml (rerun)"
RUNS = {
    BASELINE: ["site.yml"],
    "drift.yml": ["playbooks/drift.yml"],
    "drift.yml -e gpuforge_drift_install=true": ["playbooks/drift.yml", "-e", "gpuforge_drift_install=true"],
}


def slowest(stdout: str) -> str:
    """profile_tasks' summary: the lines after the last ==== rule that name a task and its seconds."""
    tail = stdout.rsplit("=" * 20, 1)[-1]
    return "\n".join(line for line in tail.splitlines() if line.rstrip().endswith("s") and " -" in line)


def verdict(label: str, returncode: int, changed: int) -> str:
    """A timed run's result: "ok", or why the row does not count."""
    if returncode != 0:
        return f"exit {returncode}"
    if label == BASELINE and changed != 0:
        # The comparison is against an idempotent converge; a rerun that changes something is not
        # one (and its time, spent changing things, would flatter the drift runs beside it).
        return f"changed {changed}, not idempotent"
    return "ok"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=3, help="lab hosts: a head node and N-1 compute nodes")
    parser.add_argument("--name", default="bench-drift", help="the lab's name (an old one is taken down)")
    parser.add_argument("--profile", action="store_true", help="print each timed run's slowest tasks")
    parser.add_argument("--keep", action="store_true", help="leave the lab up afterwards")
    parser.add_argument("--reuse", action="store_true", help="run on the lab --name that is already up")
    args = parser.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    print(f"gpuforge {rev.stdout.strip()}, {args.nodes} lab hosts; load before: {load_average()}", flush=True)
    lab = labrun.Lab(args.name, {}) if args.reuse else labrun.up(args.name, args.nodes)
    rows: list[list[object]] = []
    try:
        env = lab.env()
        run_timed([str(BIN / "ansible-inventory"), "--list", "--flush-cache"], env=env, cwd=REPO)
        if not args.reuse:
            labrun.prepare_fixtures(env)
        first, out = run_timed([str(BIN / "ansible-playbook"), "site.yml"], env=env, cwd=REPO, check=False)
        hosts, changed, bad = labrun.recap_totals(out.stdout)
        print(
            f"  site.yml first run: {first:.1f} s, {hosts} hosts, changed {changed}, failed {bad}", flush=True
        )
        if out.returncode != 0:
            print(out.stdout[-3000:], file=sys.stderr)
            return 1
        for label, argv in RUNS.items():
            seconds, out = run_timed(
                [str(BIN / "ansible-playbook"), *argv],
                env={**env, **(PROFILED if args.profile else {})},
                cwd=REPO,
                check=False,
            )
            hosts, changed, bad = labrun.recap_totals(out.stdout)
            result = verdict(label, out.returncode, changed)
            rows.append([label, seconds, hosts, changed, result])
            print(f"  {label}: {seconds:.1f} s ({result})", flush=True)
            if result != "ok":
                print(out.stdout[-3000:], file=sys.stderr)
            if args.profile:
                print(f"[{label}] slowest tasks:\n{slowest(out.stdout)}", flush=True)
    finally:
        if not (args.keep or args.reuse):
            labrun.down(lab.name)
    print(f"\nload after: {load_average()}\n")
    base = rows[0][1]
    print(
        table(
            ["run", "wall s", "x site.yml rerun", "hosts", "changed", "result"],
            [[r[0], r[1], f"{r[1] / base:.2f}x", *r[2:]] for r in rows],  # type: ignore[operator]
        )
    )
    return 0 if all(r[-1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
