"""TEST DOUBLE for AWS Systems Manager Run Command: runs a Command document's script on lab hosts over SSH.

moto records SendCommand (document, targets, rate controls, output location) but runs nothing. This
stand-in runs what Run Command would run on each node: the document's aws:runShellScript commands with
the parameters checked and substituted as Systems Manager does (gpuforge.fleet.document.render), under
the same rate controls, as AWS's Run Command guide describes them ("Run commands at scale",
https://docs.aws.amazon.com/systems-manager/latest/userguide/send-commands-multiple.html):

- MaxConcurrency, a count or a percentage of the targets: the command goes to one node first and, once
  that invocation has ended, to two more, growing exponentially until MaxConcurrency nodes run it at once.
- MaxErrors, a count or a percentage of the targets: once more invocations have failed than MaxErrors
  allows, no further node gets the command; invocations already running finish (and may fail too).
  MaxErrors 0 stops after the first failure.
- Errors are Failed and TimedOut invocations (ssm service model, Command.ErrorCount); a node that cannot
  be reached is "Undeliverable" and not an error, as a delivery timeout is not.

AWS does not document how a percentage is rounded; this double takes at least one node for
concurrency (rounded up) and rounds the error budget down (the stricter reading). It is a test double
only: nothing in the shipped package imports it.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from gpuforge.fleet import document
from gpuforge.fleet.ssm import MAX_CONCURRENCY_PATTERN, MAX_ERRORS_PATTERN


@dataclass(frozen=True)
class Result:
    """One node's invocation: Success, Failed, TimedOut or Undeliverable, with its output."""

    target: str
    status: str
    output: str = ""


@dataclass
class Run:
    """The command's outcome: every invocation, the targets never sent to, the peak concurrency seen."""

    results: list[Result] = field(default_factory=list)
    not_sent: list[str] = field(default_factory=list)
    peak: int = 0
    waves: list[int] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return sum(r.status in {"Failed", "TimedOut"} for r in self.results)

    @property
    def status(self) -> str:
        return "Failed" if self.errors or self.not_sent else "Success"


def limit(value: str, total: int, *, errors: bool) -> int:
    """MaxConcurrency or MaxErrors as a number of nodes, for `total` targets."""
    pattern = MAX_ERRORS_PATTERN if errors else MAX_CONCURRENCY_PATTERN
    if not re.fullmatch(pattern, value):
        raise ValueError(f"{value!r} is not a valid {'MaxErrors' if errors else 'MaxConcurrency'}")
    if not value.endswith("%"):
        return int(value)
    share = int(value[:-1]) * total / 100
    return math.floor(share) if errors else max(1, math.ceil(share))


Runner = Callable[[str], Result]


def run(targets: Sequence[str], runner: Runner, max_concurrency: str, max_errors: str) -> Run:
    """Run `runner` on every target under Run Command's rate controls (see the module's docstring)."""
    cap = limit(max_concurrency, len(targets), errors=False)
    budget = limit(max_errors, len(targets), errors=True)
    pending = list(targets)
    outcome = Run()
    lock = threading.Lock()
    running: set[Future[Result]] = set()
    allowed = 1  # one node first, then growing
    with ThreadPoolExecutor(max_workers=max(1, cap)) as pool:
        while pending or running:
            stopped = outcome.errors > budget
            started = 0
            while pending and not stopped and len(running) < min(allowed, cap):
                running.add(pool.submit(runner, pending.pop(0)))
                started += 1
            if started:
                outcome.waves.append(started)
            with lock:
                outcome.peak = max(outcome.peak, len(running))
            if stopped:
                outcome.not_sent.extend(pending)
                pending.clear()
            if not running:
                break
            done, still = wait(running, return_when=FIRST_COMPLETED)
            running = set(still)
            for future in done:
                outcome.results.append(future.result())
            # After the first invocation ends, two nodes at once, then four...: the window doubles each
            # time invocations end, up to MaxConcurrency.
            allowed = min(cap, allowed * 2)
    return outcome


def document_runner(
    doc: document.Document, parameters: dict[str, str], execute: Callable[[str, str], tuple[int, str]]
) -> Runner:
    """A runner that renders the document once and hands the script to execute(target, script)."""
    script = document.render(doc, parameters)

    def one(target: str) -> Result:
        code, output = execute(target, script)
        if code == 255:
            return Result(target, "Undeliverable", output)
        return Result(target, "Success" if code == 0 else "Failed", output)

    return one
