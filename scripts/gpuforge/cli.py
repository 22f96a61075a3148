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
from gpuforge.errors import ExternalError, UserError

# Feature modules, each exposing register(subparsers). Add a module here to add its commands.
_COMMAND_MODULES = (
    "gpuforge.lab.cli",
    "gpuforge.pcluster.cli",
    "gpuforge.pcluster.roll",
    "gpuforge.preflight.cli",
    "gpuforge.nccl.cli",
    "gpuforge.ami.cli",
    "gpuforge.noderev",
    "gpuforge.fleet.cli",
)

# Commands only a checkout has (`pip install .` leaves the lab out).
_CHECKOUT_ONLY = ("gpuforge.lab.cli",)

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuforge", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gpuforge {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log debug detail; -vv adds botocore's wire log (credentials, signatures, tokens redacted)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # The lab is a checkout's test double: the wheel does not carry it (pyproject).
            if name in _CHECKOUT_ONLY and exc.name == name.rsplit(".", 1)[0]:
                continue
            raise
        module.register(sub)
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
    parser = build_parser()
    args = parser.parse_args(argv)
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
        print(f"gpuforge: error: {message}", file=sys.stderr)
        return UserError.exit_code if isinstance(cause, _USER_MISTAKES) else exc.exit_code
    except (NoCredentialsError, PartialCredentialsError) as exc:
        # Missing credentials are the user's to fix, wherever the first AWS call happens.
        print(f"gpuforge: error: {exc}; {CREDENTIALS_HINT}", file=sys.stderr)
        return UserError.exit_code
    except (BotoCoreError, ClientError) as exc:
        # Anything else botocore raises outside gpuforge's own handling: one line, never a traceback.
        print(f"gpuforge: error: {_one_line(exc)}", file=sys.stderr)
        return UserError.exit_code if isinstance(exc, _USER_MISTAKES) else ExternalError.exit_code
    except KeyboardInterrupt:
        print("gpuforge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
