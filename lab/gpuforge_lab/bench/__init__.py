"""Helpers for the benchmark scripts under bench/ and the reliability tests (figures, never assertions)."""
