"""scripts/pcluster/on_node_configured.sh: refuses bad input before touching the node.

The full ansible-pull run on a lab host is in tests/test_fleet_lab.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pcluster" / "on_node_configured.sh"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPUFORGE_")}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        check=False,
        env={**clean, **(env or {})},
        timeout=30,
    )


def test_missing_repository_is_refused() -> None:
    """Without --repo or GPUFORGE_REPO the script says what to pass and exits 2."""
    out = run("--node-type", "Compute")
    assert out.returncode == 2
    assert "pass --repo URL or set GPUFORGE_REPO" in out.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="the node-type check comes after the root check")
@pytest.mark.parametrize("args", [["--node-type", "LoginNode"], []], ids=["unknown", "no-cfnconfig"])
def test_unknown_node_type_is_refused(args: list[str]) -> None:
    """A node type other than HeadNode/Compute (or none, off ParallelCluster) stops it with exit 2."""
    if not args and Path("/etc/parallelcluster/cfnconfig").exists():
        pytest.skip("this machine is a ParallelCluster node")
    out = run("--repo", "file:///nonexistent", *args)
    assert out.returncode == 2
    assert "pass --node-type HeadNode or Compute" in out.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean() -> None:
    """shellcheck finds nothing in the script."""
    out = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout
