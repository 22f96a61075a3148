"""A small caching HTTP proxy for lab hosts: Debian packages and PyPI, nothing else.

Lab hosts have no route off the lab bridge; this proxy on the control host is their only
way out, and it forwards only to the allow-listed package registries. Immutable files
(pool/ and by-hash/ paths) are cached on disk, so a rerun installs from the cache. HTTPS
(pip) is tunnelled with CONNECT to the same allow-list, uncached.

apt-cacher-ng was tried first; its resolver fails here ("503 Host not found") where the
system resolver works, so the lab uses this instead.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import logging
import os
import select
import shutil
import socket
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger("gpuforge.aptproxy")

ALLOWED_HOSTS = frozenset({"deb.debian.org", "security.debian.org", "pypi.org", "files.pythonhosted.org"})
_CACHEABLE_MARKERS = ("/pool/", "/by-hash/")
_CHUNK = 1 << 16


def cacheable(path: str) -> bool:
    return any(marker in path for marker in _CACHEABLE_MARKERS) or path.endswith(".deb")


def cache_file(cache_dir: Path, host: str, path: str) -> Path:
    safe = Path(path.lstrip("/"))
    if ".." in safe.parts:
        raise ValueError(path)
    return cache_dir / host / safe


class ProxyHandler(BaseHTTPRequestHandler):
    server_version = "gpuforge-lab-proxy/1"
    cache_dir: Path
    allowed_hosts: frozenset[str] = ALLOWED_HOSTS

    def log_message(self, fmt: str, *args: object) -> None:
        log.info("%s %s", self.address_string(), fmt % args)

    def _refuse(self, host: str) -> None:
        self.send_error(403, f"{host} is not an allowed upstream for the lab")

    def do_HEAD(self) -> None:
        self._forward(head=True)

    def do_GET(self) -> None:
        self._forward(head=False)

    def _forward(self, head: bool) -> None:
        url = urlsplit(self.path)
        host = url.hostname or ""
        if url.scheme != "http" or host not in self.allowed_hosts:
            self._refuse(host)
            return
        path = url.path + (f"?{url.query}" if url.query else "")
        target = cache_file(self.cache_dir, host, url.path) if cacheable(url.path) and not url.query else None
        if target is not None and target.is_file():
            self._serve_cached(target, head)
            return
        conn = http.client.HTTPConnection(host, url.port or 80, timeout=60)
        try:
            conn.request(
                "HEAD" if head else "GET", path, headers={"User-Agent": self.headers.get("User-Agent", "")}
            )
            resp = conn.getresponse()
            if target is not None and resp.status == 200 and not head:
                # Fetch completely into the cache first, then serve from it: a cut download is
                # never cached, and once a client has a file the next client gets it from disk.
                self._fetch_into_cache(resp, target)
                self._serve_cached(target, head=False)
                return
            self.send_response(resp.status)
            for name, value in resp.getheaders():
                if name.lower() not in {"connection", "transfer-encoding", "keep-alive"}:
                    self.send_header(name, value)
            self.send_header("Connection", "close")
            self.end_headers()
            if not head:
                shutil.copyfileobj(resp, self.wfile, _CHUNK)
        except (OSError, http.client.HTTPException) as exc:
            log.warning("upstream %s failed: %s", self.path, exc)
            with contextlib.suppress(OSError):  # The client may be gone already.
                self.send_error(502, f"upstream error: {exc}")
        finally:
            conn.close()
            self.close_connection = True

    def _serve_cached(self, target: Path, head: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(target.stat().st_size))
        self.send_header("Connection", "close")
        self.end_headers()
        if not head:
            with target.open("rb") as src:
                shutil.copyfileobj(src, self.wfile, _CHUNK)
        self.close_connection = True

    @staticmethod
    def _fetch_into_cache(resp: http.client.HTTPResponse, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".partial-")
        try:
            with os.fdopen(fd, "wb") as tmp:
                shutil.copyfileobj(resp, tmp, _CHUNK)
            Path(tmp_name).replace(target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise

    def do_CONNECT(self) -> None:
        host, _, port = self.path.partition(":")
        if host not in self.allowed_hosts or port not in {"443", ""}:
            self._refuse(host)
            return
        try:
            upstream = socket.create_connection((host, int(port or 443)), timeout=60)
        except OSError as exc:
            self.send_error(502, f"cannot reach {host}: {exc}")
            return
        self.send_response(200, "Connection established")
        self.end_headers()
        self._tunnel(self.connection, upstream)
        self.close_connection = True

    @staticmethod
    def _tunnel(client: socket.socket, upstream: socket.socket) -> None:
        sockets = [client, upstream]
        try:
            while True:
                readable, _, broken = select.select(sockets, [], sockets, 120)
                if broken or not readable:
                    return
                for sock in readable:
                    data = sock.recv(_CHUNK)
                    if not data:
                        return
                    (upstream if sock is client else client).sendall(data)
        finally:
            upstream.close()


def serve(
    listen: str, port: int, cache_dir: Path, extra_hosts: frozenset[str] = frozenset()
) -> ThreadingHTTPServer:
    """A proxy server (not yet serving); extra_hosts widens the allow-list (tests use loopback)."""
    attrs = {"cache_dir": cache_dir, "allowed_hosts": ALLOWED_HOSTS | extra_hosts}
    handler = type("BoundProxyHandler", (ProxyHandler,), attrs)
    server = ThreadingHTTPServer((listen, port), handler)
    server.daemon_threads = True
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--port", type=int, default=3142)
    parser.add_argument("--cache", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    server = serve(args.listen, args.port, args.cache)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    thread.join()


if __name__ == "__main__":
    main()
