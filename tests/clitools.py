"""One feature module's commands, run without gpuforge.cli.main's error handling.

main() turns a UserError into its one-line message and exit status 2; tests that look at the error
itself (pytest.raises) run the handler through a parser with only that module's commands.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from types import ModuleType

from gpuforge.commands import base as commands


def run(module: ModuleType, argv: Sequence[str]) -> int:
    """Parse argv with the commands of `module` (its COMMANDS) and call the chosen command's handler."""
    parser = argparse.ArgumentParser(prog="gpuforge")
    commands.register(parser.add_subparsers(dest="command", required=True), module.COMMANDS)
    args = parser.parse_args(argv)
    code: int = args.handler(args)
    return code
