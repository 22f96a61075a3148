"""The acceptance test's decisions, with no I/O: which nodes to test together, who is to blame, when to stop.

The stages follow the field guide: every node alone, then disjoint pairs, then doubling (2, 4, 8 ... N)
against the 90%-of-baseline rule. What runs a test is a `Tester` handed in (Slurm on a cluster, a model
of one in the tests), so the whole sequence of decisions is the same code in both.

Pairs. Round 1 splits the nodes that passed alone into disjoint pairs. A node is named (and
drained) on evidence that survives a flapping partner: it failed with two different nodes, each of
which passed with a third node after that failure and failed with nobody else who is not named (a
*witness*), and it never passed a pair test itself. Every node of a failing pair, the odd node out,
and any reference that took part in a failure are re-tested, all at once, each with a reference (a
node that passed and has no unexplained failure) it has not failed with; where no reference is
left, suspects are paired among themselves with partners they have not failed with (a shifted
pairing), so that a passing pair makes references. With enough references (fewer than about a
quarter of the nodes bad) a bad node whose round-1 partner is good is named in three rounds: round
1, its re-test with a reference (while its partner passes with another), and the reference's own
re-test; four when both nodes of a round-1 pair are bad or a reference flaps. A node that both
passed and failed with nodes that work (a flapping node), or that is still unexplained after
RETESTS re-tests, or that could never be tested in a pair, is *unresolved*: named, not drained, and
the cluster is not accepted. A node is never accepted without a passing pair test.

Doubling. The nodes left after the pairs run at 2, 4, 8 ... and finally all of them; each step is
judged against the baseline for its node count, and the first step below its gate stops the doubling
and is named with its figure. Nodes are not blamed for a step: every one of them passed its pairs.
"""

from __future__ import annotations

import enum
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
# Re-tests after round 1 before a suspect nobody could name is left unresolved.
RETESTS = 3
NO_PAIR = "no other node passed alone to pair it with: not tested in a pair"


@dataclass(frozen=True)
class Result:
    """One judged test: did it pass, and the figure that says why (busbw against the gate, a failed check)."""

    passed: bool
    figure: str
    busbw_gb_s: float | None = None
    expected_gb_s: float | None = None
    # False when nothing could be compared (no baseline): not a failure, never counted as a pass.
    judged: bool = True
    # False when the test itself did not run to a verdict (its srun failed or hit the time limit): the
    # node is unresolved, never drained on it.
    resolved: bool = True


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
    """The pair stage's state: every pair test so far, re-read after each round (module docstring)."""

    nodes: list[str]
    tests: list[PairTest] = field(default_factory=list)
    bad: dict[str, str] = field(default_factory=dict)
    unresolved: dict[str, str] = field(default_factory=dict)
    rounds: int = 0
    _passed_with: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    _failed_with: dict[str, list[tuple[str, PairTest]]] = field(default_factory=dict)
    _retests: dict[str, int] = field(default_factory=dict)
    # Culprits: named nodes and intermittent ones with two witnesses (their failures explain their
    # partners').
    _evident: set[str] = field(default_factory=set)

    def first_round(self) -> list[Pair]:
        pairs, _left = disjoint_pairs(self.nodes)
        return pairs

    def record(self, results: Mapping[Pair, Result], purpose: str) -> None:
        self.rounds += 1
        for pair, result in results.items():
            test = PairTest(self.rounds, pair, result, purpose)
            self.tests.append(test)
            for node, partner in ((pair[0], pair[1]), (pair[1], pair[0])):
                if purpose != "round 1":
                    self._retests[node] = self._retests.get(node, 0) + 1
                if result.passed:
                    self._passed_with.setdefault(node, []).append((partner, self.rounds))
                else:
                    self._failed_with.setdefault(node, []).append((partner, test))
        self._name()
        self._give_up()

    def _culprits(self) -> set[str]:
        """Named nodes and intermittent ones with two witnesses: their failures explain their partners'."""
        return self._evident

    def _witnesses(self, node: str) -> list[tuple[str, PairTest]]:
        """Partners the node failed with that passed with another node after that failure, and that failed
        with no other node that is not a culprit: evidence that the node, not the partner, is at fault."""
        culprits = self._culprits()
        out: dict[str, PairTest] = {}
        for partner, test in self._failed_with.get(node, []):
            if partner in culprits or partner in out:
                continue
            # A pass before the failure proves nothing: a flapping reference passes, then fails.
            vouched = self._passed_after(partner, test, exclude=node)
            clean = all(p == node or p in culprits for p, _t in self._failed_with.get(partner, []))
            if vouched and clean:
                out[partner] = test
        return list(out.items())

    def _passed_after(self, node: str, test: PairTest, exclude: str = "") -> set[str]:
        return {p for p, r in self._passed_with.get(node, []) if r > test.round and p != exclude}

    def _name(self) -> None:
        """Name every node with two witnesses, until naming one explains no further failure: drained
        when it never passed a pair test, else intermittent (unresolved, and its partners explained)."""
        changed = True
        while changed:
            changed = False
            for node in self.nodes:
                if node in self.bad or node in self._evident:
                    continue
                witnesses = self._witnesses(node)
                if len(witnesses) < 2:
                    continue
                figures = "; ".join(f"round {t.round} with {p}: {t.result.figure}" for p, t in witnesses[:2])
                passed = sorted({p for p, _r in self._passed_with.get(node, [])}, key=natural)
                if passed:
                    self._evident.add(node)
                    self.unresolved[node] = f"{figures}; but passed with {', '.join(passed)}: intermittent"
                else:
                    self.bad[node] = figures
                    self._evident.add(node)
                    self.unresolved.pop(node, None)
                changed = True

    def _unexplained(self, node: str) -> list[tuple[str, PairTest]]:
        culprits = self._culprits()
        return [(p, t) for p, t in self._failed_with.get(node, []) if p not in culprits]

    def unexplained(self, node: str) -> list[str]:
        """The partners of the node's failures that no culprit explains."""
        return sorted({p for p, _t in self._unexplained(node)}, key=natural)

    def _needs_test(self, node: str) -> bool:
        """A pass after each unexplained failure (to vouch against its partner), or a second one where
        the partner passed after it too and failed with nobody else (a failure that did not come back)."""
        if node not in self._passed_with and node not in self._failed_with:
            return True
        for partner, test in self._unexplained(node):
            after = self._passed_after(node, test)
            if not after:
                return True
            if self._passed_after(partner, test) and len(after) < 2 and self._alone_failure(partner, node):
                return True
        return False

    def _alone_failure(self, partner: str, node: str) -> bool:
        culprits = self._culprits()
        return all(p == node or p in culprits for p, _t in self._failed_with.get(partner, []))

    def _give_up(self) -> None:
        for node in self.nodes:
            if node in self.bad or node in self.unresolved:
                continue
            failed = self._unexplained(node)
            if not failed:
                continue
            partners = ", ".join(self.unexplained(node))
            if all(
                len(self._passed_after(node, t)) >= 2
                and self._passed_after(p, t)
                and self._alone_failure(p, node)
                for p, t in failed
            ):
                self.unresolved[node] = (
                    f"failed with {partners}, then passed twice while it passed too: intermittent, "
                    "not pinned on a node"
                )
            elif self._retests.get(node, 0) >= RETESTS and self._needs_test(node):
                self.unresolved[node] = (
                    f"failed with {partners}; {RETESTS} re-tests did not name it or a partner"
                )

    def finish(self) -> None:
        """After the last round: a failure still unexplained leaves both its nodes unresolved."""
        for node in self.nodes:
            if node not in self.bad and node not in self.unresolved and self._unexplained(node):
                self.unresolved[node] = (
                    f"failed with {', '.join(self.unexplained(node))}, not pinned on a node"
                )

    def _pending(self) -> list[str]:
        """Nodes to test in the next round: never in a pair test, or without the passes _needs_test asks."""
        out = [
            n for n in self.nodes if n not in self.bad and n not in self.unresolved and self._needs_test(n)
        ]
        # Those that never passed first: they are the suspects; a reference that took part in a
        # failure only needs a pass again to vouch for its partner's guilt.
        return sorted(out, key=lambda n: (bool(self._passed_with.get(n)), natural(n)))

    def _trusted(self, pending: Sequence[str]) -> list[str]:
        """References: passed a pair test, with no unexplained failure."""
        waiting = set(pending)
        return [
            n
            for n in self.nodes
            if n not in waiting
            and n not in self.bad
            and n not in self.unresolved
            and n in self._passed_with
            and not self._unexplained(n)
        ]

    def _failed_together(self, a: str, b: str) -> bool:
        return any(p == b for p, _t in self._failed_with.get(a, []))

    def _partner(self, node: str, candidates: Sequence[str], used: set[str]) -> str | None:
        """A candidate the node has not been tested with, else one it passed with (a re-test that
        vouches for it again), never one it failed with."""
        free = [c for c in candidates if c != node and c not in used and not self._failed_together(node, c)]
        passed = {p for p, _r in self._passed_with.get(node, [])}
        return next((c for c in free if c not in passed), next(iter(free), None))

    def next_round(self) -> tuple[list[Pair], str]:
        """The next round's pairs (suspect, partner) and their purpose; [] when done."""
        pending = self._pending()
        if not pending:
            return [], ""
        references = self._trusted(pending)
        load = {r: len(self._passed_with.get(r, [])) + len(self._failed_with.get(r, [])) for r in references}
        references.sort(key=lambda r: (load[r], natural(r)))
        used: set[str] = set()
        pairs: list[Pair] = []
        for suspect in pending:
            partner = self._partner(suspect, references, used | {suspect})
            if partner is not None:
                used.update((suspect, partner))
                pairs.append((suspect, partner))
        purpose = "isolate" if pairs else "re-pair"
        # Suspects no reference is left for: paired among themselves (a shifted pairing: never the
        # partner they failed with), so that a passing pair makes references where none passed round 1.
        # Nodes waiting on a partner's verdict first: they passed after their failure.
        waiting = [
            n
            for n in self.nodes
            if n not in self.bad
            and n not in self.unresolved
            and n not in pending
            and self._passed_with.get(n)
        ]
        others = [*waiting, *pending]
        for suspect in pending:
            if suspect in used:
                continue
            partner = self._partner(suspect, others, used)
            if partner is not None:
                used.update((suspect, partner))
                pairs.append((suspect, partner))
        if not pairs:
            for node in pending:
                failed = self.unexplained(node)
                partners = ", ".join(sorted(set(failed), key=natural))
                self.unresolved[node] = (
                    f"failed with {partners}; no other node to test it with" if failed else NO_PAIR
                )
        return pairs, purpose

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
    # Pass pair and doubling results that had no baseline to compare with (--accept-unjudged).
    accept_unjudged: bool = False

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
    def unjudged_multi(self) -> list[str]:
        """Pair and doubling results that passed only for want of a baseline: the cluster is not accepted
        on them (unless accept_unjudged); the node stage's NVLink check has its relative check instead."""
        out = [
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
    def passed_all(self) -> bool:
        """Every node that could be tested passed every stage, and no doubling step fell short."""
        tested = [v for v in self.verdicts.values() if v.status is not NodeStatus.NOT_TESTED]
        return bool(tested) and all(v.status is NodeStatus.ACCEPTED for v in tested) and not self.failed_steps

    @property
    def accepted(self) -> bool:
        """passed_all, with every pair and doubling step judged against a baseline (or accept_unjudged)."""
        return self.passed_all and (self.accept_unjudged or not self.unjudged_multi)

    @property
    def to_drain(self) -> list[NodeVerdict]:
        return [v for v in self.verdicts.values() if v.status is NodeStatus.FAILED]


Progress = Callable[[str], None]


def run(
    nodes: Sequence[str],
    tester: Tester,
    not_tested: Mapping[str, str] | None = None,
    progress: Progress | None = None,
    accept_unjudged: bool = False,
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
            search.finish()
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
    return Acceptance(ordered, dict(not_tested or {}), alone, search, steps, verdicts, accept_unjudged)


def _verdicts(
    nodes: list[str], not_tested: dict[str, str], alone: dict[str, Result], search: PairSearch
) -> dict[str, NodeVerdict]:
    out = {n: NodeVerdict(n, NodeStatus.NOT_TESTED, "", why) for n, why in sorted(not_tested.items())}
    for node in nodes:
        if not alone[node].passed:
            status = NodeStatus.FAILED if alone[node].resolved else NodeStatus.UNRESOLVED
            out[node] = NodeVerdict(node, status, STAGE_NODE, alone[node].figure)
        elif node in search.bad:
            out[node] = NodeVerdict(node, NodeStatus.FAILED, STAGE_PAIRS, search.bad[node])
        elif node in search.unresolved:
            out[node] = NodeVerdict(node, NodeStatus.UNRESOLVED, STAGE_PAIRS, search.unresolved[node])
        else:
            out[node] = NodeVerdict(node, NodeStatus.ACCEPTED)
    return out


@dataclass(frozen=True)
class Projection:
    """The stages' wall time before they start, at most: one node stage, 1 + RETESTS pair rounds,
    log2(N) doubling steps."""

    nodes: int
    node_stage_s: float
    pair_round_s: float
    step_s: float

    @property
    def steps(self) -> int:
        return len(doubling_sizes(self.nodes))

    @property
    def pair_rounds(self) -> int:
        """Round 1 and at most RETESTS re-test rounds (while references suffice): the bound, not the
        healthy case's one round."""
        return 1 + RETESTS if self.nodes >= 2 else 0

    @property
    def total_s(self) -> float:
        return self.node_stage_s + self.pair_rounds * self.pair_round_s + self.steps * self.step_s

    def describe(self) -> str:
        minutes = self.total_s / 60
        return (
            f"projected wall time for {self.nodes} nodes: at most about {minutes:.0f} min "
            f"(node stage {self.node_stage_s / 60:.0f} min + {self.pair_rounds} pair rounds x "
            f"{self.pair_round_s / 60:.0f} min + {self.steps} doubling steps x {self.step_s / 60:.0f} min; "
            "one pair round when every pair passes; more waves if over a quarter of the nodes fail pairs)"
        )
