"""scripts/ci/testrun.py, the concurrent `make test`: same coverage, phases side by side, a table."""

from __future__ import annotations

import importlib.util
import re
import signal
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


sys.path.insert(0, str(REPO / "scripts" / "ci"))
import schedule  # noqa: E402  (the runner's own module; scripts/ci is not a package)


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_testrun", REPO / "scripts" / "ci" / "testrun.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["ci_testrun"] = module
    spec.loader.exec_module(module)
    return module


testrun = _load()


@pytest.fixture
def logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(testrun, "LOG_DIR", tmp_path)
    return tmp_path


def test_every_test_module_is_in_exactly_one_group() -> None:
    """The groups together are the whole suite, so running them all keeps `pytest`'s coverage."""
    groups = testrun.pytest_groups(REPO / "tests")
    listed = [m.name for modules in groups.values() for m in modules]
    assert sorted(listed) == sorted(p.name for p in (REPO / "tests").glob("test_*.py"))
    assert len(listed) == len(set(listed))


def test_lab_modules_run_apart_and_the_shared_lab_once(tmp_path: Path) -> None:
    """A module naming its own lab is a group; the `fleet_lab` users share one group (one lab)."""
    (tmp_path / "test_own.py").write_text('LAB = labtools.lab_name("own")\n')
    (tmp_path / "test_shared_a.py").write_text("def test_a(fleet_lab: dict) -> None: ...\n")
    (tmp_path / "test_shared_b.py").write_text("def test_b(run_playbook, fleet_lab) -> None: ...\n")
    (tmp_path / "test_plain.py").write_text("def test_c() -> None: ...\n")
    groups = testrun.pytest_groups(tmp_path)
    names = {group: [m.name for m in modules] for group, modules in groups.items()}
    assert names == {
        "unit": ["test_plain.py"],
        "fleet_lab": ["test_shared_a.py", "test_shared_b.py"],
        "test_own": ["test_own.py"],
    }
    phases = testrun.pytest_phases(tmp_path, "pytest", "-ci", schedule.Record(), unit_shards=1)
    suffixes = [p.env["GPUFORGE_TEST_LAB_SUFFIX"] for p in phases]
    assert len(set(suffixes)) == len(phases)
    assert all(len("mitogen" + s) <= 12 for s in suffixes)


def _record(tests: dict[str, tuple[float, str]], phases: dict[str, float] | None = None) -> schedule.Record:
    return schedule.Record(
        phases=phases or {},
        tests={
            t: schedule.TestTiming(s, frozenset(p.split(",")) if p else frozenset())
            for t, (s, p) in tests.items()
        },
    )


def test_shards_balance_by_the_given_weight_and_cover_every_module() -> None:
    unit = testrun.pytest_groups(REPO / "tests")["unit"]
    weights = {m: float(len(m.name)) for m in unit}
    parts = testrun.shards(unit, 3, weights.__getitem__)
    assert len(parts) == 3
    assert sorted(m for part in parts for m in part) == sorted(unit)
    totals = [sum(weights[m] for m in p) for p in parts]
    assert max(totals) - min(totals) <= max(weights.values())


def test_the_unit_layer_is_what_the_record_measured_fast_and_without_a_playbook() -> None:
    record = _record(
        {
            "tests/test_a.py::fast": (0.2, ""),
            "tests/test_a.py::slow": (4.0, ""),
            "tests/test_a.py::plays": (0.5, "ansible-playbook"),
            "tests/test_a.py::gits": (0.5, "git"),
            "tests/test_a.py::bakes": (0.9, "git,packer"),
        }
    )
    layer = {t for t in record.tests if record.in_unit_layer(t)}
    assert layer == {"tests/test_a.py::fast", "tests/test_a.py::gits"}
    assert not record.in_unit_layer("tests/test_a.py::new")  # unmeasured: long, so with the rest
    assert record.module_seconds("tests/test_a.py", "unit") == pytest.approx(0.7)
    assert record.module_seconds("tests/test_a.py", "rest") == pytest.approx(5.4)
    assert record.module_seconds("tests/test_new.py", "rest") == schedule.UNKNOWN_TEST_SECONDS
    assert record.phase_seconds("pytest never measured") == schedule.UNKNOWN_PHASE_SECONDS


def test_the_record_round_trips_and_is_one_test_a_line(tmp_path: Path) -> None:
    log = [
        '{"id": "tests/test_a.py::x", "seconds": 0.25, "child_cpu": 0, "started": {"git": 2}}',
        '{"id": "tests/test_a.py::y", "seconds": 3.5, "child_cpu": 1, "started": {}, "wall": 0.5}',
    ]
    tests = schedule.read_test_log(log)
    text = schedule.dump({"lint": 40.04}, tests, {"commit": "abc"})
    assert text.count("tests/test_a.py::") == 2 and len(text.splitlines()) == 8
    (tmp_path / "timings.json").write_text(text)
    back = schedule.load(tmp_path / "timings.json")
    assert back.tests == tests and back.phases == {"lint": 40.0} and back.measured == {"commit": "abc"}
    # Alone, y counts its shared fixture in full (3.5 s); in the run it took 0.5 s: shards add that up.
    assert back.module_seconds("tests/test_a.py", "rest") == 0.5
    assert schedule.load(tmp_path / "absent.json") == schedule.Record()


def test_each_lab_less_module_runs_once_per_layer_and_the_unit_layer_is_sharded_first(tmp_path: Path) -> None:
    """Every test runs exactly once: a lab-less module is in a unit shard and in a rest shard (or the
    shared lab's group), each limited to its layer; modules with labs of their own run whole."""
    (tmp_path / "test_own.py").write_text('LAB = labtools.lab_name("own")\n')
    (tmp_path / "test_shared.py").write_text("def test_b(fleet_lab: dict) -> None: ...\n")
    for name in ("a", "b", "c"):
        (tmp_path / f"test_{name}.py").write_text("def test_x() -> None: ...\n")
    phases = testrun.pytest_phases(tmp_path, "pytest", "", schedule.Record(), unit_shards=2, rest_shards=2)
    by_layer: dict[str, list[str]] = {}
    for phase in phases:
        modules = [Path(a).name for a in phase.argv if a.endswith(".py")]
        by_layer.setdefault(phase.env.get("GPUFORGE_TEST_LAYER", "whole"), []).extend(modules)
    assert sorted(by_layer["unit"]) == ["test_a.py", "test_b.py", "test_c.py", "test_shared.py"]
    assert sorted(by_layer["rest"]) == ["test_a.py", "test_b.py", "test_c.py", "test_shared.py"]
    assert by_layer["whole"] == ["test_own.py"]
    assert [p.name for p in phases][:2] == ["pytest unit-1", "pytest unit-2"]
    assert all(p.layered == ("GPUFORGE_TEST_LAYER" in p.env) for p in phases)


def test_a_layered_phase_that_found_no_test_of_its_layer_passed() -> None:
    """pytest exits 5 when a layer holds none of the collected tests: nothing failed."""
    assert testrun.Phase("pytest unit-1", ["pytest"], layered=True, returncode=5).ok
    assert not testrun.Phase("pytest test_twins", ["pytest"], returncode=5).ok


def test_every_molecule_scenario_is_a_phase() -> None:
    phases = testrun.molecule_phases(REPO / "molecule", "molecule", schedule.Record())
    scenarios = sorted(p.parent.name for p in (REPO / "molecule").glob("*/molecule.yml"))
    assert [p.argv[-1] for p in phases] == scenarios
    assert all(p.argv[1:3] == ["test", "-s"] for p in phases)


def test_phases_run_side_by_side_and_failures_are_kept(logs: Path) -> None:
    phases = [testrun.Phase(f"sleep {n}", ["sleep", "1"]) for n in range(3)]
    phases.append(testrun.Phase("fails", ["sh", "-c", "echo broken; exit 3"]))
    start = time.monotonic()
    testrun.run_concurrently(phases, jobs=4, timeout=60, echo=False)
    assert time.monotonic() - start < 2.5  # four phases, one second each, at once
    assert [p.returncode for p in phases] == [0, 0, 0, 3]
    assert (logs / "fails.log").read_text() == "broken\n"


def test_a_failed_phase_is_summed_up_by_its_failing_tests_else_its_last_lines(logs: Path) -> None:
    """CI shows only the run's tail: the failed tests must be named there, not only in the phase's log."""
    pytest_like = testrun.Phase("pytest rest-1", ["true"], returncode=1)
    pytest_like.log.write_text(
        "tests/test_a.py ..F\n___ test_x ___\n>       assert ok, why\nE       AssertionError: no\n"
        "E         JobState=FAILED Reason=NodeFail\n=== short test summary info ===\n"
        "FAILED tests/test_a.py::test_x - AssertionError: no\nERROR tests/test_b.py::test_y - TimeoutError\n"
    )
    assert testrun.failure_lines(pytest_like) == [
        "  FAILED tests/test_a.py::test_x - AssertionError: no",
        "  ERROR tests/test_b.py::test_y - TimeoutError",
        # The explanation the summary cuts to its first line.
        "  E       AssertionError: no",
        "  E         JobState=FAILED Reason=NodeFail",
    ]
    framed = testrun.Phase("molecule slurm", ["true"], returncode=1)
    framed.log.write_text(
        "  \x1b[2m│\x1b[0m SKIPPED [1] tests/test_slurm.py:36: x\n  │ FAILED\n"
        "  │   tests/test_slurm.py::test_job[ansible://head] - AssertionError\n  │ ===== 1 failed\n"
    )
    assert testrun.failure_lines(framed) == [
        "  FAILED tests/test_slurm.py::test_job[ansible://head] - AssertionError"
    ]
    # A long explanation (a playbook's output quoted in the message): its start and its end, per test.
    quoted = [f"E         line {n}" for n in range(30)]
    assert testrun.explanations(["___ test_a ___", *quoted, "___ test_b ___", "E   short"]) == [
        *quoted[:5],
        "E   ... 10 lines ...",
        *quoted[-15:],
        "E   short",
    ]
    other = testrun.Phase("lint", ["true"], returncode=2)
    other.log.write_text("".join(f"line {n}\n" for n in range(40)))
    assert testrun.failure_lines(other, tail=3) == ["  line 37", "  line 38", "  line 39"]


def test_jobs_limits_how_many_run_at_once(logs: Path) -> None:
    phases = [testrun.Phase(f"p{n}", ["sleep", "0.5"]) for n in range(3)]
    start = time.monotonic()
    testrun.run_concurrently(phases, jobs=1, timeout=60, echo=False)
    assert time.monotonic() - start >= 1.5
    assert all(p.ok for p in phases)


def test_a_phase_over_its_timeout_is_stopped(logs: Path) -> None:
    phase = testrun.Phase("hangs", ["sleep", "60"])
    start = time.monotonic()
    testrun.run_concurrently([phase], jobs=1, timeout=0.5, echo=False)
    assert time.monotonic() - start < 10
    assert not phase.ok


def test_a_phase_started_with_sigint_ignored_is_still_stopped_by_it(logs: Path) -> None:
    """`.ci/run &` starts the runner with SIGINT ignored; its phases must still take the SIGINT that
    lets pytest and Molecule tear their labs down (else only SIGKILL after the grace period)."""
    phase = testrun.Phase("hangs", ["sleep", "60"])
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        start = time.monotonic()
        testrun.run_concurrently([phase], jobs=1, timeout=0.5, echo=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - start < 10
    assert phase.returncode == -signal.SIGINT


def test_the_table_names_every_phase_the_total_the_budget_and_the_machine() -> None:
    a = testrun.Phase("lint", ["true"], started=0.0, seconds=12.0, returncode=0)
    b = testrun.Phase("molecule slurm", ["true"], started=0.5, seconds=30.5, returncode=2)
    text = testrun.table([a, b], wall=31.0, machine="2 CPUs, load average 1 1 1", budget=30)
    lines = text.splitlines()
    assert lines[0].split() == ["phase", "result", "start", "s", "seconds"]
    assert any(line.startswith("lint") and line.endswith("12.0") for line in lines)
    assert any("molecule slurm" in line and "FAILED (2)" in line for line in lines)
    assert any(line.startswith("sum of phases") and line.endswith("42.5") for line in lines)
    assert any(line.startswith("total (wall clock)") and line.endswith("31.0") for line in lines)
    assert "budget: 30 s; this run 31.0 s, over by 1.0 s" in lines
    assert lines[-1] == "machine: 2 CPUs, load average 1 1 1"
    assert "within it by 169.0 s" in testrun.table([a], wall=31.0, machine="m", budget=200)


def test_the_critical_path_follows_the_slots_back_from_the_last_phase() -> None:
    """The last phase to end, then the phase whose end freed its slot, back to the start."""

    def phase(name: str, started: float, seconds: float) -> object:
        return testrun.Phase(name, ["true"], started=started, seconds=seconds, returncode=0)

    setup = phase("setup", 0, 60)
    unit = phase("pytest unit-1", 60, 90)
    lab = phase("pytest test_fleet_lab", 150, 700)
    short = phase("lint", 150, 40)
    late = phase("molecule nvidia", 190, 800)  # took lint's slot when lint ended
    side = phase("pytest twins", 150, 500)
    chain = testrun.critical_path([setup, unit, lab, short, late, side])
    assert [p.name for p in chain] == ["setup", "pytest unit-1", "lint", "molecule nvidia"]
    text = testrun.table([setup, unit, lab, short, late, side], wall=990, machine="m")
    held = text.split("critical path", 1)[1].splitlines()[1:5]
    assert [line.split()[0] for line in held] == ["molecule", "pytest", "setup", "lint"]


def test_make_test_and_ci_run_use_the_runner() -> None:
    """The README's test command (`make test`) and .ci/run are the same entry."""
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "scripts/ci/testrun.py" in recipe
    assert "make test" in (REPO / ".ci" / "run").read_text()
    assert "make test" in (REPO / "README.md").read_text()


def test_molecule_playbooks_take_the_lab_name_with_its_suffix() -> None:
    """Scenarios run side by side and beside other checkouts: no playbook names its lab literally."""
    literal = re.compile(
        r"\bm-(?:" + "|".join(p.parent.name for p in (REPO / "molecule").glob("*/molecule.yml")) + r")\b"
    )
    offenders = [
        str(path.relative_to(REPO))
        for path in (REPO / "molecule").rglob("*.yml")
        if literal.search(path.read_text())
    ]
    assert offenders == []
    shared = (REPO / "molecule" / "_shared" / "lab_vars.yml").read_text()
    assert "GPUFORGE_TEST_LAB_SUFFIX" in shared


def test_the_committed_record_keeps_the_unit_layer_within_two_minutes() -> None:
    """The schedule comes from the committed record of a measured run (`scripts/ci/testrun.py --record`).
    A phase or test it does not name is treated as long (it starts early, never joins the unit layer),
    so a new module needs no entry; but the record must be one, and the unit layer it selects must fit
    the two minutes `make unit` promises on this 2-CPU machine, shard by shard."""
    record = schedule.load()
    assert record.tests and record.phases, (
        "scripts/ci/timings.json is empty: run scripts/ci/testrun.py --record"
    )
    assert {"commit", "date", "machine"} <= set(record.measured)
    phases = testrun.pytest_phases(REPO / "tests", "pytest", "", record, unit_shards=2)
    unit = [p for p in phases if p.name.startswith("pytest unit-")]
    assert len(unit) == 2 and phases[:2] == unit
    assert max(p.estimate for p in unit) <= 120, [(p.name, p.estimate) for p in unit]
