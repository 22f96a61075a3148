"""`gpuforge bake --local` end to end: the real packer (Debian's 1.6.6) runs the real provisioners
(playbooks/bake.yml with the install tag, then packer/scripts/sanitize.sh) over SSH against a real
lab host (`gpuforge lab up`), with no AWS at all.

Needs root, systemd-nspawn (the lab) and the packer binary; CI installs them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuforge import versions
from gpuforge.ami import manifest as packer_manifest
from gpuforge.lab import core as lab_core
from gpuforge.lab.moto import free_port

REPO = Path(__file__).resolve().parents[1]
LAB = "bake"

pytestmark = [
    pytest.mark.lab,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("systemd-nspawn"),
        reason="the lab needs root and systemd-nspawn (apt-get install systemd-container)",
    ),
    pytest.mark.skipif(
        shutil.which("packer") is None, reason="packer binary absent (apt-get install packer)"
    ),
]


def gpuforge(*args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "SSH_AUTH_SOCK"}
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-m", "gpuforge.cli", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env=env,
        timeout=900,
    )


@pytest.fixture(scope="module")
def lab() -> Iterator[dict[str, Any]]:
    gpuforge("lab", "down", "--name", LAB)
    # With the emulated EC2, the lab also serves its vendor-download fixtures (EFA, PyTorch).
    up = gpuforge("lab", "up", "--name", LAB, "--nodes", "1", "--moto-port", str(free_port()), "--json")
    assert up.returncode == 0, up.stderr
    info: dict[str, Any] = json.loads(up.stdout)
    info["env"] = lab_core.env_exports(LAB)
    try:
        yield info
    finally:
        gpuforge("lab", "down", "--name", LAB)


def _container_root(nspawn_pid: int) -> Path:
    """The lab records systemd-nspawn's pid; the host's own systemd is its child."""
    children = [
        int(pid)
        for task in Path(f"/proc/{nspawn_pid}/task").iterdir()
        for pid in (task / "children").read_text().split()
    ]
    inits = [pid for pid in children if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd"]
    assert len(inits) == 1, f"expected one systemd under systemd-nspawn {nspawn_pid}, found {inits}"
    return Path(f"/proc/{inits[0]}/root")


def _lab_vars(lab: dict[str, Any], tmp_path: Path) -> Path:
    """The lab's stand-ins for vendor downloads as one extra-vars file for the bake.

    Packer's ansible provisioner builds its own inventory, so the lab's group_vars do not apply;
    the same variables (TEST FIXTURES: NVIDIA apt repositories, the signed EFA installer, the CPU
    wheel of PyTorch) are handed over as extra vars instead.
    """
    merged: dict[str, Any] = {}
    for source in ("molecule/nvidia/vars/fixtures.yml", "inventory/group_vars/gpuforge_lab.yml"):
        merged.update(yaml.safe_load((REPO / source).read_text()))
    path = tmp_path / "lab-vars.yml"
    path.write_text(yaml.safe_dump(merged))
    return path


def test_local_bake_provisions_and_sanitizes_the_lab_host(lab: dict[str, Any], tmp_path: Path) -> None:
    prepare = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "molecule/nvidia/prepare.yml"],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={**os.environ, **lab["env"]},
        timeout=900,
    )
    assert prepare.returncode == 0, prepare.stdout[-3000:]
    result = gpuforge(
        "bake",
        "--local",
        "--lab",
        LAB,
        "--work-dir",
        str(tmp_path),
        "--extra-vars",
        str(_lab_vars(lab, tmp_path)),
        extra_env={"GPUFORGE_LAB_ARTIFACTS": lab["env"]["GPUFORGE_LAB_ARTIFACTS"]},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = Path(result.stdout.strip().splitlines()[-1])
    # Progress was streamed while packer ran, from both provisioners.
    assert "PLAY RECAP" in result.stderr and "sanitize: cleaned" in result.stderr

    digest = versions.load().digest
    (artifact,) = packer_manifest.last_run(run_dir / "manifest.json")
    assert (artifact.name, artifact.builder_type, artifact.images) == ("lab", "null", {})
    assert artifact.custom_data["versions_hash"] == digest

    # Look at the host through its init's root: the playbook ran, then the sanitizer did.
    root = _container_root(int(lab["hosts"][0]["pid"]))
    node_manifest = json.loads((root / "etc/gpuforge/manifest.json").read_text())
    assert node_manifest["versions_hash"] == digest
    assert not list((root / "etc/ssh").glob("ssh_host_*"))
    assert not (root / "home" / lab["ssh_user"] / ".ssh/authorized_keys").exists()
    assert (root / "etc/machine-id").read_text() == ""

    # The lab's own login key no longer works on the host: it is spent, as an image's builder is.
    # (`lab status` exits non-zero exactly because a host does not answer SSH.)
    status = gpuforge("lab", "status", "--name", LAB, "--json")
    host = json.loads(status.stdout)["hosts"][0]
    assert host["running"] is True and host["ssh"] is False
    assert status.returncode != 0
