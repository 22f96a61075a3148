"""Which collective a run measured: named by the log, or recognised from the table itself.

A log names it in nccl-tests' banner (`# Collective test starting: all_reduce_perf`, since
2.15) or in the command that launched it. Without either, the table still tells: nccl-tests
(src/*.cu, *GetBw) prints busbw = algbw * 2(n-1)/n for all_reduce only; all_gather,
reduce_scatter, alltoall, gather and scatter use (n-1)/n (below 1) and also print a per-rank
count (size = count * type size * n); broadcast/reduce have a root >= 0. So a busbw/algbw
ratio above 1 with size = count * type size and root -1 is an all_reduce; anything else that
the log does not name stays unknown and is never judged against the all_reduce expectation.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuforge.nccl.parse import Run

ALL_REDUCE = "all_reduce"

# nccl-tests src/common.cu test_typenames (and the pre-2.10 "char"/"int"), bytes per element.
TYPE_BYTES = {
    "int8": 1,
    "uint8": 1,
    "char": 1,
    "int32": 4,
    "uint32": 4,
    "int": 4,
    "int64": 8,
    "uint64": 8,
    "half": 2,
    "float": 4,
    "double": 8,
    "bfloat16": 2,
    "f8e4m3": 1,
    "f8e5m2": 1,
}


@dataclass(frozen=True)
class Identity:
    name: str | None
    how: str

    @property
    def label(self) -> str:
        return self.name or "unknown collective"


def identify(run: Run, stated: str | None = None) -> Identity:
    """The collective of a run and how it is known; `stated` is the operator's --collective."""
    if run.collective is not None:
        how = "banner" if run.collective_from == "banner" else "command line"
        if stated is not None and stated != run.collective:
            return Identity(run.collective, f"the log's {how} (overrides --collective {stated})")
        return Identity(run.collective, f"the log's {how}")
    if stated is not None:
        return Identity(stated, "--collective (the log does not name it)")
    return _infer(run)


def _infer(run: Run) -> Identity:
    rows = [r for r in run.rows if r.out_of_place.algbw_gb_s >= 1.0 and r.out_of_place.busbw_gb_s > 0]
    if not rows:
        return Identity(None, "not named in the log and too little bandwidth to recognise it")
    row = max(rows, key=lambda r: r.size_bytes)
    ratio = row.out_of_place.busbw_gb_s / row.out_of_place.algbw_gb_s
    if row.root is not None and row.root >= 0:
        return Identity(None, f"not named in the log; rooted (root {row.root}), so not all_reduce")
    width = TYPE_BYTES.get(row.dtype)
    per_rank_count = width is not None and row.size_bytes != row.count * width
    if ratio > 1.05 and not per_rank_count and row.redop not in ("", "none"):
        ranks = len(run.devices)
        if ranks and abs(ratio - 2 * (ranks - 1) / ranks) > 0.05:
            return Identity(
                None, f"not named in the log; busbw/algbw {ratio:.2f} fits no collective of {ranks} ranks"
            )
        return Identity(ALL_REDUCE, f"recognised from the table (busbw/algbw {ratio:.2f} = 2(n-1)/n)")
    return Identity(None, f"not named in the log; busbw/algbw {ratio:.2f} is not all_reduce's 2(n-1)/n > 1")
