"""One lab golden image per tree, baked once and shared by every lab test that boots from it.

`shared_golden_image()` runs what tests/test_ami_local_bake.py checks (`gpuforge-lab bake
--save-image` on a builder lab prepared with the NVIDIA test fixtures, the pytorch role pointed at
the TEST DOUBLE of its wheel) at most once per tree on this machine: CI runs the lab modules as
phases side by side, and a module that boots golden hosts (test_fleet_lab, test_partial_failure_lab)
would otherwise bake again. An flock under the lab image cache makes the other callers wait for
the first baker; the image's name carries a digest of everything the bake is made from, so an
image of another tree is never reused.

What the bake produced (its stdout and stderr, packer run directory, the builder's identity and
status once the image was saved, the lab variables and a copy of the builder's artifact fixtures
whose keys and hashes the image was installed with) is recorded next to the image, so
test_ami_local_bake asserts on the bake whichever module ran it. The image stays in the cache
(GPUFORGE_CACHE_DIR/images) after the run: a later run of the same tree reuses it, and the first
bake of another tree removes it once no lab host mounts it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import labtools
import torchdouble
from gpuforge_lab import images as lab_images
from gpuforge_lab import rootfs as lab_rootfs

PREFIX = "pytest-golden-"
# What the bake is made from: the pins, the roles and playbooks it runs, Packer's template and
# scripts, the inventory's lab variables, the CLI and lab code that run it, the test fixtures.
INPUTS = (
    "versions.yml",
    "ansible.cfg",
    "galaxy.yml",
    "data",
    "inventory",
    "packer",
    "playbooks",
    "plugins",
    "roles",
    "scripts/gpuforge",
    "tests/fixtures/artifacts",
    "tests/fixtures/nvidia",
    "tests/goldenlab.py",
    "tests/torchdouble.py",
)
RECORD = "bake.json"
# A failed bake is reported to the callers of the same run (not retried by each); an older one is retried.
FAILURE_REUSE_S = 3600
# Another tree's image goes only when no lab host mounts it and it is this old (another checkout
# on this machine may be about to boot from it).
STALE_S = 3 * 3600


def tree_digest() -> str:
    """A digest of every file the bake is made from, the lab's Debian recipe and the kernel."""
    digest = hashlib.sha256()
    for top in INPUTS:
        path = labtools.REPO / top
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if "__pycache__" in file.parts:
                continue
            digest.update(str(file.relative_to(labtools.REPO)).encode() + b"\0")
            digest.update(file.read_bytes() + b"\0")
    digest.update(lab_rootfs.recipe_key().encode() + b"\0" + os.uname().release.encode())
    return digest.hexdigest()[:12]


def image_name() -> str:
    return f"{PREFIX}{tree_digest()}"


def record_dir(image: str) -> Path:
    """Where the bake of `image` is recorded (hidden: `lab image list` skips it)."""
    return lab_images.images_root() / f".{image}.bake"


def shared_golden_image() -> dict[str, Any]:
    """The record of this tree's golden lab image, baking it first if no caller did yet.

    Keys: image, returncode, stdout, stderr, run_dir, builder_lab, builder_host, builder_status
    (`lab status --json` right after the image was saved), machine_id and host_key (the builder's),
    lab_vars (the bake's extra-vars file), artifacts (a copy of the builder's GPUFORGE_LAB_ARTIFACTS,
    with artifacts-server.json next to it as in a lab's directory), seconds (the bake's wall time).
    A failed bake raises AssertionError with its output, in every caller.
    """
    image = image_name()
    root = lab_images.images_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".{PREFIX}lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = _read(image)
        if record is None:
            _remove_stale(image)
            record = _bake(image)
    assert record["returncode"] == 0, (record["stdout"] + record["stderr"])[-6000:]
    return record


def _read(image: str) -> dict[str, Any] | None:
    path = record_dir(image) / RECORD
    if not path.is_file():
        return None
    record: dict[str, Any] = json.loads(path.read_text())
    if record["returncode"] != 0 and time.time() - path.stat().st_mtime > FAILURE_REUSE_S:
        return None
    if record["returncode"] == 0 and not (root_of(image) / lab_images.METADATA).is_file():
        return None  # the image was removed by hand: bake it again
    record["run_dir"] = Path(record["run_dir"])
    record["lab_vars"] = Path(record["lab_vars"])
    return record


def root_of(image: str) -> Path:
    return lab_images.images_root() / image


def _remove_stale(image: str) -> None:
    """Images of other trees (and this one's failed bake) no lab host mounts any more."""
    for path in lab_images.images_root().glob(f"{PREFIX}*"):
        old = time.time() - path.stat().st_mtime > STALE_S
        if path.name == image or (old and not lab_images.in_use(path)):
            shutil.rmtree(path)
            shutil.rmtree(record_dir(path.name), ignore_errors=True)
    shutil.rmtree(record_dir(image), ignore_errors=True)


def _bake(image: str) -> dict[str, Any]:
    """Prepare a builder lab, bake it with `gpuforge-lab bake --save-image`, record the result."""
    builder_lab = labtools.lab_name("bake")
    record = record_dir(image)
    partial = record.with_name(record.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "work").mkdir(parents=True)
    started = time.monotonic()
    # With the emulated EC2, the lab also serves its vendor-download fixtures (EFA, PyTorch).
    with labtools.lab(builder_lab, 1) as info:
        host = info["hosts"][0]["name"]
        artifacts = info["env"]["GPUFORGE_LAB_ARTIFACTS"]
        prepare = labtools.playbook(info["env"], "tests/fixtures/nvidia/prepare.yml", timeout=900)
        assert prepare.returncode == 0, prepare.stdout[-3000:]
        identity = labtools.on(
            builder_lab, host, "cat /etc/machine-id /etc/ssh/ssh_host_ed25519_key.pub"
        ).split()
        # No assertion reads torch: the pytorch role installs the kilobyte TEST DOUBLE of its wheel.
        lab_vars = torchdouble.bake_vars(artifacts, partial / "work")
        result = labtools.gpuforge_lab(
            "bake",
            "--lab",
            builder_lab,
            "--work-dir",
            str(partial / "work"),
            "--extra-vars",
            str(lab_vars),
            "--save-image",
            image,
            env={"GPUFORGE_LAB_ARTIFACTS": artifacts},
            without_aws=True,
            # A hang guard, not a budget: the bake and the image save take 7-11 minutes at CI's load
            # (4 phases on 2 CPUs), and at load 9 one run needed more than 900 s.
            timeout=1800,
        )
        status = json.loads(labtools.gpuforge_lab("status", "--name", builder_lab, "--json").stdout)
        # The keys and hashes the image was installed with, for runs on its hosts after this lab is gone.
        shutil.copytree(artifacts, partial / "artifacts", symlinks=True)
        shutil.copyfile(Path(artifacts).parent / "artifacts-server.json", partial / "artifacts-server.json")
    if result.returncode != 0 and root_of(image).exists():
        labtools.gpuforge_lab("image", "rm", image)
    lines = result.stdout.strip().splitlines()
    data = {
        "image": image,
        "returncode": result.returncode,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "run_dir": str(lines[-1]).replace(str(partial), str(record)) if lines else "",
        "builder_lab": builder_lab,
        "builder_host": host,
        "builder_status": status,
        "machine_id": identity[0],
        "host_key": identity[2],
        "lab_vars": str(record / "work" / lab_vars.name),
        "artifacts": str(record / "artifacts"),
        "seconds": round(time.monotonic() - started, 1),
    }
    (partial / RECORD).write_text(json.dumps(data, indent=2) + "\n")
    partial.rename(record)
    found = _read(image)
    assert found is not None
    return found
