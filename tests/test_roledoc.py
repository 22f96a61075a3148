"""Role README variable tables are generated from meta/argument_specs.yml and kept in sync."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuforge import roledoc

SPECS = """\
argument_specs:
  main:
    short_description: Example role.
    options:
      example_port:
        type: int
        default: 9400
        description: Port to listen on.
      example_mode:
        type: str
        choices: [open, proprietary]
        description: Which module.
      example_token:
        type: str
        required: true
        description: A secret | with a pipe.
"""


@pytest.fixture
def role(tmp_path: Path) -> Path:
    (tmp_path / "meta").mkdir()
    (tmp_path / "defaults").mkdir()
    (tmp_path / "meta" / "argument_specs.yml").write_text(SPECS)
    (tmp_path / "defaults" / "main.yml").write_text("---\nexample_mode: open\n")
    return tmp_path


def test_render_lists_every_option(role: Path) -> None:
    table = roledoc.render(role)
    assert "| `example_port` | int | `9400` | Port to listen on. |" in table
    assert "| `example_mode` | str (`open`, `proprietary`) | `open` | Which module. |" in table
    assert "| `example_token` | str | required | A secret \\| with a pipe. |" in table


def test_update_replaces_only_between_markers(role: Path) -> None:
    readme = role / "README.md"
    readme.write_text(
        f"# example\n\nProse stays.\n\n{roledoc.BEGIN}\nold table\n{roledoc.END}\n\nMore prose.\n"
    )
    new = roledoc.update(readme, roledoc.render(role))
    assert new is not None
    assert new.startswith("# example\n\nProse stays.\n\n")
    assert new.endswith("\n\nMore prose.\n")
    assert "old table" not in new


def test_update_refuses_a_readme_without_markers(role: Path) -> None:
    (role / "README.md").write_text("# example\n")
    assert roledoc.update(role / "README.md", roledoc.render(role)) is None


def test_every_role_readme_is_current() -> None:
    """The repository gate: run `python -m gpuforge.roledoc` after changing an argument spec."""
    assert roledoc.main(["--check"]) == 0
