#!/usr/bin/env python3
"""`make test`: setup, the unit layer, then lint, pytest and Molecule side by side, then a timing table.

Most of the suite's wall time is spent waiting on lab hosts (boots, apt inside containers,
Slurm and SSH round trips, deliberate timeouts in the fault tests), so the lab-backed pytest
modules and the Molecule scenarios run side by side, each in its own process:

- the unit layer first and alone, one shard per CPU (`make unit`): the tests that the committed
  record of a measured run (scripts/ci/timings.json, read by scripts/ci/schedule.py) found fast and
  free of labs, playbooks and Packer, so a broken decision is reported within two minutes;
- every other test of the modules that boot no lab of their own, in shards (`rest-N`); those that
  take the session-wide `fleet_lab` fixture share one booted lab (`fleet_lab`);
- every pytest module that boots its own lab is a phase of its own, and so is each Molecule scenario.

Phases start longest first, by the record (a phase or test it does not name counts as long); each
pytest test runs in exactly one phase (GPUFORGE_TEST_LAYER, tests/timing_plugin.py). Each pytest
group gets its own GPUFORGE_TEST_LAB_SUFFIX so two groups never share a lab name. Caches are
machine-wide and shared by every phase: the lab rootfs and lab images (GPUFORGE_CACHE_DIR, built
once under a lock, the golden image and the twins included), the lab's package cache and pip's
cache. Each phase's output goes to .cache/ci/<phase>.log and is printed whole when the phase ends,
so the log never interleaves; each pytest phase's per-test timings go beside it, and the run's
record to .cache/ci/timings.json (`--record` also writes it to scripts/ci/timings.json after a run
where everything passed: the one command that refreshes the schedule). The closing table shows the
wall time against the 1,200 s budget and the phases that held the critical path. Standard library
only: this runs before the virtualenv exists.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import schedule

REPO = Path(__file__).resolve().parents[2]
LOG_DIR = REPO / ".cache" / "ci"

# A module that names a lab (tests/labtools.lab_name, which appends GPUFORGE_TEST_LAB_SUFFIX)
# boots a lab of its own.
_OWN_LAB = re.compile(r"^\s*[A-Za-z_]\w*\s*=\s*(?:labtools\.)?lab_name\(", re.MULTILINE)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A module that takes the session-wide fixture shares conftest's lab with the others.
_SHARED_LAB = re.compile(r"\bfleet_lab\s*[:,)]")

# Where each phase's and each test's time went in a measured run: the order, the shards and the
# unit layer come from it (scripts/ci/schedule.py), never from hand-kept figures.
BUDGET_SECONDS = 1200.0
# pytest's exit status when every collected test was deselected: a layer may hold none of a module's tests.
NO_TESTS_COLLECTED = 5


@dataclass
class Phase:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    estimate: float = schedule.UNKNOWN_PHASE_SECONDS
    # A pytest phase limited to one layer may find none of its modules' tests in it (exit 5).
    layered: bool = False
    # Filled in while running: seconds since the run started, and the outcome.
    started: float = 0.0
    seconds: float = 0.0
    returncode: int | None = None

    @property
    def log(self) -> Path:
        return LOG_DIR / (re.sub(r"[^A-Za-z0-9_.-]+", "-", self.name) + ".log")

    @property
    def test_log(self) -> Path:
        """Where tests/timing_plugin.py writes this phase's per-test timings."""
        return self.log.with_suffix(".tests.jsonl")

    @property
    def ended(self) -> float:
        return self.started + self.seconds

    @property
    def ok(self) -> bool:
        return self.returncode == 0 or (self.layered and self.returncode == NO_TESTS_COLLECTED)


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


def shards(modules: Sequence[Path], count: int, weight: Callable[[Path], float]) -> list[list[Path]]:
    """Split modules into at most `count` shards of similar weight (heaviest first, lightest shard)."""
    bins: list[tuple[float, list[Path]]] = [(0.0, []) for _ in range(max(1, min(count, len(modules))))]
    for module in sorted(modules, key=lambda m: (-weight(m), m.name)):
        total, members = min(bins, key=lambda b: b[0])
        bins.remove((total, members))
        bins.append((total + weight(module), [*members, module]))
    return [sorted(members) for _, members in sorted(bins, key=lambda b: b[1][0].name) if members]


def _module_id(module: Path) -> str:
    """A module's pytest node id prefix (relative to the repository, as the record keys tests)."""
    return _shown(module)


def pytest_phases(
    test_dir: Path,
    pytest: str,
    base_suffix: str,
    record: schedule.Record,
    unit_shards: int = 2,
    rest_shards: int = 2,
) -> list[Phase]:
    """The pytest phases: the unit layer first, then the rest of every module that boots no lab of its own.

    Every module that boots no lab of its own runs twice, once per layer (GPUFORGE_TEST_LAYER), so
    each of its tests runs exactly once: in the unit layer if the record says so, else with the
    rest (a test the record does not know, too). The `fleet_lab` modules' rest shares one lab.
    """
    groups = pytest_groups(test_dir)
    plain, shared = groups.pop("unit", []), groups.pop("fleet_lab", [])
    split: list[tuple[str, list[Path], str, float]] = []
    layered = plain + shared

    def unit_weight(m: Path) -> float:
        return record.module_seconds(_module_id(m), "unit")

    def rest_weight(m: Path) -> float:
        return record.module_seconds(_module_id(m), "rest")

    for number, part in enumerate(shards(layered, unit_shards, unit_weight), start=1):
        split.append((f"unit-{number}", part, "unit", sum(map(unit_weight, part))))
    for number, part in enumerate(shards(plain, rest_shards, rest_weight), start=1):
        split.append((f"rest-{number}", part, "rest", sum(map(rest_weight, part))))
    if shared:
        split.append(("fleet_lab", shared, "rest", record.phase_seconds("pytest fleet_lab")))
    for group, modules in groups.items():
        split.append((group, modules, "", record.phase_seconds(f"pytest {group}")))

    phases = []
    for index, (group, modules, layer, estimate) in enumerate(split):
        name = f"pytest {group}"
        argv = [pytest, "-p", "no:cacheprovider", *(_shown(m) for m in modules)]
        env = {"GPUFORGE_TEST_LAB_SUFFIX": lab_suffix(base_suffix, index)}
        if layer:
            env["GPUFORGE_TEST_LAYER"] = layer
        phases.append(Phase(name, argv, env, estimate, layered=bool(layer)))
    return phases


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def molecule_phases(molecule_dir: Path, molecule: str, record: schedule.Record) -> list[Phase]:
    phases = []
    for scenario in sorted(p.parent.name for p in molecule_dir.glob("*/molecule.yml")):
        if scenario.startswith("_"):
            continue
        name = f"molecule {scenario}"
        # Molecule's console wraps at 80 columns, which splits the verifier's FAILED lines.
        phases.append(
            Phase(
                name,
                [molecule, "test", "-s", scenario],
                env={"COLUMNS": "250"},
                estimate=record.phase_seconds(name),
            )
        )
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


def run_concurrently(
    phases: Sequence[Phase], jobs: int, timeout: float, echo: bool = True, origin: float | None = None
) -> None:
    """Run phases, at most `jobs` at a time, longest estimate first; fills started/seconds/returncode.

    `origin` is the run's start (time.monotonic()), so phases of several calls share one clock.
    """
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    origin = time.monotonic() if origin is None else origin
    waiting = sorted(phases, key=lambda p: -p.estimate)
    running: dict[str, tuple[Phase, subprocess.Popen[bytes], float]] = {}
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                phase = waiting.pop(0)
                env = {**os.environ, **phase.env}
                if phase.argv and Path(phase.argv[0]).name == "pytest":
                    phase.test_log.unlink(missing_ok=True)
                    env["GPUFORGE_TEST_TIMINGS"] = str(phase.test_log)
                with phase.log.open("wb") as log:
                    process = subprocess.Popen(
                        phase.argv,
                        cwd=REPO,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        preexec_fn=_interruptible,
                    )
                now = time.monotonic()
                phase.started = now - origin
                running[phase.name] = (phase, process, now)
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


def critical_path(phases: Sequence[Phase], slack: float = 2.0) -> list[Phase]:
    """The chain of phases that held the run's end: the last to finish, then the phase whose end let
    it start (it waited for that phase's slot), and so on back to the start of the run."""
    done = [p for p in phases if p.returncode is not None]
    if not done:
        return []
    chain = [max(done, key=lambda p: p.ended)]
    while chain[-1].started > slack:
        start = chain[-1].started
        before = [p for p in done if p not in chain and p.ended <= start + slack]
        if not before:
            break
        chain.append(max(before, key=lambda p: p.ended))
    return chain[::-1]


def table(phases: Sequence[Phase], wall: float, machine: str, budget: float = BUDGET_SECONDS) -> str:
    """The phase timing table printed at the end of every run: each phase, the wall time against the
    budget, and the phases that held the critical path (where the next minute is)."""
    rows = [
        (p.name, "ok" if p.ok else f"FAILED ({p.returncode})", f"{p.started:8.1f}", f"{p.seconds:8.1f}")
        for p in phases
    ]
    busy = sum(p.seconds for p in phases)
    rows.append(("sum of phases", "", "", f"{busy:8.1f}"))
    rows.append(("total (wall clock)", "", "", f"{wall:8.1f}"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'phase':<{width}}  {'result':<12}  {'start s':>8}  {'seconds':>8}", "-" * (width + 34)]
    lines += [f"{a:<{width}}  {b:<12}  {c:>8}  {d:>8}" for a, b, c, d in rows]
    over = wall - budget
    verdict = f"over by {over:.1f} s" if over > 0 else f"within it by {-over:.1f} s"
    lines.append(f"budget: {budget:.0f} s; this run {wall:.1f} s, {verdict}")
    chain = critical_path(phases)
    held = sorted(chain, key=lambda p: -p.seconds)[:5]
    if held:
        lines.append(
            "critical path (the phases that held the end, longest first; each began as the one before ended):"
        )
        lines += [
            f"  {p.name:<{width}}  {p.started:8.1f} -> {p.ended:8.1f}  ({p.seconds:.1f} s)" for p in held
        ]
    lines.append(f"machine: {machine}")
    return "\n".join(lines)


def failure_lines(phase: Phase, tail: int = 15, detail: int = 60) -> list[str]:
    """What a failed phase says went wrong, for the run's last lines (CI often shows only the tail):
    pytest's short summary (FAILED/ERROR per test) and then up to `detail` lines of the failures'
    explanations (pytest's `E ` lines: the short summary keeps only a message's first line), else the
    last lines of the phase's output."""
    try:
        text = phase.log.read_text(errors="replace").splitlines()
    except OSError:
        return [f"  (no output: {_shown(phase.log)} is missing)"]
    # Molecule frames its steps' output ("  │ FAILED ...") and colours it.
    clean = [_ANSI.sub("", line).lstrip(" │") for line in text]
    summary = [
        f"{line} {after.strip()}" if line in ("FAILED", "ERROR") else line
        for line, after in zip(clean, [*clean[1:], ""], strict=True)
        if line.startswith(("FAILED ", "ERROR ")) or line in ("FAILED", "ERROR")
    ]
    if not summary:
        return [f"  {line[:300]}" for line in clean[-tail:]]
    return [f"  {line[:300]}" for line in summary + explanations(clean)[:detail]]


def explanations(lines: list[str], head: int = 5, tail: int = 15) -> list[str]:
    """Each failed test's `E ` lines: all of a short one, else its first and last lines (a message that
    quotes a playbook's output has the error at its end, one that explains a state at its start)."""
    found: list[str] = []
    section: list[str] = []
    for line in [*lines, "_____ end _____"]:
        if re.fullmatch(r"_{3,} .+ _{3,}", line):
            if len(section) > head + tail:
                section = [
                    *section[:head],
                    f"E   ... {len(section) - head - tail} lines ...",
                    *section[-tail:],
                ]
            found += section
            section = []
        elif line.startswith("E "):
            section.append(line)
    return found


def machine_state() -> str:
    """CPUs and load average, so timings from a shared machine are labelled as such."""
    try:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load = "unknown"
    return f"{os.cpu_count()} CPUs, load average {load}"


def measured(
    phases: Sequence[Phase], previous: schedule.Record, machine: str, wall: float, whole: bool = True
) -> str:
    """The record of this run: of it alone after a whole run (so a removed test or phase leaves the
    record), else the previous record with what this partial run measured put over it."""
    base = schedule.Record() if whole else previous
    tests = dict(base.tests)
    for phase in phases:
        if phase.test_log.exists():
            tests.update(schedule.read_test_log(phase.test_log.read_text().splitlines()))
    phase_seconds = {**base.phases, **{p.name: p.seconds for p in phases if not p.layered}}
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    info = {
        "commit": commit,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": machine,
        "wall_seconds": f"{wall:.1f}",
    }
    return schedule.dump(phase_seconds, tests, info)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/ci/testrun.py", description=__doc__.splitlines()[0])
    default_jobs = int(os.environ.get("GPUFORGE_CI_JOBS", str(max(4, 2 * (os.cpu_count() or 1)))))
    parser.add_argument("--jobs", type=int, default=default_jobs, help="phases at once (GPUFORGE_CI_JOBS)")
    cpus = max(1, os.cpu_count() or 1)
    parser.add_argument(
        "--unit-shards",
        type=int,
        default=int(os.environ.get("GPUFORGE_CI_UNIT_SHARDS", str(cpus))),
        help="processes the unit layer is split into (GPUFORGE_CI_UNIT_SHARDS; default: one per CPU)",
    )
    parser.add_argument(
        "--rest-shards",
        type=int,
        default=int(os.environ.get("GPUFORGE_CI_REST_SHARDS", "2")),
        help="processes the rest of the lab-less modules is split into (GPUFORGE_CI_REST_SHARDS)",
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before a phase is stopped")
    parser.add_argument("--skip-setup", action="store_true", help="do not run `make setup` first")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="run only phases whose name starts with this (repeatable): lint, pytest, molecule, pytest unit",
    )
    parser.add_argument("--list", action="store_true", help="print the phases and their commands")
    parser.add_argument(
        "--record",
        action="store_true",
        help=f"after a run where every phase passed, write its timings to {_shown(schedule.RECORD)}",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.unit_shards < 1 or args.rest_shards < 1:
        parser.error("--jobs, --unit-shards and --rest-shards must be at least 1")

    record = schedule.load()
    venv_bin = REPO / ".venv" / "bin"
    phases = [Phase("lint", ["make", "--no-print-directory", "lint"], estimate=record.phase_seconds("lint"))]
    phases += pytest_phases(
        REPO / "tests",
        str(venv_bin / "pytest"),
        os.environ.get("GPUFORGE_TEST_LAB_SUFFIX", ""),
        record,
        unit_shards=args.unit_shards,
        rest_shards=args.rest_shards,
    )
    phases += molecule_phases(REPO / "molecule", str(venv_bin / "molecule"), record)
    if args.only:
        phases = [p for p in phases if any(p.name.startswith(o) for o in args.only)]
    if args.list:
        for phase in phases:
            env = " ".join(f"{k}={v}" for k, v in phase.env.items())
            print(
                f"{phase.name} (~{phase.estimate:.0f} s): {env} {' '.join(phase.argv)}".replace(":  ", ": ")
            )
        return 0

    os.environ["PATH"] = f"{venv_bin}:{os.environ['PATH']}"
    start = time.monotonic()
    print(f"== machine at start: {machine_state()}", flush=True)
    done: list[Phase] = []
    if not args.skip_setup:
        # The lab's Debian tree builds beside pip (each keeps one CPU busy), not in the first lab phase.
        setup = Phase("setup", ["make", "--no-print-directory", "-j2", "setup", "lab-rootfs"])
        run_concurrently([setup], jobs=1, timeout=args.timeout, origin=start)
        done.append(setup)
    # The unit layer alone first, one shard per CPU: a broken decision is reported within two
    # minutes of the start, before the lab phases take the CPUs.
    first = [p for p in phases if p.name.startswith("pytest unit-")]
    later = [p for p in phases if p not in first]
    for batch in (first, later):
        if batch and all(p.ok for p in done if p.name == "setup"):
            run_concurrently(batch, jobs=args.jobs, timeout=args.timeout, origin=start)
            done += batch
    wall = time.monotonic() - start
    machine = machine_state()
    print("\n" + table(done, wall, machine), flush=True)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    timings = measured([p for p in done if p.name != "setup"], record, machine, wall, whole=not args.only)
    (LOG_DIR / "timings.json").write_text(timings)
    failed = [p for p in done if not p.ok]
    if failed:
        for phase in failed:
            print(f"== {phase.name} failed (exit {phase.returncode}); its log is {_shown(phase.log)}:")
            print("\n".join(failure_lines(phase)), flush=True)
        names = ", ".join(p.name for p in failed)
        print(f"gpuforge: error: failed phases: {names}", file=sys.stderr)
        return 1
    if args.record:
        schedule.RECORD.write_text(timings)
        print(
            f"== wrote this run's timings to {_shown(schedule.RECORD)}: commit it with the code", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
