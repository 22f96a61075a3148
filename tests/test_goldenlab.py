"""tests/goldenlab.py without a lab: the shared image's key and the record it is reused by."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import goldenlab
import labtools
from gpuforge_lab import images as lab_images


def test_the_image_name_is_a_valid_lab_image_name_keyed_by_this_tree() -> None:
    name = goldenlab.image_name()
    assert lab_images.validate_name(name) == name
    assert name == goldenlab.PREFIX + goldenlab.tree_digest()


def test_every_input_exists_so_none_is_silently_left_out_of_the_key() -> None:
    assert [top for top in goldenlab.INPUTS if not (labtools.REPO / top).exists()] == []


def test_the_key_follows_every_file_the_bake_is_made_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "roles" / "efa" / "tasks").mkdir(parents=True)
    task = tmp_path / "roles" / "efa" / "tasks" / "main.yml"
    task.write_text("---\n")
    (tmp_path / "versions.yml").write_text("pins: 1\n")
    monkeypatch.setattr(labtools, "REPO", tmp_path)
    monkeypatch.setattr(goldenlab, "INPUTS", ("versions.yml", "roles"))
    first = goldenlab.tree_digest()
    assert goldenlab.tree_digest() == first
    (tmp_path / "roles" / "efa" / "__pycache__").mkdir()
    (tmp_path / "roles" / "efa" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert goldenlab.tree_digest() == first  # bytecode is not an input
    task.write_text("--- # changed\n")
    changed = goldenlab.tree_digest()
    assert changed != first
    task.rename(task.with_name("other.yml"))  # the same bytes under another name
    assert goldenlab.tree_digest() not in (first, changed)
    (tmp_path / "versions.yml").write_text("pins: 2\n")
    assert len({first, changed, goldenlab.tree_digest()}) == 3


def _record(image: str, returncode: int) -> Path:
    directory = goldenlab.record_dir(image)
    directory.mkdir(parents=True)
    path = directory / goldenlab.RECORD
    path.write_text(json.dumps({"image": image, "returncode": returncode, "run_dir": "/r", "lab_vars": "/v"}))
    return path


def test_a_record_is_reused_only_with_its_image_and_a_failure_only_for_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUFORGE_CACHE_DIR", str(tmp_path))
    _record("pytest-golden-ok", 0)
    assert goldenlab._read("pytest-golden-ok") is None  # its image was removed: bake again
    (tmp_path / "images" / "pytest-golden-ok").mkdir()
    (tmp_path / "images" / "pytest-golden-ok" / lab_images.METADATA).write_text("{}")
    found = goldenlab._read("pytest-golden-ok")
    assert found is not None and found["run_dir"] == Path("/r")

    failed = _record("pytest-golden-failed", 2)
    assert goldenlab._read("pytest-golden-failed") is not None  # every caller of this run sees it
    old = time.time() - goldenlab.FAILURE_REUSE_S - 1
    os.utime(failed, (old, old))
    assert goldenlab._read("pytest-golden-failed") is None  # a later run bakes again
