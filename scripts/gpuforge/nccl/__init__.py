"""NCCL bandwidth: parse nccl-tests all_reduce_perf output, judge it against the expected peak, report."""
