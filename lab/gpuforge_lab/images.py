"""Lab images: a baked lab host's whole disk kept so new hosts boot from it (the lab's AMI).

`gpuforge-lab bake --save-image NAME` (or `lab image save`) stops the baked host, as EC2
stops an instance to snapshot it, and copies the host's merged tree (its overlay over the tree it
booted from) into `<cache>/images/NAME/rootfs`. A flattened copy, not the overlay's upper layer:
the image then depends on no other tree, holds no overlay whiteouts, and can be inspected as a
plain directory (the sanitized-image verifier runs testinfra on it through chroot). A lab started
with `lab up --image NAME` boots every host from that tree, read-only under each host's own
writable layer, exactly as it boots from the Debian rootfs otherwise.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpuforge.errors import ExternalError, UserError
from gpuforge_lab import host, system
from gpuforge_lab.rootfs import SSH_USER
from gpuforge_lab.state import HostState, LabState, cache_root

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[a-z][a-z0-9._-]{0,62}$")
METADATA = "image.json"


@dataclass(frozen=True)
class ImageInfo:
    name: str
    created: str  # UTC, ISO 8601
    source_lab: str
    source_host: str
    # The versions hash of the stack baked into it (/etc/gpuforge/manifest.json), "" if none.
    versions_hash: str
    # True when nothing host-specific is left: no SSH host or login keys, an empty machine-id.
    sanitized: bool
    size_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def read(cls, path: Path) -> ImageInfo | None:
        """The metadata at `path`, or None when it is unreadable or not an image's.

        Keys this version does not know (written by a newer gpuforge) are ignored, so one odd
        image never breaks listing the others or naming them in an error.
        """
        try:
            data = json.loads(path.read_text())
            known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
            return cls(**known)
        except (OSError, ValueError, TypeError) as exc:
            log.warning("ignoring unreadable lab image metadata %s: %s", path, exc)
            return None


def images_root() -> Path:
    return cache_root() / "images"


def validate_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise UserError(
            f"image name {name!r} is invalid: use 1-63 characters, lower-case letters, digits, '.', '_' "
            "and '-', starting with a letter"
        )
    return name


def require_new(name: str) -> str:
    """A valid name no image has yet (checked before a bake, so the bake is not wasted)."""
    if (images_root() / validate_name(name)).exists():
        raise UserError(f"lab image {name!r} already exists; remove it with `gpuforge-lab image rm {name}`")
    return name


def rootfs(name: str) -> Path:
    """The tree hosts of `lab up --image NAME` boot from; a UserError naming the images if absent."""
    directory = images_root() / validate_name(name)
    if not (directory / METADATA).is_file():
        known = ", ".join(info.name for info in list_images()) or "none"
        raise UserError(
            f"no lab image {name!r} (images here: {known}); make one with "
            "`gpuforge-lab bake --save-image NAME` or `gpuforge-lab image save`"
        )
    return directory / "rootfs"


def load(name: str) -> ImageInfo:
    path = rootfs(name).parent / METADATA
    info = ImageInfo.read(path)
    if info is None:
        raise UserError(
            f"lab image {name!r} has unreadable metadata ({path}); "
            f"remove it with `gpuforge-lab image rm {name}`"
        )
    return info


def list_images() -> list[ImageInfo]:
    root = images_root()
    if not root.is_dir():
        return []
    found = (
        ImageInfo.read(path / METADATA) for path in sorted(root.iterdir()) if (path / METADATA).is_file()
    )
    return [info for info in found if info is not None]


def remove(name: str) -> None:
    directory = rootfs(name).parent
    shutil.rmtree(directory)


def in_use(image: Path) -> bool:
    """Whether a mounted filesystem (a lab host's overlay) uses the image directory's tree."""
    try:
        mounts = Path("/proc/self/mounts").read_text()
    except OSError:
        return True  # cannot tell: keep it
    return f"{image}/" in mounts


def is_sanitized(tree: Path) -> bool:
    """What packer/scripts/sanitize.sh guarantees, read back from a tree."""
    machine_id = tree / "etc/machine-id"
    return (
        not list((tree / "etc/ssh").glob("ssh_host_*"))
        and not (tree / "root/.ssh/authorized_keys").exists()
        and not list((tree / "home").glob("*/.ssh/authorized_keys"))
        and (not machine_id.exists() or machine_id.read_text().strip() == "")
    )


def _versions_hash(tree: Path) -> str:
    manifest = tree / "etc/gpuforge/manifest.json"
    if not manifest.is_file():
        return ""
    return str(json.loads(manifest.read_text()).get("versions_hash", ""))


def _size(tree: Path) -> int:
    result = system.run(["du", "--summarize", "--bytes", "--one-file-system", str(tree)])
    return int(result.stdout.split()[0])


def capture(lab: LabState, node: HostState, name: str, lower: Path) -> ImageInfo:
    """Stop `node` and copy its merged tree (its writable layer over `lower`) into image `name`."""
    final = images_root() / require_new(name)
    upper = host.host_dir(lab, node) / "upper"
    if not upper.is_dir():
        raise ExternalError(f"host {node.name} has no writable layer at {upper}")
    # A consistent disk: the host powers off (systemd stops its services, flushes) first.
    host.stop(lab, node)
    partial = final.with_name(f".{name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    mnt = partial / "mnt"
    tree = partial / "rootfs"
    mnt.mkdir(parents=True)
    # The host's layer as the upper of two read-only lower layers: the merged view, whiteouts applied.
    system.run(["mount", "-t", "overlay", "overlay", "-o", f"ro,lowerdir={upper}:{lower}", str(mnt)])
    try:
        started = time.monotonic()
        system.run(["cp", "--archive", "--one-file-system", f"{mnt}/.", str(tree)])
        log.info("copied %s's tree into image %s in %.1fs", node.name, name, time.monotonic() - started)
    finally:
        system.run(["umount", str(mnt)])
    mnt.rmdir()
    if not (tree / "home" / SSH_USER).is_dir():
        raise ExternalError(f"host {node.name}'s tree has no /home/{SSH_USER}: not a lab host tree")
    info = ImageInfo(
        name=name,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        source_lab=lab.name,
        source_host=node.name,
        versions_hash=_versions_hash(tree),
        sanitized=is_sanitized(tree),
        size_bytes=_size(tree),
    )
    (partial / METADATA).write_text(json.dumps(info.to_json(), indent=2) + "\n")
    partial.rename(final)
    if not info.sanitized:
        log.warning(
            "image %s still holds host-specific state (SSH keys or a machine-id); hosts started from it "
            "share them. Bake with `gpuforge-lab bake` so sanitize.sh runs first.",
            name,
        )
    return info
