"""The CI schedule's pytest side: the `unit` layer, and a record of where each test's time goes.

Loaded by conftest.py. Every test of the unit layer (scripts/ci/schedule.py decides it from the
committed record of a measured run) gets the `unit` marker, so `pytest -m unit` runs it alone;
GPUFORGE_TEST_LAYER=unit or =rest keeps one layer of the collected tests and deselects the other
(the CI runner's phases; together they are the whole suite).

When GPUFORGE_TEST_TIMINGS names a file (the CI runner sets it for every pytest phase), each test
appends one JSON line to it: the test id, its wall
seconds (set-up, call and tear-down), the CPU its child processes used, and which programs it
started directly (`ansible-playbook`, `ansible`, `packer`, `gpuforge` ...): a process costs about a
second of CPU on the 2-core machine, so the count says where a decision is tested through a
playbook that a Python call would test as well. Standard library only.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "ci"))
# scripts/ci is not a package (the runner runs before the venv exists): imported by path.
import schedule

ENV = "GPUFORGE_TEST_TIMINGS"
LAYER_ENV = "GPUFORGE_TEST_LAYER"

_started: Counter[str] = Counter()
_original_init = subprocess.Popen.__init__


def _program(args: Any) -> str:
    """The program a Popen call starts: the basename of argv[0] (the first word of a shell string)."""
    if isinstance(args, (str, bytes, os.PathLike)):
        text = os.fsdecode(args)
        first = text.split()[0] if text.split() else text
    else:
        items = list(args)
        first = os.fsdecode(items[0]) if items else ""
    return Path(first).name


def _counting_init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
    # A running count; the hooks below take differences around each test and fixture.
    _started[_program(args)] += 1
    _original_init(self, args, *rest, **kwargs)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def pytest_configure(config: pytest.Config) -> None:
    layer = os.environ.get(LAYER_ENV, "")
    if layer and layer not in schedule.LAYERS:
        raise pytest.UsageError(
            f"{LAYER_ENV}={layer!r}: give one of {', '.join(schedule.LAYERS)}, or unset it"
        )
    if os.environ.get(ENV):
        subprocess.Popen.__init__ = _counting_init  # type: ignore[method-assign]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    record = schedule.load()
    unit = [item for item in items if record.in_unit_layer(item.nodeid)]
    for item in unit:
        item.add_marker(pytest.mark.unit)
    layer = os.environ.get(LAYER_ENV, "")
    if not layer:
        return
    chosen = set(map(id, unit)) if layer == "unit" else {id(i) for i in items} - set(map(id, unit))
    dropped = [item for item in items if id(item) not in chosen]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if id(item) in chosen]


# What each fixture's last set-up cost (keyed by the fixture definition): seconds and programs started.
_fixture_costs: dict[int, tuple[float, Counter[str]]] = {}
# The set-ups run while the current test ran (a shared fixture is set up by the first test using it).
_triggered: list[float] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Generator[None, None, None]:
    if not os.environ.get(ENV):
        yield
        return
    before, wall = Counter(_started), time.monotonic()
    yield
    seconds = time.monotonic() - wall
    _fixture_costs[id(fixturedef)] = (seconds, _started - before)
    _triggered.append(seconds)


def _fixture_cost(item: pytest.Item) -> tuple[float, Counter[str]]:
    """What the fixtures a test uses cost to set up, each in full, wherever it was set up."""
    seconds, started = 0.0, Counter[str]()
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info else ():
        if defs and id(defs[-1]) in _fixture_costs:
            cost = _fixture_costs[id(defs[-1])]
            seconds += cost[0]
            started.update(cost[1])
    return seconds, started


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """Record a test as if it ran alone: its own time and programs plus those of every fixture it uses
    (a module's shared fixture counts for each of its tests, so a layer never needs one it lacks)."""
    out = os.environ.get(ENV)
    if not out:
        yield
        return
    _triggered.clear()
    before = Counter(_started)
    cpu, wall = _children_cpu(), time.monotonic()
    yield
    elapsed = time.monotonic() - wall
    own = elapsed - sum(_triggered)
    fixtures, fixture_started = _fixture_cost(item)
    record = {
        "id": item.nodeid,
        "seconds": round(max(own, 0.0) + fixtures, 3),
        # What the test took in this run (a shared fixture counted once): what a shard's time adds up.
        "wall": round(elapsed, 3),
        "child_cpu": round(_children_cpu() - cpu, 3),
        "started": dict(sorted(((_started - before) | fixture_started).items())),
    }
    with Path(out).open("a") as log:
        log.write(json.dumps(record) + "\n")
