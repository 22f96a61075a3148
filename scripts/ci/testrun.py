#!/usr/bin/env python3
"""`make test`: setup, then lint, pytest and Molecule as concurrent phases, then a timing table.

Most of the suite's wall time is spent waiting on lab hosts (boots, apt inside containers,
Slurm and SSH round trips, deliberate timeouts in the fault tests), so the lab-backed pytest
modules and the Molecule scenarios run side by side, each in its own process:

- every pytest module that boots its own lab is a group of its own;
- the modules sharing the session-wide `fleet_lab` fixture form one group (one booted lab);
- every other test module is in the `unit` group, so a module added later is always run; that
  group is CPU-bound and split into shards of similar weight (GPUFORGE_CI_UNIT_SHARDS);
- each Molecule scenario is a phase (its lab is already named after the scenario).

Each pytest group gets its own GPUFORGE_TEST_LAB_SUFFIX so two groups never share a lab
name. Caches are machine-wide and shared by every phase: the lab rootfs and lab images
(GPUFORGE_CACHE_DIR, built once under a lock), the lab's package cache (the apt proxy's
on-disk cache) and pip's cache. Each phase's output goes to .cache/ci/<phase>.log and is
printed whole when the phase ends, so the log never interleaves. Standard library only: this
runs before the virtualenv exists.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOG_DIR = REPO / ".cache" / "ci"

# A module that names a lab (tests/labtools.lab_name, which appends GPUFORGE_TEST_LAB_SUFFIX)
# boots a lab of its own.
_OWN_LAB = re.compile(r"^\s*[A-Za-z_]\w*\s*=\s*(?:labtools\.)?lab_name\(", re.MULTILINE)
# A module that takes the session-wide fixture shares conftest's lab with the others.
_SHARED_LAB = re.compile(r"\bfleet_lab\s*[:,)]")

# Seconds each phase took in an idle clean-clone CI run (docs/performance.md: 2 CPUs, 4 phases at
# once, empty lab cache, commit 6421054), used only to start the longest phases first: a phase
# estimated too short starts late and runs alone at the end. A phase not listed is assumed long,
# so it is started early rather than last. The unit shards use MODULE_WEIGHTS.
ESTIMATES: dict[str, float] = {
    "lint": 50,
    "pytest fleet_lab": 171,
    # It waits for the shared golden image (tests/goldenlab.py) that test_fleet_lab bakes.
    "pytest test_ami_local_bake": 292,
    "pytest test_fleet_lab": 851,
    "pytest test_partial_failure_lab": 558,
    "pytest test_reliability_lab": 101,
    "pytest test_efa_verify": 86,
    "pytest test_lab_integration": 51,
    "pytest test_mitogen_strategy": 64,
    "pytest test_readme": 22,
    "pytest test_twins": 581,
    "molecule default": 38,
    "molecule nvidia": 353,
    "molecule slurm": 207,
    "molecule stack": 259,
}
UNKNOWN_ESTIMATE = 300.0

# The `unit` group is CPU-bound (control-host plays, CLI subprocesses, moto), so it is split into
# shards that run side by side; these relative weights (seconds per module, from `--durations=0`
# summed per module: the three shards run one after the other at load 7-10 on the 2-core machine,
# halved to about CI's load) balance them. A module not listed weighs DEFAULT_MODULE_WEIGHT.
# Measured after gpuforge.aws shared its botocore loader; the weights before (unit-1 327 s, unit-2
# 523 s, unit-3 137 s in the idle clean-clone run of c7154e9) overrated the role-case plays.
MODULE_WEIGHTS: dict[str, float] = {
    # 23 tests x 4 one-second sleeps (EC2 creation dates): mostly waiting.
    "test_ami_prune": 112,
    "test_ami_bake": 82,
    "test_bad_input": 70,
    "test_inventory": 48,
    "test_ami_publish": 29,
    "test_ofi_nccl_range": 23,
    "test_targets": 19,
    "test_rolling_share": 18,
    "test_dcgm_exporter_digest": 18,
    "test_no_secret_output": 15,
    "test_reliability_throttling": 14,
    "test_packer_templates": 13,
    "test_managed_files": 13,
    "test_preflight": 12,
    "test_iam_policy": 12,
    "test_wheel": 12,
    "test_observability": 12,
    "test_fleet_health": 12,
    "test_stack_roles_validate": 10,
    # Its role-case plays run under mitogen since 2f201a5.
    "test_aws_ofi_nccl_plan": 9,
    "test_fleet_tuning": 8,
    "test_cli_errors": 8,
    "test_node_manifest": 7,
    "test_packer_security": 7,
    "test_twin_records": 6,
    "test_pcluster_cli": 5,
}
DEFAULT_MODULE_WEIGHT = 3.0


@dataclass
class Phase:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    estimate: float = UNKNOWN_ESTIMATE
    # Filled in while running.
    seconds: float = 0.0
    returncode: int | None = None

    @property
    def log(self) -> Path:
        return LOG_DIR / (re.sub(r"[^A-Za-z0-9_.-]+", "-", self.name) + ".log")

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def pytest_groups(test_dir: Path) -> dict[str, list[Path]]:
    """Partition the test modules: one group per own-lab module, `fleet_lab`, and `unit`."""
    groups: dict[str, list[Path]] = {"unit": [], "fleet_lab": []}
    for module in sorted(test_dir.glob("test_*.py")):
        source = module.read_text()
        if _OWN_LAB.search(source):
            groups[module.stem] = [module]
        elif _SHARED_LAB.search(source):
            groups["fleet_lab"].append(module)
        else:
            groups["unit"].append(module)
    return {name: modules for name, modules in groups.items() if modules}


def lab_suffix(base: str, index: int) -> str:
    """A group's lab suffix: the caller's suffix plus the group's number (lab names are short)."""
    return f"{base}{index}" if base else f"-{index}"


def shards(modules: Sequence[Path], count: int) -> list[list[Path]]:
    """Split modules into at most `count` shards of similar weight (heaviest first, lightest shard)."""
    bins: list[tuple[float, list[Path]]] = [(0.0, []) for _ in range(max(1, min(count, len(modules))))]
    for module in sorted(modules, key=lambda m: (-MODULE_WEIGHTS.get(m.stem, DEFAULT_MODULE_WEIGHT), m.name)):
        weight, members = min(bins, key=lambda b: b[0])
        bins.remove((weight, members))
        bins.append((weight + MODULE_WEIGHTS.get(module.stem, DEFAULT_MODULE_WEIGHT), [*members, module]))
    return [sorted(members) for _, members in sorted(bins, key=lambda b: b[1][0].name) if members]


def pytest_phases(test_dir: Path, pytest: str, base_suffix: str, unit_shards: int = 3) -> list[Phase]:
    split: dict[str, list[Path]] = {}
    for group, modules in pytest_groups(test_dir).items():
        if group == "unit" and unit_shards > 1:
            for number, shard in enumerate(shards(modules, unit_shards), start=1):
                split[f"unit-{number}"] = shard
        else:
            split[group] = modules
    phases = []
    for index, (group, modules) in enumerate(split.items()):
        name = f"pytest {group}"
        argv = [pytest, "-p", "no:cacheprovider", *(_shown(m) for m in modules)]
        env = {"GPUFORGE_TEST_LAB_SUFFIX": lab_suffix(base_suffix, index)}
        if group.startswith("unit"):
            estimate = sum(MODULE_WEIGHTS.get(m.stem, DEFAULT_MODULE_WEIGHT) for m in modules)
        else:
            estimate = ESTIMATES.get(name, UNKNOWN_ESTIMATE)
        phases.append(Phase(name, argv, env, estimate))
    return phases


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def molecule_phases(molecule_dir: Path, molecule: str) -> list[Phase]:
    phases = []
    for scenario in sorted(p.parent.name for p in molecule_dir.glob("*/molecule.yml")):
        if scenario.startswith("_"):
            continue
        name = f"molecule {scenario}"
        phases.append(Phase(name, [molecule, "test", "-s", scenario], estimate=ESTIMATES.get(name, 300)))
    return phases


def _interruptible() -> None:
    """In the phase's child before exec: SIGINT back to its default.

    A shell starts background commands (`.ci/run &`, nohup, cron wrappers) with SIGINT ignored and
    the child inherits that: pytest and Molecule would then ignore _stop's SIGINT, never tear
    their labs down, and only die by SIGKILL after the grace period.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop(process: subprocess.Popen[bytes], grace: float = 90) -> None:
    """SIGINT first (pytest and Molecule tear their labs down on it), then SIGKILL."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_concurrently(phases: Sequence[Phase], jobs: int, timeout: float, echo: bool = True) -> None:
    """Run phases, at most `jobs` at a time, longest estimate first; fills seconds/returncode."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    waiting = sorted(phases, key=lambda p: -p.estimate)
    running: dict[str, tuple[Phase, subprocess.Popen[bytes], float]] = {}
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                phase = waiting.pop(0)
                with phase.log.open("wb") as log:
                    process = subprocess.Popen(
                        phase.argv,
                        cwd=REPO,
                        env={**os.environ, **phase.env},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        preexec_fn=_interruptible,
                    )
                running[phase.name] = (phase, process, time.monotonic())
                _say(f"== started {phase.name} ({len(running)} running, {len(waiting)} waiting)", echo)
            time.sleep(0.2)
            for name, (phase, process, started) in list(running.items()):
                if process.poll() is None and time.monotonic() - started > timeout:
                    _say(f"== {phase.name}: over {timeout:.0f}s, stopping it", echo)
                    _stop(process)
                if process.poll() is None:
                    continue
                phase.seconds = time.monotonic() - started
                phase.returncode = process.returncode
                del running[name]
                verdict = "passed" if phase.ok else f"FAILED (exit {phase.returncode})"
                _say(f"== {phase.name} {verdict} in {phase.seconds:.0f}s; its output:", echo)
                if echo:
                    sys.stdout.write(phase.log.read_text(errors="replace"))
                    sys.stdout.flush()
    finally:
        for phase, process, started in running.values():
            _stop(process)
            phase.seconds = time.monotonic() - started
            phase.returncode = process.returncode if process.returncode is not None else -1


def _say(line: str, echo: bool) -> None:
    if echo:
        print(line, flush=True)


def table(phases: Iterable[Phase], wall: float, machine: str) -> str:
    """The phase timing table printed at the end of every run."""
    rows = [(p.name, "ok" if p.ok else f"FAILED ({p.returncode})", f"{p.seconds:8.1f}") for p in phases]
    busy = sum(p.seconds for p in phases)
    rows.append(("sum of phases", "", f"{busy:8.1f}"))
    rows.append(("total (wall clock)", "", f"{wall:8.1f}"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'phase':<{width}}  {'result':<12}  {'seconds':>8}", "-" * (width + 24)]
    lines += [f"{a:<{width}}  {b:<12}  {c:>8}" for a, b, c in rows]
    lines.append(f"machine: {machine}")
    return "\n".join(lines)


def machine_state() -> str:
    """CPUs and load average, so timings from a shared machine are labelled as such."""
    try:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load = "unknown"
    return f"{os.cpu_count()} CPUs, load average {load}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/ci/testrun.py", description=__doc__.splitlines()[0])
    default_jobs = int(os.environ.get("GPUFORGE_CI_JOBS", str(max(4, 2 * (os.cpu_count() or 1)))))
    parser.add_argument("--jobs", type=int, default=default_jobs, help="phases at once (GPUFORGE_CI_JOBS)")
    parser.add_argument(
        "--unit-shards",
        type=int,
        default=int(os.environ.get("GPUFORGE_CI_UNIT_SHARDS", "3")),
        help="processes the unit group is split into (GPUFORGE_CI_UNIT_SHARDS)",
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before a phase is stopped")
    parser.add_argument("--skip-setup", action="store_true", help="do not run `make setup` first")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="run only phases whose name starts with this (repeatable): lint, pytest, molecule",
    )
    parser.add_argument("--list", action="store_true", help="print the phases and their commands")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")

    venv_bin = REPO / ".venv" / "bin"
    phases = [Phase("lint", ["make", "--no-print-directory", "lint"], estimate=ESTIMATES["lint"])]
    phases += pytest_phases(
        REPO / "tests", str(venv_bin / "pytest"), os.environ.get("GPUFORGE_TEST_LAB_SUFFIX", "")
    )
    phases += molecule_phases(REPO / "molecule", str(venv_bin / "molecule"))
    if args.only:
        phases = [p for p in phases if any(p.name.startswith(o) for o in args.only)]
    if args.list:
        for phase in phases:
            env = " ".join(f"{k}={v}" for k, v in phase.env.items())
            print(f"{phase.name}: {env} {' '.join(phase.argv)}".replace(":  ", ": "))
        return 0

    os.environ["PATH"] = f"{venv_bin}:{os.environ['PATH']}"
    start = time.monotonic()
    print(f"== machine at start: {machine_state()}", flush=True)
    done: list[Phase] = []
    if not args.skip_setup:
        # The lab's Debian tree builds beside pip (each keeps one CPU busy), not in the first lab phase.
        setup = Phase("setup", ["make", "--no-print-directory", "-j2", "setup", "lab-rootfs"])
        run_concurrently([setup], jobs=1, timeout=args.timeout)
        done.append(setup)
    if all(p.ok for p in done):
        run_concurrently(phases, jobs=args.jobs, timeout=args.timeout)
        done += phases
    print("\n" + table(done, time.monotonic() - start, machine_state()), flush=True)
    failed = [p.name for p in done if not p.ok]
    if failed:
        print(f"gpuforge: error: failed phases: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
