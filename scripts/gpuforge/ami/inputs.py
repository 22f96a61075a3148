"""One hash of everything a bake runs, for the image tag a bake writes and for `rebuild --if-stale`.

A bake runs the pins (versions.yml), the playbooks and roles with the collection's plugins, the data
files the roles read (data/), Ansible's configuration and the collections it installs, and the Packer
templates with their scripts. A change to any of them makes the published image stale, not only a
change of a pin. Documentation (*.md, e.g. the generated role READMEs) runs nowhere and is left out.

In a git checkout (the scheduled pipeline's case) the files are the tracked ones under these paths, read
from the working tree; elsewhere (an installed wheel, whose collection carries the same files) every
file under them. The hash covers each file's path and content, in path order, so it does not depend on
the order the file system lists them in, on timestamps or on the checkout's location.
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Iterable
from pathlib import Path

from gpuforge import paths

# Paths relative to the share root; a directory stands for every file below it, a pattern for the
# files it matches (git pathspec and Path.glob agree on these simple ones).
INPUTS = (
    "ansible.cfg",
    "requirements.yml",
    "versions.yml",
    "meta/runtime.yml",
    "data",
    "playbooks",
    "plugins",
    "roles",
    "packer/scripts",
    "packer/*.pkr.hcl",
    "packer/*.pkr.hcl.modern",
)
_SKIPPED_SUFFIXES = (".md", ".pyc")


def _runs(relative: str) -> bool:
    return not relative.endswith(_SKIPPED_SUFFIXES) and "/__pycache__/" not in f"/{relative}"


def _git(root: Path, *args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, check=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def _tracked(root: Path) -> list[str] | None:
    """Tracked files under INPUTS (paths relative to root), or None when root is not the top of a git work
    tree (a wheel installed into a virtualenv inside a checkout is not the checkout)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != root.resolve():
        return None
    listed = _git(root, "ls-files", "-z", "--", *INPUTS)
    return None if listed is None else [name for name in listed.split("\0") if name]


def _walked(root: Path) -> list[str]:
    found: set[str] = set()
    for spec in INPUTS:
        matches = [root / spec] if (root / spec).exists() else list(root.glob(spec))
        for match in matches:
            candidates: Iterable[Path] = match.rglob("*") if match.is_dir() else [match]
            found.update(p.relative_to(root).as_posix() for p in candidates if p.is_file())
    return sorted(found)


def files(root: Path | None = None) -> list[str]:
    """The files a bake runs, relative to root (default: the share root), sorted."""
    root = root or paths.share_root()
    listed = _tracked(root)
    if listed is None:
        listed = _walked(root)
    # A tracked file deleted in the working tree is not baked either.
    return sorted(name for name in set(listed) if _runs(name) and (root / name).is_file())


def digest(root: Path | None = None) -> str:
    """sha256 over each bake input's path and content (see the module docstring)."""
    root = root or paths.share_root()
    outer = hashlib.sha256()
    for name in files(root):
        content = hashlib.sha256((root / name).read_bytes()).hexdigest()
        outer.update(f"{name}\0{content}\n".encode())
    return outer.hexdigest()
