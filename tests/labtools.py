"""What the lab tests share: the gpuforge CLI, a lab per module, commands on hosts, playbooks.

Lab tests need root and systemd-nspawn (`LAB_MARKS` skips them otherwise, saying so). Every
call goes through the real `gpuforge` entry point in a subprocess, as a user would run it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
import pytest

from gpuforge_lab import core as lab_core
from gpuforge_lab import host, state
from gpuforge_lab import images as lab_images
from gpuforge_lab import rootfs as lab_rootfs
from gpuforge_lab.bench import labrun
from gpuforge_lab.moto import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

LAB_MARKS = [
    pytest.mark.lab,
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("systemd-nspawn"),
        reason="the lab needs root and systemd-nspawn (apt-get install systemd-container)",
    ),
]

# One PLAY RECAP parser for tests and benchmarks.
recap = labrun.recap

# Appended to every test lab's name, so several checkouts (or CI workers) can run lab tests on
# one machine at once without bringing down each other's labs. Lab names stay within 12 characters.
LAB_SUFFIX = os.environ.get("GPUFORGE_TEST_LAB_SUFFIX", "")


def lab_name(base: str) -> str:
    """The name a test module's lab gets on this machine: `base` plus GPUFORGE_TEST_LAB_SUFFIX."""
    return f"{base}{LAB_SUFFIX}"


def gpuforge(
    *args: str, env: dict[str, str] | None = None, timeout: float = 900, without_aws: bool = False
) -> subprocess.CompletedProcess[str]:
    """The CLI as a subprocess; `without_aws` drops every AWS_* variable (proves no AWS is used)."""
    return _cli("gpuforge.cli", args, env=env, timeout=timeout, without_aws=without_aws)


def gpuforge_lab(
    *args: str, env: dict[str, str] | None = None, timeout: float = 900, without_aws: bool = False
) -> subprocess.CompletedProcess[str]:
    """The lab's CLI (`gpuforge-lab`, the checkout's test double) as a subprocess, like gpuforge()."""
    return _cli("gpuforge_lab.cli", args, env=env, timeout=timeout, without_aws=without_aws)


def _cli(
    module: str, args: tuple[str, ...], *, env: dict[str, str] | None, timeout: float, without_aws: bool
) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not (without_aws and k.startswith("AWS_")) and k != "SSH_AUTH_SOCK"
    }
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={**base, **(env or {})},
        timeout=timeout,
    )


def lab_up(name: str, nodes: int, *, ec2: bool = True, image: str | None = None) -> dict[str, Any]:
    """A fresh lab (an old one of the same name goes first); `gpuforge-lab up --json`'s output."""
    gpuforge_lab("down", "--name", name)
    args = ["up", "--name", name, "--nodes", str(nodes), "--json"]
    args += ["--moto-port", str(free_port())] if ec2 else ["--no-ec2"]
    if image:
        args += ["--image", image]
    up = gpuforge_lab(*args)
    assert up.returncode == 0, up.stderr[-3000:]
    info: dict[str, Any] = json.loads(up.stdout)
    return info


@contextmanager
def lab(name: str, nodes: int, *, ec2: bool = True, image: str | None = None) -> Iterator[dict[str, Any]]:
    """lab_up for the length of a with block (module fixtures), plus its `lab env` as info["env"]."""
    info = lab_up(name, nodes, ec2=ec2, image=image)
    info["env"] = lab_core.env_exports(name)
    try:
        yield info
    finally:
        gpuforge_lab("down", "--name", name)


def on(lab_name: str, host: str, command: str, *, check: bool = True, timeout: float = 300) -> str:
    """Run a shell command on a lab host as root; its stdout."""
    out = gpuforge_lab(
        "ssh", "--name", lab_name, host, "--", f"sudo sh -c {shlex.quote(command)}", timeout=timeout
    )
    if check:
        assert out.returncode == 0, f"{host}: {command}: {out.stderr}{out.stdout}"
    return out.stdout


def _playbook_env(env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **env, "ANSIBLE_FORCE_COLOR": "0", "PATH": f"{BIN}:{os.environ['PATH']}"}


def playbook(
    env: dict[str, str], *args: str, timeout: float = 1500, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """ansible-playbook from the repository root (or `cwd`) with the lab's environment."""
    return subprocess.run(
        [str(BIN / "ansible-playbook"), *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        env=_playbook_env(env),
        timeout=timeout,
    )


def inventory_addresses(env: dict[str, str], *args: str) -> dict[str, str]:
    """Each host of the lab's inventory (`ansible-inventory --list`, cache flushed) and its ansible_host."""
    out = subprocess.run(
        [str(BIN / "ansible-inventory"), "--list", "--flush-cache", *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env=_playbook_env(env),
    )
    hostvars = json.loads(out.stdout)["_meta"]["hostvars"]
    # ansible-inventory marks values from the cloud as unsafe: {"__ansible_unsafe": "10.213.1.10"}.
    addresses = {name: v["ansible_host"] for name, v in hostvars.items()}
    return {name: str(a["__ansible_unsafe"] if isinstance(a, dict) else a) for name, a in addresses.items()}


def playbook_interrupted(
    env: dict[str, str], *args: str, at: str, then: Callable[[], None], timeout: float = 1500
) -> tuple[int, str]:
    """`playbook`, calling then() once (a fault: a host killed, its sshd stopped) at the first output line
    that starts with regex `at`, while the play runs on. Its exit status and output (stderr merged)."""
    proc = subprocess.Popen(
        [str(BIN / "ansible-playbook"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=_playbook_env(env),
    )
    assert proc.stdout is not None
    lines: list[str] = []
    done = False
    for line in proc.stdout:
        lines.append(line)
        if not done and re.match(at, line):
            then()
            done = True
    returncode = proc.wait(timeout=timeout)
    out = "".join(lines)
    assert done, f"ansible-playbook {' '.join(args)} never printed a line matching {at!r}:\n{out[-3000:]}"
    return returncode, out


def relaunch(lab_name: str, host_name: str, image: str | None = None) -> None:
    """Boot a lab host again from its own disk, with new SSH host keys and the lab's login key.

    What EC2 does with an instance of a sanitized image: the disk (the host's writable layer) is
    kept, cloud-init makes new host keys and installs the login key. A host sanitized by
    `gpuforge-lab bake` answers SSH again without copying its tree into an image first.
    `image` names the lab image the host boots from when it is not the lab's own (see reimage).
    """
    _reboot(lab_name, host_name, image, fresh=False)


def reimage(lab_name: str, host_name: str, image: str) -> None:
    """Make one host of a running lab a fresh host of lab image `image` (an empty writable layer).

    `gpuforge-lab up --image` boots every host of a lab from one image; tests that need hosts of
    different images in one lab (the base-image twins) swap them one by one with this.
    """
    _reboot(lab_name, host_name, image, fresh=True)


# The lab's state file is read, changed and written whole: one host at a time (tests run these
# from threads to boot several hosts at once; the wait for SSH is outside the lock).
_STATE_LOCK = threading.Lock()


def _reboot(lab_name: str, host_name: str, image: str | None, *, fresh: bool) -> None:
    with _STATE_LOCK:
        lab_state = state.load(lab_name)
        assert lab_state is not None, f"lab {lab_name} is not up"
        (node,) = [h for h in lab_state.hosts if host_name in (h.name, h.ip)]
        host.stop(lab_state, node)
        if fresh:
            for layer in ("upper", "work"):
                shutil.rmtree(host.host_dir(lab_state, node) / layer, ignore_errors=True)
        image = image or lab_state.image
        lower = lab_images.rootfs(image) if image else lab_rootfs.rootfs_path()
        root = host.mount_overlay(lab_state, node, lower)
        host.personalise(lab_state, node, root, Path(lab_state.ssh_key).with_suffix(".pub").read_text())
        node.pid = host.boot(lab_state, node, root)
        state.save(lab_state)
    host.wait_ssh(lab_state, node)


def lab_client(env: dict[str, str], service: str) -> Any:
    """A boto3 client for the lab's moto_server (the test double), from the lab's `gpuforge-lab env`."""
    return boto3.client(
        service,
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name=env["AWS_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )


def put_munge_key(env: dict[str, str]) -> str:
    """A random munge key in the lab's SSM Parameter Store (moto), where the slurm role reads it."""
    key = base64.b64encode(secrets.token_bytes(96)).decode()
    lab_client(env, "ssm").put_parameter(
        Name=f"/gpuforge/{env['GPUFORGE_CLUSTER_NAME']}/munge-key",
        Type="SecureString",
        Value=key,
        Overwrite=True,
    )
    return key
