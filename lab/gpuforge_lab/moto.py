"""Run moto in server mode on loopback: the lab's (and the tests') stand-in for AWS."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from gpuforge.errors import ExternalError, UserError

HOST = "127.0.0.1"
# Credentials moto accepts; they are fixed, public test values, not secrets.
TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
    # The lab is not EC2: botocore must never ask 169.254.169.254 for anything.
    "AWS_EC2_METADATA_DISABLED": "true",
}


def port_in_use(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class MotoServer:
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment that points boto3, the AWS CLI and amazon.aws at this server."""
        return {**TEST_ENV, "AWS_ENDPOINT_URL": self.url, "AWS_URL": self.url}

    def start(self, timeout: float = 30.0) -> None:
        if port_in_use(self.port):
            raise UserError(
                f"port {self.port} on {HOST} is already in use; stop what holds it "
                "or choose another with --moto-port"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gpuforge_lab.motoserver", "-H", HOST, "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ExternalError(f"moto_server exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1):  # noqa: S310 (loopback)
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        raise ExternalError(f"moto_server did not answer on {self.url} within {timeout:.0f}s")

    def reset(self) -> None:
        """Drop every resource moto holds (between tests). Dropping many images and instances takes the
        server seconds at CI's load, so it gets a minute (5 s timed out in a clean-clone run at load 15)."""
        req = urllib.request.Request(f"{self.url}/moto-api/reset", method="POST")  # noqa: S310
        with urllib.request.urlopen(req, timeout=60):  # noqa: S310 (loopback)
            pass

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None
