"""The lab's state file: what `lab up` created, so `lab down`/`status` can find it again."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpuforge.errors import UserError

_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,11}$")


def lab_root() -> Path:
    return Path(os.environ.get("GPUFORGE_LAB_DIR", "/var/lib/gpuforge/lab"))


@contextlib.contextmanager
def locked(name: str = ".labs") -> Iterator[None]:
    """An exclusive lock under the lab root: per lab for up/down, `.labs` for allocating subnets,
    `images` for saving and removing images, `rootfs` for building and reading the Debian tree."""
    root = lab_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def cache_root() -> Path:
    return Path(os.environ.get("GPUFORGE_CACHE_DIR", "/var/cache/gpuforge"))


def validate_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise UserError(
            f"lab name {name!r} is invalid: use 1-12 characters, lower-case letters, digits and '-', "
            "starting with a letter"
        )
    return name


@dataclass
class HostState:
    name: str  # the host's own hostname
    ip: str
    role: str  # HeadNode | Compute
    instance_type: str
    queue: str | None = None
    compute_resource: str | None = None
    netns: str = ""
    veth: str = ""
    pid: int | None = None
    instance_id: str | None = None
    # The host's own cgroup directories (gpuforge_lab.cgroup), removed when it stops.
    cgroups: list[str] = field(default_factory=list)


@dataclass
class LabState:
    name: str
    index: int
    cluster_name: str
    subnet_prefix: str  # e.g. "10.213.7" (a /24)
    bridge: str
    ssh_user: str
    ssh_key: str
    hosts: list[HostState] = field(default_factory=list)
    moto_port: int | None = None
    moto_pid: int | None = None
    proxy_port: int | None = None
    proxy_pid: int | None = None
    artifacts_pid: int | None = None
    # The lab image the hosts booted from (`lab up --image`); None: the Debian rootfs.
    image: str | None = None

    @property
    def artifacts_dir(self) -> Path:
        return self.directory / "artifacts"

    @property
    def gateway(self) -> str:
        return f"{self.subnet_prefix}.1"

    @property
    def directory(self) -> Path:
        return lab_root() / self.name

    @property
    def moto_url(self) -> str | None:
        return f"http://127.0.0.1:{self.moto_port}" if self.moto_port else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LabState:
        hosts = [HostState(**h) for h in data.pop("hosts")]
        return cls(hosts=hosts, **data)


def state_path(name: str) -> Path:
    return lab_root() / name / "state.json"


def load(name: str) -> LabState | None:
    path = state_path(name)
    if not path.exists():
        return None
    return LabState.from_json(json.loads(path.read_text()))


def save(state: LabState) -> Path:
    path = state_path(state.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state.to_json(), indent=2) + "\n")
    tmp.replace(path)
    return path


def used_indexes() -> set[int]:
    root = lab_root()
    if not root.is_dir():
        return set()
    indexes = set()
    for path in root.glob("*/state.json"):
        indexes.add(int(json.loads(path.read_text())["index"]))
    return indexes


def allocate_index() -> int:
    used = used_indexes()
    for index in range(1, 250):
        if index not in used:
            return index
    raise UserError(
        "no free lab subnet: 249 labs are up; bring some down with `gpuforge-lab down --name NAME`"
    )
