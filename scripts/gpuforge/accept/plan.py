"""The acceptance test's decisions, with no I/O: which nodes to test together, who is to blame, when to stop.

The stages follow the field guide: every node alone, then disjoint pairs, then doubling (2, 4, 8 ... N)
against the 90%-of-baseline rule. What runs a test is a `Tester` handed in (Slurm on a cluster, a model
of one in the tests), so the whole sequence of decisions is the same code in both.

Pairs. Round 1 splits the nodes that passed alone into disjoint pairs. A node in a passing pair is a
reference. Each node of a failing pair (and an odd node left over) is then tested with a distinct
reference, all at once: failing with a reference names the node, passing clears it. So a bad node is
named in two rounds, whatever the cluster's size, as long as there are at least as many references
as nodes to test (true while fewer than a quarter of the nodes are bad); with fewer references the
second round runs in waves of as many pairs as there are references. A failing pair whose nodes both
pass with references (the failure did not come back: a flapping node) is tested once more, each node
with another reference; a node that fails then is named, and two that pass again are reported as
unresolved: named, not drained, and the cluster is not accepted. Where no pair passed at all there is
no reference, and every node of a failing pair is unresolved.

Doubling. The nodes left after the pairs run at 2, 4, 8 ... and finally all of them; each step is
judged against the baseline for its node count, and the first step below its gate stops the doubling
and is named with its figure. Nodes are not blamed for a step: every one of them passed its pairs.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

Pair = tuple[str, str]

STAGE_NODE = "node"
STAGE_PAIRS = "pairs"
STAGE_DOUBLING = "doubling"
# Slurm keeps a node's reason as given; a short one still fits `sinfo -R`'s column and ParallelCluster's logs.
REASON_LIMIT = 200
LEFT_OVER = "the odd one out of round 1"


@dataclass(frozen=True)
class Result:
    """One judged test: did it pass, and the figure that says why (busbw against the gate, a failed check)."""

    passed: bool
    figure: str
    busbw_gb_s: float | None = None
    expected_gb_s: float | None = None
    # False when nothing could be compared (no baseline): not a failure, never counted as a pass.
    judged: bool = True


class Tester(Protocol):
    """What runs the tests: each call runs its tests at once and returns when all have finished."""

    def nodes_alone(self, nodes: Sequence[str]) -> Mapping[str, Result]: ...

    def pairs(self, pairs: Sequence[Pair]) -> Mapping[Pair, Result]: ...

    def step(self, nodes: Sequence[str]) -> Result: ...


def natural(name: str) -> tuple[str | int, ...]:
    """Sort key that puts gpu-st-p5-2 before gpu-st-p5-10, as Slurm lists nodes."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def disjoint_pairs(nodes: Sequence[str]) -> tuple[list[Pair], list[str]]:
    """Neighbours in the given order as pairs, and the odd node left over (if any)."""
    pairs = [(nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)]
    return pairs, list(nodes[len(pairs) * 2 :])


def doubling_sizes(count: int) -> list[int]:
    """2, 4, 8 ... below count, then count itself: log2(count) steps, rounded up."""
    if count < 2:
        return []
    sizes = []
    size = 2
    while size < count:
        sizes.append(size)
        size *= 2
    return [*sizes, count]


def isolation_rounds(to_test: int, references: int) -> int:
    """Rounds needed to test each of `to_test` nodes with a distinct reference per round."""
    return 0 if to_test == 0 or references == 0 else math.ceil(to_test / references)


class NodeStatus(enum.StrEnum):
    ACCEPTED = "accepted"
    FAILED = "failed"
    # A failure nobody could pin on a node: named, never drained; the cluster is not accepted.
    UNRESOLVED = "unresolved"
    NOT_TESTED = "not tested"


@dataclass
class NodeVerdict:
    node: str
    status: NodeStatus
    stage: str = ""
    figure: str = ""

    @property
    def drain_reason(self) -> str:
        reason = f"gpuforge accept {self.stage}: {self.figure}"
        return reason if len(reason) <= REASON_LIMIT else reason[: REASON_LIMIT - 3] + "..."


@dataclass
class PairTest:
    """One pair test of the pair stage, as the report shows it."""

    round: int
    pair: Pair
    result: Result
    # Why these two were paired: "round 1", "isolate", "confirm".
    purpose: str


@dataclass
class PairSearch:
    """The pair stage's state: rounds run, references, suspects, and the nodes named."""

    nodes: list[str]
    tests: list[PairTest] = field(default_factory=list)
    references: list[str] = field(default_factory=list)
    bad: dict[str, str] = field(default_factory=dict)
    unresolved: dict[str, str] = field(default_factory=dict)
    # Node -> why it still needs a test with a reference.
    pending: dict[str, str] = field(default_factory=dict)
    confirmed: set[str] = field(default_factory=set)
    # Suspects that passed with a reference while their round-1 failure is not yet explained.
    cleared: set[str] = field(default_factory=set)
    # Nodes that failed nothing but had no partner: the odd one out with no reference to pair it with.
    unpaired: dict[str, str] = field(default_factory=dict)
    rounds: int = 0

    def first_round(self) -> list[Pair]:
        pairs, left = disjoint_pairs(self.nodes)
        for node in left:
            self.pending[node] = LEFT_OVER
        return pairs

    def record(self, results: Mapping[Pair, Result], purpose: str) -> None:
        self.rounds += 1
        for pair, result in results.items():
            self.tests.append(PairTest(self.rounds, pair, result, purpose))
            if purpose == "round 1":
                self._first(pair, result)
            else:
                self._isolate(pair, result, purpose)
        if not self.pending:
            self._unexplained()

    def _first(self, pair: Pair, result: Result) -> None:
        a, b = pair
        if result.passed:
            self.references += [a, b]
            return
        for node, partner in ((a, b), (b, a)):
            self.pending[node] = f"round 1 with {partner}: {result.figure}"

    def _isolate(self, pair: Pair, result: Result, purpose: str) -> None:
        suspect, reference = pair
        why = self.pending.pop(suspect)
        if not result.passed:
            self.bad[suspect] = f"{why}; round {self.rounds} ({purpose}) with {reference}: {result.figure}"
        elif why == LEFT_OVER:
            self.references.append(suspect)
        else:
            # Not a reference yet: its own failure is explained only once its partner is named.
            self.cleared.add(suspect)

    def _unexplained(self) -> None:
        """Round-1 failures: explained by a named node, else confirmed once, then left unresolved."""
        for test in self.tests:
            if test.purpose != "round 1" or test.result.passed:
                continue
            a, b = test.pair
            explained = a in self.bad or b in self.bad
            for node, partner in ((a, b), (b, a)):
                if node not in self.cleared:
                    continue
                self.cleared.discard(node)
                if explained:
                    self.references.append(node)
                elif node in self.confirmed:
                    self.unresolved[node] = (
                        f"failed once with {partner} ({test.result.figure}), then passed twice with "
                        "nodes that passed their own pairs: intermittent"
                    )
                else:
                    self.confirmed.add(node)
                    self.pending[node] = f"round 1 with {partner}, not reproduced: {test.result.figure}"

    def next_round(self) -> tuple[list[Pair], str]:
        """The next isolation round's pairs (suspect, reference) and their purpose; [] when done."""
        if not self.pending:
            return [], ""
        usable = [
            r
            for r in self.references
            if r not in self.bad and r not in self.pending and r not in self.unresolved
        ]
        if not usable:
            for node, why in self.pending.items():
                if why == LEFT_OVER:
                    self.unpaired[node] = "no other node passed alone: not tested in a pair"
                else:
                    self.unresolved[node] = f"{why}; no node passed a pair to test it against"
            self.pending.clear()
            return [], ""
        # The least used references first, so that no reference carries every suspect.
        load = {r: sum(1 for t in self.tests if r in t.pair) for r in usable}
        usable.sort(key=lambda r: (load[r], natural(r)))
        suspects = sorted(self.pending, key=natural)[: len(usable)]
        purpose = "confirm" if all(s in self.confirmed for s in suspects) else "isolate"
        return list(zip(suspects, usable, strict=False)), purpose

    @property
    def passed(self) -> list[str]:
        return [n for n in self.nodes if n not in self.bad and n not in self.unresolved]


@dataclass
class Step:
    size: int
    nodes: list[str]
    result: Result | None  # None: not run (an earlier step fell short)


@dataclass
class Acceptance:
    """Everything the stages decided, for the verdict and the report."""

    nodes: list[str]
    not_tested: dict[str, str]
    alone: dict[str, Result]
    search: PairSearch
    steps: list[Step]
    verdicts: dict[str, NodeVerdict]

    @property
    def failed_steps(self) -> list[Step]:
        return [s for s in self.steps if s.result is not None and not s.result.passed]

    @property
    def unjudged(self) -> list[str]:
        """Tests that ran without a baseline to compare with: reported, never counted as a pass."""
        out = [f"{n} alone: {r.figure}" for n, r in self.alone.items() if r.passed and not r.judged]
        out += [
            f"pair {' + '.join(t.pair)}: {t.result.figure}"
            for t in self.search.tests
            if t.result.passed and not t.result.judged
        ]
        out += [
            f"{s.size} nodes: {s.result.figure}"
            for s in self.steps
            if s.result is not None and s.result.passed and not s.result.judged
        ]
        return out

    @property
    def accepted(self) -> bool:
        """Every node that could be tested passed every stage, and every doubling step reached its gate."""
        tested = [v for v in self.verdicts.values() if v.status is not NodeStatus.NOT_TESTED]
        return bool(tested) and all(v.status is NodeStatus.ACCEPTED for v in tested) and not self.failed_steps

    @property
    def to_drain(self) -> list[NodeVerdict]:
        return [v for v in self.verdicts.values() if v.status is NodeStatus.FAILED]


Progress = Callable[[str], None]


def run(
    nodes: Sequence[str],
    tester: Tester,
    not_tested: Mapping[str, str] | None = None,
    progress: Progress | None = None,
) -> Acceptance:
    """The three stages over `nodes` (those that can be tested), in the order and with the decisions above."""
    say = progress or (lambda _line: None)
    ordered = sorted(nodes, key=natural)
    say(f"stage 1/3: {len(ordered)} nodes alone")
    alone = dict(tester.nodes_alone(ordered)) if ordered else {}
    passed_alone = [n for n in ordered if alone[n].passed]
    search = PairSearch(passed_alone)
    pairs = search.first_round()
    if pairs:
        say(f"stage 2/3: pairs round 1: {len(pairs)} pairs")
        search.record(tester.pairs(pairs), "round 1")
    while True:
        pairs, purpose = search.next_round()
        if not pairs:
            break
        say(f"stage 2/3: pairs round {search.rounds + 1} ({purpose}): {len(pairs)} pairs")
        search.record(tester.pairs(pairs), purpose)
    good = search.passed
    steps: list[Step] = []
    stopped = False
    for size in doubling_sizes(len(good)):
        members = good[:size]
        if stopped:
            steps.append(Step(size, members, None))
            continue
        say(f"stage 3/3: doubling: {size} of {len(good)} nodes")
        result = tester.step(members)
        steps.append(Step(size, members, result))
        stopped = not result.passed
    verdicts = _verdicts(ordered, dict(not_tested or {}), alone, search)
    return Acceptance(ordered, dict(not_tested or {}), alone, search, steps, verdicts)


def _verdicts(
    nodes: list[str], not_tested: dict[str, str], alone: dict[str, Result], search: PairSearch
) -> dict[str, NodeVerdict]:
    out = {n: NodeVerdict(n, NodeStatus.NOT_TESTED, "", why) for n, why in sorted(not_tested.items())}
    for node in nodes:
        if not alone[node].passed:
            out[node] = NodeVerdict(node, NodeStatus.FAILED, STAGE_NODE, alone[node].figure)
        elif node in search.bad:
            out[node] = NodeVerdict(node, NodeStatus.FAILED, STAGE_PAIRS, search.bad[node])
        elif node in search.unresolved:
            out[node] = NodeVerdict(node, NodeStatus.UNRESOLVED, STAGE_PAIRS, search.unresolved[node])
        else:
            out[node] = NodeVerdict(node, NodeStatus.ACCEPTED, "", search.unpaired.get(node, ""))
    return out


@dataclass(frozen=True)
class Projection:
    """The stages' wall time before they start: one node stage, two pair rounds, log2(N) doubling steps."""

    nodes: int
    node_stage_s: float
    pair_round_s: float
    step_s: float

    @property
    def steps(self) -> int:
        return len(doubling_sizes(self.nodes))

    @property
    def pair_rounds(self) -> int:
        return 2 if self.nodes >= 2 else 0

    @property
    def total_s(self) -> float:
        return self.node_stage_s + self.pair_rounds * self.pair_round_s + self.steps * self.step_s

    def describe(self) -> str:
        minutes = self.total_s / 60
        return (
            f"projected wall time for {self.nodes} nodes: about {minutes:.0f} min "
            f"(node stage {self.node_stage_s / 60:.0f} min + {self.pair_rounds} pair rounds x "
            f"{self.pair_round_s / 60:.0f} min + {self.steps} doubling steps x {self.step_s / 60:.0f} min; "
            "a third pair round only if a failure does not reproduce)"
        )
