"""argparse value types shared by the subcommands."""

from __future__ import annotations

import argparse
from pathlib import Path


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


def existing_file(text: str) -> Path:
    """A file the command reads: refused at parse time (exit 2) when it is not there, so a command never
    spends AWS calls and retries before saying a local input is missing."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a file")
    return path
