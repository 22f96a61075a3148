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
    phases = testrun.pytest_phases(tmp_path, "pytest", "-ci", unit_shards=1)
    suffixes = [p.env["GPUFORGE_TEST_LAB_SUFFIX"] for p in phases]
    assert len(set(suffixes)) == len(phases)
    assert all(len("mitogen" + s) <= 12 for s in suffixes)


def test_the_unit_group_is_split_into_balanced_shards_that_cover_it() -> None:
    unit = testrun.pytest_groups(REPO / "tests")["unit"]
    parts = testrun.shards(unit, 3)
    assert len(parts) == 3
    assert sorted(m for part in parts for m in part) == sorted(unit)
    weights = [
        sum(testrun.MODULE_WEIGHTS.get(m.stem, testrun.DEFAULT_MODULE_WEIGHT) for m in p) for p in parts
    ]
    heaviest = max(testrun.MODULE_WEIGHTS.values())
    assert max(weights) - min(weights) <= heaviest
    phases = testrun.pytest_phases(REPO / "tests", "pytest", "", unit_shards=3)
    assert [p.name for p in phases][:3] == ["pytest unit-1", "pytest unit-2", "pytest unit-3"]


def test_every_molecule_scenario_is_a_phase() -> None:
    phases = testrun.molecule_phases(REPO / "molecule", "molecule")
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


def test_the_table_names_every_phase_the_total_and_the_machine() -> None:
    a = testrun.Phase("lint", ["true"], seconds=12.0, returncode=0)
    b = testrun.Phase("molecule slurm", ["true"], seconds=30.5, returncode=2)
    text = testrun.table([a, b], wall=31.0, machine="2 CPUs, load average 1 1 1")
    lines = text.splitlines()
    assert lines[0].split() == ["phase", "result", "seconds"]
    assert any(line.startswith("lint") and line.endswith("12.0") for line in lines)
    assert any("molecule slurm" in line and "FAILED (2)" in line for line in lines)
    assert any(line.startswith("sum of phases") and line.endswith("42.5") for line in lines)
    assert any(line.startswith("total (wall clock)") and line.endswith("31.0") for line in lines)
    assert lines[-1] == "machine: 2 CPUs, load average 1 1 1"


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


def test_every_lab_phase_has_an_estimate_and_every_estimate_a_phase() -> None:
    """Longest-first needs a figure for each phase but the CPU-bound unit shards (weighed by module);
    a phase without one would start at UNKNOWN_ESTIMATE's place, a stale name would hide a rename."""
    phases = testrun.pytest_phases(REPO / "tests", "pytest", "", unit_shards=3)
    phases += testrun.molecule_phases(REPO / "molecule", "molecule")
    names = {p.name for p in phases if not p.name.startswith("pytest unit-")} | {"lint"}
    assert set(testrun.ESTIMATES) == names
