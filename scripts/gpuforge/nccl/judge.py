"""One verdict for one nccl-tests job log: what `gpuforge accept` and the image canary both decide.

A log is judged run by run with evaluate() (data check, completeness, the network NCCL used, busbw
against the baseline for the type, collective and node count). The job fails when any run fails,
when the launcher exited non-zero, or when the log holds no result table at all (the job died
before its first size); it passes only when every run was compared with a baseline and reached
the gate; otherwise it is SKIP: reported, never counted as a pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuforge.errors import UserError
from gpuforge.nccl.evaluate import Evaluation, Settings, Verdict, evaluate
from gpuforge.nccl.parse import parse


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    # Why it is not a PASS: one line per failed or unjudged run, and the launcher's exit status.
    reasons: tuple[str, ...]
    evaluations: tuple[Evaluation, ...]

    @property
    def busbw_gb_s(self) -> float | None:
        """The lowest judged busbw of the log's runs (the figure a gate is decided on)."""
        figures = [ev.busbw_gb_s for ev in self.evaluations if ev.busbw_gb_s is not None]
        return min(figures) if figures else None

    @property
    def expected_gb_s(self) -> float | None:
        figures = [ev.expected_gb_s for ev in self.evaluations if ev.expected_gb_s is not None]
        return min(figures) if figures else None

    @property
    def figure(self) -> str:
        """The judgement in one line: the bandwidth against its baseline, or the first reason."""
        busbw, expected = self.busbw_gb_s, self.expected_gb_s
        if self.verdict is Verdict.PASS and busbw is not None and expected is not None:
            return f"busbw {busbw:.2f} GB/s, {busbw / expected:.0%} of {expected:g} GB/s"
        return self.reasons[0] if self.reasons else self.verdict.value


def judge_log(log: str, config: Settings, source: str, rc: int | None, launcher: str) -> Judgement:
    """The verdict on one job's all_reduce log; `rc` is the launcher's exit status (None: unknown)."""
    exited = [] if rc in (0, None) else [f"{launcher} exited {rc}"]
    if not log.strip():
        return Judgement(Verdict.FAIL, (f"{config.collective or 'nccl-tests'} printed nothing", *exited), ())
    try:
        runs = parse(log, source=source)
    except UserError:
        return Judgement(Verdict.FAIL, ("nccl-tests log has no result table", *exited), ())
    evaluations = tuple(evaluate(run, config) for run in runs)
    reasons = [
        f"{ev.identity.label} {ev.verdict.value}: {'; '.join(ev.failures or ev.reasons)}"
        for ev in evaluations
        if ev.verdict is not Verdict.PASS
    ]
    reasons += exited
    if exited or any(ev.verdict is Verdict.FAIL for ev in evaluations):
        verdict = Verdict.FAIL
    elif all(ev.verdict is Verdict.PASS for ev in evaluations):
        verdict = Verdict.PASS
    else:
        verdict = Verdict.SKIP
    return Judgement(verdict, tuple(reasons), evaluations)
