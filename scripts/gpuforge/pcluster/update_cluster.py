"""`pcluster update-cluster`: its argv, and running it (the one subprocess `gpuforge roll --apply` starts)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from gpuforge.errors import ExternalError, UserError

_PCLUSTER_TIMEOUT_S = 900


def command(cluster_name: str | None, config_path: Path, region: str | None) -> list[str]:
    """The `pcluster update-cluster` argv (pcluster 3.16.1 `pcluster update-cluster --help`)."""
    argv = ["pcluster", "update-cluster", "--cluster-name", cluster_name or "CLUSTER_NAME"]
    argv += ["--cluster-configuration", str(config_path)]
    if region:
        argv += ["--region", region]
    return argv


def _pcluster() -> str:
    """pcluster from PATH, else the one installed beside this Python (gpuforge's virtualenv)."""
    search = os.pathsep.join(filter(None, [os.environ.get("PATH"), str(Path(sys.executable).parent)]))
    found = shutil.which("pcluster", path=search)
    if found is None:
        raise UserError(
            "pcluster not found on PATH or in gpuforge's virtualenv: install aws-parallelcluster "
            "(requirements/constraints.txt pins 3.16.1), or run without --apply and use the printed command"
        )
    return found


def _pcluster_message(output: str) -> str:
    """pcluster's JSON answer reduced to its message (and validation errors), else the raw text."""
    try:
        data = json.loads(output)
    except ValueError:
        return output.strip() or "no output"
    if not isinstance(data, dict):
        return output.strip()
    parts = [str(data.get("message") or "")]
    for key in ("updateValidationErrors", "configurationValidationErrors"):
        parts += [str(e.get("message", e)) for e in data.get(key) or [] if isinstance(e, dict)]
    return "; ".join(p for p in parts if p) or output.strip()


def run(argv: Sequence[str]) -> str:
    """Run `pcluster update-cluster`; its stdout, or an ExternalError with pcluster's own message."""
    command = [_pcluster(), *argv[1:]]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_PCLUSTER_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise ExternalError(f"pcluster update-cluster gave no answer in {_PCLUSTER_TIMEOUT_S} s") from None
    except OSError as exc:
        raise ExternalError(f"cannot run {command[0]}: {exc.strerror}") from None
    if done.returncode != 0:
        message = _pcluster_message(done.stdout or done.stderr)
        raise ExternalError(f"pcluster update-cluster failed (exit {done.returncode}): {message}")
    return done.stdout
