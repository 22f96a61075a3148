"""The `gpuforge` command. Each feature module contributes its subcommands via register()."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    InvalidRegionError,
    NoCredentialsError,
    NoRegionError,
    ParamValidationError,
    PartialCredentialsError,
    ProfileNotFound,
)

from gpuforge import __version__, logsafe
from gpuforge.aws import CREDENTIALS_HINT
from gpuforge.commands import base as commands
from gpuforge.errors import ExternalError, UserError

# The command layer's modules (gpuforge.commands), each exposing COMMANDS, its command classes in the
# order `gpuforge --help` lists them. Add a module here to add its commands.
_COMMAND_MODULES = (
    "gpuforge.commands.cluster_config",
    "gpuforge.commands.roll",
    "gpuforge.commands.preflight",
    "gpuforge.commands.nccl",
    "gpuforge.commands.ami",
    "gpuforge.commands.node_revision",
    "gpuforge.commands.fleet",
    "gpuforge.commands.accept",
)

Handler = Callable[[argparse.Namespace], int]


def add_verbose(parser: argparse.ArgumentParser) -> None:
    """-v/--verbose, which run() reads (the checkout's `gpuforge-lab` takes it too)."""
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log debug detail; -vv adds botocore's wire log (credentials, signatures, tokens redacted)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuforge", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gpuforge {__version__}")
    add_verbose(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        commands.register(sub, importlib.import_module(name).COMMANDS)
    return parser


# botocore errors that only the user's input or settings can cause (exit 2); the rest exit 1.
_USER_MISTAKES = (ParamValidationError, InvalidRegionError, NoRegionError, ProfileNotFound)


def _one_line(exc: BaseException) -> str:
    """The exception's message on one line (ParamValidationError spans several)."""
    text = ""
    for line in (line.strip() for line in str(exc).splitlines()):
        if line:
            text += (" " if not text or text.endswith(":") else "; ") + line
    return logsafe.redact(text.strip())


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace, prog: str = "gpuforge") -> int:
    """Run the parsed command's handler: a user's mistake exits 2 and a failed external call 1, each with one
    line on stderr (`PROG: error: ...`), never a traceback."""
    logsafe.configure(args.verbose)
    handler: Handler = args.handler
    try:
        return handler(args)
    except (UserError, ExternalError) as exc:
        message = str(exc)
        cause = exc.__cause__
        if isinstance(cause, BotoCoreError | ClientError):
            message = _one_line(exc)
        if isinstance(cause, NoCredentialsError | PartialCredentialsError):
            message += f"; {CREDENTIALS_HINT}"
        print(f"{prog}: error: {message}", file=sys.stderr)
        return UserError.exit_code if isinstance(cause, _USER_MISTAKES) else exc.exit_code
    except (NoCredentialsError, PartialCredentialsError) as exc:
        # Missing credentials are the user's to fix, wherever the first AWS call happens.
        print(f"{prog}: error: {exc}; {CREDENTIALS_HINT}", file=sys.stderr)
        return UserError.exit_code
    except (BotoCoreError, ClientError) as exc:
        # Anything else botocore raises outside gpuforge's own handling: one line, never a traceback.
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return UserError.exit_code if isinstance(exc, _USER_MISTAKES) else ExternalError.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
