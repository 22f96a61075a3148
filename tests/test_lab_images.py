"""Lab images (the lab's AMIs): capture flattens a host's overlay, names and in-use guards.

`capture` runs for real on scratch trees: an overlay mount (root) over a base tree and a host
layer with a deleted file (an overlay whiteout), a replaced directory (opaque) and a new file.
No container is booted; the boot from an image is covered end to end in test_ami_local_bake.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuforge.errors import UserError
from gpuforge_lab import core, images, state
from gpuforge_lab.rootfs import SSH_USER
from gpuforge_lab.state import HostState, LabState

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mount") is None, reason="overlay mounts need root"
)


@pytest.fixture(autouse=True)
def scratch_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("GPUFORGE_LAB_DIR", str(tmp_path / "labs"))


def _lab(name: str = "imgtest", image: str | None = None) -> LabState:
    return LabState(
        name=name,
        index=7,
        cluster_name="lab",
        subnet_prefix="10.213.7",
        bridge="gf-br7",
        ssh_user=SSH_USER,
        ssh_key="/nonexistent",
        hosts=[
            HostState(name="ip-10-213-7-10", ip="10.213.7.10", role="HeadNode", instance_type="c5n.large")
        ],
        image=image,
    )


@pytest.mark.parametrize("name", ["golden", "g5.bake-2026_12", "a"])
def test_valid_image_names(name: str) -> None:
    assert images.validate_name(name) == name


@pytest.mark.parametrize("name", ["", "Golden", "1st", "has space", "x" * 64, "../escape"])
def test_invalid_image_names(name: str) -> None:
    with pytest.raises(UserError, match="image name"):
        images.validate_name(name)


def test_unknown_image_names_the_known_ones(tmp_path: Path) -> None:
    known = images.images_root() / "golden"
    (known / "rootfs").mkdir(parents=True)
    (known / images.METADATA).write_text(
        json.dumps(images.ImageInfo("golden", "2026-12-03T00:00:00Z", "l", "h", "", True, 1).to_json())
    )
    with pytest.raises(UserError, match=r"no lab image 'silver' \(images here: golden\)"):
        images.rootfs("silver")
    assert images.rootfs("golden") == known / "rootfs"
    with pytest.raises(UserError, match="already exists"):
        images.require_new("golden")


def test_an_image_written_by_another_version_or_broken_does_not_break_listing() -> None:
    newer = images.images_root() / "newer"
    (newer / "rootfs").mkdir(parents=True)
    fields = images.ImageInfo("newer", "t", "l", "h", "", True, 1).to_json()
    (newer / images.METADATA).write_text(json.dumps({**fields, "twin": "dlami-ubuntu2204"}))
    broken = images.images_root() / "broken"
    (broken / "rootfs").mkdir(parents=True)
    (broken / images.METADATA).write_text("{not json")
    assert [info.name for info in images.list_images()] == ["newer"]
    with pytest.raises(UserError, match=r"no lab image 'silver' \(images here: newer\)"):
        images.rootfs("silver")
    with pytest.raises(UserError, match="unreadable metadata"):
        images.load("broken")


def test_lab_up_refuses_an_unknown_image_before_creating_anything() -> None:
    with pytest.raises(UserError, match="no lab image 'nope'"):
        core._validate(core.LabSpec(name="t", nodes=1, image="nope"))
    assert not state.lab_root().exists()


def _tree(root: Path, *, sanitized: bool) -> None:
    (root / "etc/ssh").mkdir(parents=True)
    (root / f"home/{SSH_USER}/.ssh").mkdir(parents=True)
    (root / "etc/machine-id").write_text("" if sanitized else "0123456789abcdef0123456789abcdef\n")
    if not sanitized:
        (root / "etc/ssh/ssh_host_ed25519_key").write_text("private")
        (root / f"home/{SSH_USER}/.ssh/authorized_keys").write_text("ssh-ed25519 AAAA builder")


@pytest.mark.parametrize("sanitized", [True, False])
def test_is_sanitized_reads_what_sanitize_sh_removes(tmp_path: Path, sanitized: bool) -> None:
    _tree(tmp_path, sanitized=sanitized)
    assert images.is_sanitized(tmp_path) is sanitized


@needs_root
def test_capture_flattens_the_host_layer_over_its_base(tmp_path: Path) -> None:
    """Deleted files stay deleted, replaced directories lose their old content, new files appear."""
    base = tmp_path / "base"
    _tree(base, sanitized=True)
    (base / "etc/keep.conf").write_text("from the base\n")
    (base / "etc/removed.conf").write_text("deleted on the host\n")
    (base / "opt/old").mkdir(parents=True)
    (base / "opt/old/stale").write_text("replaced directory content\n")
    lab = _lab()
    node = lab.hosts[0]
    # Build the host's writable layer the way the kernel does: through an overlay mount.
    layer = core.host.host_dir(lab, node)
    upper, work, merged = layer / "upper", layer / "work", layer / "rootfs"
    for path in (upper, work, merged):
        path.mkdir(parents=True)
    subprocess.run(
        [
            "mount",
            "-t",
            "overlay",
            "overlay",
            "-o",
            f"lowerdir={base},upperdir={upper},workdir={work}",
            merged,
        ],
        check=True,
    )
    try:
        (merged / "etc/removed.conf").unlink()
        shutil.rmtree(merged / "opt/old")
        (merged / "opt/old").mkdir()
        (merged / "opt/old/fresh").write_text("new\n")
        (merged / "etc/gpuforge").mkdir()
        (merged / "etc/gpuforge/manifest.json").write_text(json.dumps({"versions_hash": "abc123"}))
        (merged / "etc/gpuforge/manifest.json").chmod(0o640)
    finally:
        subprocess.run(["umount", merged], check=True)
    assert any(p.is_char_device() for p in upper.rglob("*")), "expected an overlay whiteout in the layer"

    info = images.capture(lab, node, "flat", base)

    tree = images.rootfs("flat")
    assert (tree / "etc/keep.conf").read_text() == "from the base\n"
    assert not (tree / "etc/removed.conf").exists()
    assert sorted(p.name for p in (tree / "opt/old").iterdir()) == ["fresh"]
    assert (tree / "etc/gpuforge/manifest.json").stat().st_mode & 0o777 == 0o640
    assert not any(p.is_char_device() for p in tree.rglob("*")), "a whiteout leaked into the image"
    assert (info.name, info.source_host, info.versions_hash, info.sanitized) == (
        "flat",
        node.name,
        "abc123",
        True,
    )
    assert info.size_bytes > 0
    assert [i.name for i in images.list_images()] == ["flat"]
    # Nothing of the copy's working state is left beside the image.
    assert sorted(p.name for p in images.images_root().iterdir()) == ["flat"]


def test_an_image_in_use_is_not_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core.system, "require_root_and_tools", lambda: None)
    directory = images.images_root() / "golden"
    (directory / "rootfs").mkdir(parents=True)
    (directory / images.METADATA).write_text(
        json.dumps(images.ImageInfo("golden", "t", "l", "h", "", True, 1).to_json())
    )
    state.save(_lab("user", image="golden"))
    with pytest.raises(UserError, match="in use by lab"):
        core.remove_image("golden")
    assert directory.exists()
    shutil.rmtree(state.lab_root() / "user")
    core.remove_image("golden")
    assert not directory.exists()
