"""Preflight: read-only AWS checks that a GPU cluster is ready to run EFA/NCCL jobs."""
