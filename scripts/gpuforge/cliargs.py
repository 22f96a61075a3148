"""argparse value types shared by the subcommands."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """A whole number >= 1, with an argparse error (exit 2) that says what is wrong."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def nonempty(text: str) -> str:
    """A value that must not be empty (an SSM parameter name, a region): an argparse error otherwise."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text
