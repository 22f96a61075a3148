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
