"""A recording proxy in front of moto_server, so the inventory bench times clients, not the emulator.

The first time a request (method, path, body) arrives it goes to moto and the answer is kept, with
the seconds moto took (moto's own time); later identical requests are answered from memory. EC2's
query API carries its parameters (Action, Filters, MaxResults, NextToken) in the body and the
signature in headers, so the body names a page. GET /replay-stats returns the counters as JSON.

Run: python -m gpuforge_lab.bench.replay --port PORT --upstream http://127.0.0.1:MOTO_PORT
A benchmark aid only (it forwards to a loopback emulator); nothing in production uses it.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gpuforge_lab.moto import HOST

STATS_PATH = "/replay-stats"


class Replay:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.answers: dict[tuple[str, str, bytes], tuple[int, str, bytes]] = {}
        self.upstream_seconds = 0.0
        self.forwarded = 0
        self.served = 0
        self.lock = threading.Lock()

    def answer(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, str, bytes]:
        """moto's answer to this request; its headers (moto reads the service from the signature) go along."""
        key = (method, path, body)
        with self.lock:
            known = self.answers.get(key)
            if known is not None:
                self.served += 1
                return known
            # One request at a time reaches moto (single-threaded anyway): its time is its own.
            start = time.perf_counter()
            request = urllib.request.Request(  # noqa: S310 (the loopback emulator)
                self.upstream + path,
                data=body if method == "POST" else None,
                method=method,
                headers={k: v for k, v in headers.items() if k.lower() not in {"host", "content-length"}},
            )
            try:
                with urllib.request.urlopen(request, timeout=3600) as reply:  # noqa: S310
                    got = (reply.status, reply.headers.get("Content-Type", "text/xml"), reply.read())
            except urllib.error.HTTPError as e:
                got = (e.code, e.headers.get("Content-Type", "text/xml"), e.read())
            self.upstream_seconds += time.perf_counter() - start
            self.forwarded += 1
            if got[0] == 200:
                self.answers[key] = got
            return got

    def stats(self) -> dict[str, float]:
        with self.lock:
            return {
                "upstream_seconds": self.upstream_seconds,
                "forwarded": self.forwarded,
                "served": self.served,
            }


def serve(port: int, upstream: str) -> None:
    replay = Replay(upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == STATS_PATH:
                self._send(200, "application/json", json.dumps(replay.stats()).encode())
            else:
                self._send(*replay.answer("GET", self.path, b"", dict(self.headers)))

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self._send(*replay.answer("POST", self.path, body, dict(self.headers)))

        def log_message(self, format: str, *args: object) -> None:
            return

    ThreadingHTTPServer((HOST, port), Handler).serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    serve(args.port, args.upstream)


if __name__ == "__main__":
    main()
