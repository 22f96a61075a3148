"""One preflight result row and the pass/fail table printed for a list of them."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Status(enum.StrEnum):
    PASS = "PASS"  # noqa: S105 (a status name, not a password)
    FAIL = "FAIL"
    # SKIP means "could not be judged" (no API, nothing to check); it never counts as a pass.
    SKIP = "SKIP"


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    detail: str


def passed(name: str, detail: str) -> CheckResult:
    return CheckResult(name, Status.PASS, detail)


def failed(name: str, detail: str) -> CheckResult:
    return CheckResult(name, Status.FAIL, detail)


def skipped(name: str, detail: str) -> CheckResult:
    return CheckResult(name, Status.SKIP, detail)


def any_failed(results: Sequence[CheckResult]) -> bool:
    return any(r.status is Status.FAIL for r in results)


def render_table(results: Sequence[CheckResult]) -> str:
    """A fixed-width table, one row per check, and a summary line."""
    headers = ("CHECK", "STATUS", "DETAIL")
    name_w = max([len(headers[0]), *(len(r.name) for r in results)])
    status_w = max(len(headers[1]), *(len(s.value) for s in Status))
    lines = [f"{headers[0]:<{name_w}}  {headers[1]:<{status_w}}  {headers[2]}"]
    lines.append(f"{'-' * name_w}  {'-' * status_w}  {'-' * 6}")
    lines.extend(f"{r.name:<{name_w}}  {r.status.value:<{status_w}}  {r.detail}" for r in results)
    counts = {s: sum(1 for r in results if r.status is s) for s in Status}
    verdict = "FAILED" if counts[Status.FAIL] else "PASSED"
    lines.append("")
    lines.append(
        f"preflight {verdict}: {counts[Status.PASS]} passed, {counts[Status.FAIL]} failed, "
        f"{counts[Status.SKIP]} skipped"
    )
    return "\n".join(lines)
