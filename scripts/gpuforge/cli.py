"""The `gpuforge` command. Each feature module contributes its subcommands via register()."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from botocore.exceptions import NoCredentialsError, PartialCredentialsError

from gpuforge import __version__
from gpuforge.aws import CREDENTIALS_HINT
from gpuforge.errors import ExternalError, UserError

# Feature modules, each exposing register(subparsers). Add a module here to add its commands.
_COMMAND_MODULES = (
    "gpuforge.lab.cli",
    "gpuforge.pcluster.cli",
    "gpuforge.preflight.cli",
    "gpuforge.nccl.cli",
    "gpuforge.ami.cli",
)

# Commands only a checkout has (`pip install .` leaves the lab out).
_CHECKOUT_ONLY = ("gpuforge.lab.cli",)

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuforge", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gpuforge {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # boto's own INFO lines (credential and endpoint discovery) are noise to a CLI user.
    for noisy in ("botocore", "boto3", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    handler: Handler = args.handler
    try:
        return handler(args)
    except (UserError, ExternalError) as exc:
        message = str(exc)
        if isinstance(exc.__cause__, NoCredentialsError | PartialCredentialsError):
            message += f"; {CREDENTIALS_HINT}"
        print(f"gpuforge: error: {message}", file=sys.stderr)
        return exc.exit_code
    except (NoCredentialsError, PartialCredentialsError) as exc:
        # Missing credentials are the user's to fix, wherever the first AWS call happens.
        print(f"gpuforge: error: {exc}; {CREDENTIALS_HINT}", file=sys.stderr)
        return UserError.exit_code
    except KeyboardInterrupt:
        print("gpuforge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
