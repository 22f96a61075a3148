"""Serve a directory of artifacts over HTTP to lab hosts.

    python -m gpuforge_lab.artifacts.server --root DIR --lab NAME [--port N] [--state-file F]
    python -m gpuforge_lab.artifacts.server --root DIR --listen 127.0.0.1:8000

The server only ever binds to loopback or to the bridge gateway address of a lab that is up
(the address lab hosts reach the control host by), never to a wildcard or a public address.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import ipaddress
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any

from gpuforge.errors import UserError
from gpuforge_lab import state

log = logging.getLogger(__name__)


def lab_gateways() -> set[str]:
    """The bridge gateway address of every lab that is up (from the labs' state files)."""
    gateways: set[str] = set()
    root = state.lab_root()
    if root.is_dir():
        for path in root.glob("*/state.json"):
            gateways.add(f"{json.loads(path.read_text())['subnet_prefix']}.1")
    return gateways


def check_address(host: str, allowed: set[str] | None = None) -> str:
    """Return host if it is a loopback address or an allowed lab gateway, else raise UserError."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise UserError(
            f"listen address {host!r} is not an IP address; use 127.0.0.1 or --lab NAME"
        ) from None
    if address.is_loopback:
        return host
    gateways = lab_gateways() if allowed is None else allowed
    if host in gateways:
        return host
    raise UserError(
        f"refusing to listen on {host}: only loopback or a lab bridge gateway "
        f"({', '.join(sorted(gateways)) or 'no lab is up'}) is allowed; use --lab NAME"
    )


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise UserError(f"--listen {text!r} must be IP:PORT, e.g. 127.0.0.1:8000 (port 0 picks a free one)")
    return host, int(port_text)


class _QuietHandler(SimpleHTTPRequestHandler):
    """Static files only; requests go to the logger instead of stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)

    def list_directory(self, path: str | os.PathLike[str]) -> None:
        # Directory listings are not part of the contract; clients ask for exact file names.
        self.send_error(404, "no directory listings")
        return None


class ArtifactServer:
    """A threaded static HTTP server for one directory."""

    def __init__(self, root: Path, host: str = "127.0.0.1", port: int = 0, allowed: set[str] | None = None):
        if not root.is_dir():
            raise UserError(f"artifact root {root} is not a directory")
        self.root = root.resolve()
        self.host = check_address(host, allowed)
        handler = functools.partial(_QuietHandler, directory=str(self.root))
        self._httpd = ThreadingHTTPServer((self.host, port), handler)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ArtifactServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="artifact-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


@contextlib.contextmanager
def serving(root: Path, host: str = "127.0.0.1", port: int = 0) -> Iterator[ArtifactServer]:
    server = ArtifactServer(root, host, port).start()
    try:
        yield server
    finally:
        server.stop()


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpuforge_lab.artifacts.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--root", required=True, type=Path, help="directory to serve")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--listen", help="IP:PORT (loopback or a lab gateway)")
    where.add_argument("--lab", help="listen on this lab's bridge gateway")
    parser.add_argument("--port", type=int, default=0, help="port with --lab (default: a free one)")
    parser.add_argument("--state-file", type=Path, help="write {url, pid, root} here once listening")
    parser.add_argument(
        "--lifetime",
        type=float,
        default=0,
        help="exit after this many seconds (a safety net for background runs; 0 = never)",
    )
    return parser


def _resolve_listen(args: argparse.Namespace) -> tuple[str, int]:
    if args.listen:
        return parse_listen(args.listen)
    lab = state.load(state.validate_name(args.lab))
    if lab is None:
        raise UserError(f"lab {args.lab!r} is not up; start it with `gpuforge-lab up --name {args.lab}`")
    return lab.gateway, args.port


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s artifact-server: %(message)s")
    try:
        host, port = _resolve_listen(args)
        server = ArtifactServer(args.root, host, port)
    except UserError as exc:
        print(f"gpuforge: error: {exc}", file=sys.stderr)
        return exc.exit_code

    def _stop(signum: int, frame: FrameType | None) -> None:
        # shutdown() blocks until serve_forever returns, so it must run on another thread.
        threading.Thread(target=server.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if args.lifetime > 0:
        timer = threading.Timer(args.lifetime, server.stop)
        timer.daemon = True
        timer.start()
    if args.state_file:
        record = {"url": server.url, "pid": os.getpid(), "root": str(server.root), "started": time.time()}
        tmp = args.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(args.state_file)
    log.info("serving %s at %s", server.root, server.url)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
