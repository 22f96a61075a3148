"""The CI schedule's one source: the record of a measured run, and what it decides.

`scripts/ci/timings.json` is written by `scripts/ci/testrun.py --record` from a whole run (every
phase's wall seconds, and each pytest test's seconds and the programs it started) and committed
with the code. From it, and nothing hand-kept:

- the unit layer: the tests of the modules that boot no lab whose recorded run took at most
  UNIT_TEST_SECONDS and started no lab, Molecule, Packer or Ansible process. It runs first in CI
  (`make unit`), so a broken decision shows within two minutes;
- the order in which phases start (longest first) and the weights that balance shards.

A test or phase the record does not name is treated as long: it is left out of the unit layer and
starts early. Standard library only: the runner uses it before the virtualenv exists, and the test
plugin (tests/timing_plugin.py) imports it to select a layer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

RECORD = Path(__file__).resolve().parent / "timings.json"

# Per test: the unit layer holds what runs in about a second without a lab or a playbook.
UNIT_TEST_SECONDS = 1.0
# What a unit-layer test never starts (each costs a second or more of CPU, or boots something).
HEAVY_PROGRAMS = frozenset(
    {
        "ansible",
        "ansible-playbook",
        "ansible-inventory",
        "ansible-galaxy",
        "ansible-doc",
        "ansible-lint",
        "molecule",
        "packer",
        "gpuforge-lab",
        "systemd-nspawn",
        "debootstrap",
    }
)
# Seconds assumed for a test or phase the record does not name: long, so it starts early and
# never joins the unit layer unmeasured.
UNKNOWN_TEST_SECONDS = 30.0
UNKNOWN_PHASE_SECONDS = 900.0

# The layers a pytest run can be limited to (GPUFORGE_TEST_LAYER): tests/timing_plugin.py.
LAYERS = ("unit", "rest")


@dataclass(frozen=True)
class TestTiming:
    """One test as measured: `seconds` as if it ran alone (every fixture it uses counted in full:
    what the unit layer is judged by), the programs it and its fixtures started, and `wall`, what it
    took in the measured run (a shared fixture counted once: what a shard's time adds up to)."""

    seconds: float
    started: frozenset[str] = frozenset()
    wall: float | None = None

    @property
    def in_run(self) -> float:
        return self.seconds if self.wall is None else self.wall


@dataclass
class Record:
    phases: dict[str, float] = field(default_factory=dict)
    tests: dict[str, TestTiming] = field(default_factory=dict)
    measured: dict[str, str] = field(default_factory=dict)

    def phase_seconds(self, name: str) -> float:
        return self.phases.get(name, UNKNOWN_PHASE_SECONDS)

    def test_seconds(self, test_id: str) -> float:
        timing = self.tests.get(test_id)
        return UNKNOWN_TEST_SECONDS if timing is None else timing.seconds

    def in_unit_layer(self, test_id: str) -> bool:
        """Recorded, at most UNIT_TEST_SECONDS, and started none of HEAVY_PROGRAMS."""
        timing = self.tests.get(test_id)
        return (
            timing is not None
            and timing.seconds <= UNIT_TEST_SECONDS
            and not (timing.started & HEAVY_PROGRAMS)
        )

    def module_seconds(self, module: str, layer: str) -> float:
        """Recorded seconds of a module's tests in a layer (`unit`, `rest`); an unrecorded module is long."""
        prefix = f"{module}::"
        ids = [t for t in self.tests if t.startswith(prefix)]
        if not ids:
            return UNKNOWN_TEST_SECONDS if layer == "rest" else 0.0
        return sum(self.tests[t].in_run for t in ids if self.in_unit_layer(t) == (layer == "unit"))


def load(path: Path = RECORD) -> Record:
    """The committed record; an absent or unreadable one is empty (everything long)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return Record()
    tests = {
        test_id: TestTiming(
            float(entry[0]),
            frozenset(entry[1].split(",")) if entry[1] else frozenset(),
            float(entry[2]) if len(entry) > 2 else None,
        )
        for test_id, entry in data.get("tests", {}).items()
    }
    return Record(
        phases={k: float(v) for k, v in data.get("phases", {}).items()},
        tests=tests,
        measured=dict(data.get("measured", {})),
    )


def read_test_log(lines: Iterable[str]) -> dict[str, TestTiming]:
    """The per-test JSON lines tests/timing_plugin.py writes, as timings (a repeated id: the last)."""
    tests: dict[str, TestTiming] = {}
    for line in lines:
        if not line.strip():
            continue
        entry = json.loads(line)
        wall = entry.get("wall")
        tests[entry["id"]] = TestTiming(
            float(entry["seconds"]),
            frozenset(entry.get("started", {})),
            None if wall is None else float(wall),
        )
    return tests


def _entry(timing: TestTiming) -> list[float | str]:
    entry: list[float | str] = [round(timing.seconds, 2), ",".join(sorted(timing.started))]
    if timing.wall is not None and round(timing.wall, 2) != entry[0]:
        entry.append(round(timing.wall, 2))
    return entry


def dump(phases: Mapping[str, float], tests: Mapping[str, TestTiming], measured: Mapping[str, str]) -> str:
    """The record's text: sorted, one test a line, so a refresh diffs line by line."""
    lines = ["{", f'  "measured": {json.dumps(dict(sorted(measured.items())))},']
    lines.append(f'  "phases": {json.dumps({k: round(v, 1) for k, v in sorted(phases.items())})},')
    lines.append('  "tests": {')
    entries = [f"    {json.dumps(test_id)}: {json.dumps(_entry(t))}" for test_id, t in sorted(tests.items())]
    lines.append(",\n".join(entries))
    lines += ["  }", "}", ""]
    return "\n".join(lines)
