"""A throttling proxy in front of moto_server: a test double for AWS API rate limiting.

moto never throttles, so to prove that gpuforge's clients ride out `RequestLimitExceeded`
(EC2's query protocol) and `ThrottlingException` (JSON protocols such as SSM), this proxy
answers the first `throttle_first` requests with the error AWS sends, then forwards every
request unchanged to the real moto_server. It listens on loopback only.
"""

from __future__ import annotations

import http.client
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOST = "127.0.0.1"
# Hop-by-hop headers are the proxy's own business, not the upstream's.
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


@dataclass
class ThrottleCounts:
    throttled: int = 0
    forwarded: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _ec2_error(request_id: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error>'
        "<Code>RequestLimitExceeded</Code><Message>Request limit exceeded.</Message>"
        f"</Error></Errors><RequestID>{request_id}</RequestID></Response>"
    ).encode()


def _json_error() -> bytes:
    return b'{"__type":"ThrottlingException","message":"Rate exceeded"}'


class ThrottlingProxy:
    """Serve on a free loopback port; throttle the first N requests, forward the rest to upstream."""

    def __init__(self, upstream: str, throttle_first: int) -> None:
        parts = urlsplit(upstream)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream_host: str = parts.hostname
        self.upstream_port: int = parts.port
        self.throttle_first = throttle_first
        self.counts = ThrottleCounts()
        self._server = ThreadingHTTPServer((HOST, 0), self._handler_class())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self._server.server_address[1]}"

    def start(self) -> ThrottlingProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _should_throttle(self) -> bool:
        with self.counts.lock:
            if self.counts.throttled < self.throttle_first:
                self.counts.throttled += 1
                return True
            self.counts.forwarded += 1
            return False

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if proxy._should_throttle():
                    self._throttle()
                    return
                upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    payload = response.read()
                    self.send_response(response.status, response.reason)
                    for key, value in response.getheaders():
                        if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                            self.send_header(key, value)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                finally:
                    upstream.close()

            def _throttle(self) -> None:
                # JSON-protocol services (SSM, STS's JSON variants) name their target in a header.
                if self.headers.get("X-Amz-Target"):
                    status, ctype, payload = 400, "application/x-amz-json-1.1", _json_error()
                else:
                    status, ctype, payload = 503, "text/xml", _ec2_error(str(uuid.uuid4()))
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            # http.server dispatches on these names.
            do_GET = _relay  # noqa: N815
            do_POST = _relay  # noqa: N815
            do_PUT = _relay  # noqa: N815
            do_DELETE = _relay  # noqa: N815
            do_HEAD = _relay  # noqa: N815

        return Handler
