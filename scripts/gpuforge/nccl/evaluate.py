"""Judge a parsed all_reduce_perf run against the expected peak bus bandwidth of its instance type."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gpuforge import instance_types
from gpuforge.errors import UserError
from gpuforge.nccl.parse import Run

# The seed rule from the issue: below 90% of the expected peak, something is wrong.
THRESHOLD = 0.90
# "Large message" means at least 1 GiB: by then per-call latency is negligible and busbw plateaus.
LARGE_MESSAGE_BYTES = 1 << 30


class Verdict(enum.StrEnum):
    PASS = "PASS"  # noqa: S105 (a verdict, not a password)
    FAIL = "FAIL"
    # Not judged: the run cannot say anything about the network the peak describes.
    SKIP = "SKIP"


@dataclass(frozen=True)
class Evaluation:
    run: Run
    instance_type: str
    peak_gb_s: float
    threshold: float
    large_bytes: int
    large_busbw_gb_s: float | None
    verdict: Verdict
    reasons: tuple[str, ...]

    @property
    def ratio(self) -> float | None:
        return None if self.large_busbw_gb_s is None else self.large_busbw_gb_s / self.peak_gb_s


def expected_peak(instance_type: str) -> float:
    """nccl_allreduce_busbw_gb_s from data/instance_types.yml; UserError when the type has none."""
    facts = instance_types.get(instance_type)
    if facts.nccl_allreduce_busbw_gb_s is None:
        raise UserError(
            f"{instance_type} has no nccl_allreduce_busbw_gb_s in data/instance_types.yml; "
            "add the expected peak (GB/s) for it"
        )
    return float(facts.nccl_allreduce_busbw_gb_s)


def large_message_busbw(run: Run, large_bytes: int = LARGE_MESSAGE_BYTES) -> float | None:
    """The best busbw (out-of-place or in-place) among rows of at least large_bytes, if any."""
    values = [r.busbw_gb_s for r in run.rows if r.size_bytes >= large_bytes]
    return max(values) if values else None


def evaluate(
    run: Run,
    instance_type: str,
    peak_gb_s: float,
    threshold: float = THRESHOLD,
    large_bytes: int = LARGE_MESSAGE_BYTES,
) -> Evaluation:
    if peak_gb_s <= 0:
        raise UserError(f"expected peak must be positive, got {peak_gb_s}")
    if not 0 < threshold <= 1:
        raise UserError(f"threshold must be in (0, 1], got {threshold}")
    busbw = large_message_busbw(run, large_bytes)
    reasons: list[str] = []
    # "corrupt" covers every defect that fails a run whatever its bandwidth.
    corrupt = bool(run.wrong_rows) or (run.out_of_bounds or 0) > 0
    if corrupt:
        sizes = ", ".join(str(r.size_bytes) for r in run.wrong_rows) or "?"
        reasons.append(f"data check failed (#wrong > 0 at sizes {sizes}): results are corrupt")
    if run.avg_busbw_gb_s is None:
        corrupt = True
        reasons.append("no '# Avg bus bandwidth' summary: the run did not finish (killed, timed out or cut)")
    if len(run.hosts) == 1:
        # One node exercises NVLink/PCIe only; the peak describes the inter-node network.
        reasons.append(f"single-node run on {run.hosts[0]} measures NVLink/PCIe, not EFA; use 2+ nodes")
        return Evaluation(
            run,
            instance_type,
            peak_gb_s,
            threshold,
            large_bytes,
            busbw,
            Verdict.FAIL if corrupt else Verdict.SKIP,
            tuple(reasons),
        )
    verdict = Verdict.FAIL if corrupt else Verdict.PASS
    if busbw is None:
        largest = max(r.size_bytes for r in run.rows)
        verdict = Verdict.FAIL
        reasons.append(
            f"no message of {large_bytes} bytes or more (largest {largest}); run with -e 1G or more"
        )
    else:
        share = f"large-message busbw {busbw:.2f} GB/s is {busbw / peak_gb_s:.0%} of {peak_gb_s:g} GB/s"
        if busbw < threshold * peak_gb_s:
            verdict = Verdict.FAIL
            reasons.append(f"{share} expected for {instance_type}, below {threshold:.0%}")
        else:
            reasons.append(share)
    return Evaluation(run, instance_type, peak_gb_s, threshold, large_bytes, busbw, verdict, tuple(reasons))
