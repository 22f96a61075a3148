"""The design of record is the repository's own docs/architecture.md (issue 36 S, item 3).

Nothing in the project cites a file outside it (a design note of the team's, a sibling checkout, a
path on one machine), every `docs/architecture.md#section` the code cites is a heading there, and the
page's own links and the repository paths it names exist, so it cannot drift from the code silently.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "architecture.md"
# Where a file of the project is never found: the checkout's metadata, its venv, its build caches.
SKIPPED_DIRS = {".git", ".venv", ".cache"}
# What cites a file outside the repository: the team's design note (by name, or as "DESIGN: x"),
# a sibling directory reached through ../shared, an absolute path under /work/.
# Keyed by a name, not the path itself: the test ids (and the CI record that keys on them) cite nothing.
OUTSIDE = {
    "design-doc": ("DESIGN.md", re.compile(r"\bDESIGN(?:\.md\b|: )")),
    "shared-dir": ("../shared", re.compile(r"(?<![\w.])(?:\.\./)+shared\b")),
    "work-dir": ("/work/", re.compile(r"(?<![\w.~-])/work/")),
}
CITATION = re.compile(r"docs/architecture\.md#([A-Za-z0-9_-]+)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
# A Markdown link to a page or section of the repository: [text](target), target not a URL.
LINK = re.compile(r"\]\((?!https?://|mailto:)([^)\s]+)\)")
# A repository path in backquotes: a relative path with a folder, optionally a glob.
PATH = re.compile(r"`((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.*-]*)`")


def project_files() -> list[Path]:
    """The project's files: what git tracks or would track (ignored build output and caches left out);
    outside a git checkout, every file but those under SKIPPED_DIRS and caches."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\0")
    except (OSError, subprocess.CalledProcessError):
        listed = [
            str(p.relative_to(REPO))
            for p in REPO.rglob("*")
            if p.is_file()
            and not SKIPPED_DIRS.intersection(p.relative_to(REPO).parts)
            and not any(part.endswith("_cache") or part == "__pycache__" for part in p.parts)
        ]
    paths = (REPO / name for name in listed if name)
    return sorted(p for p in paths if p.is_file() and not p.is_symlink())


def text_of(path: Path) -> str | None:
    """The file as text, or None for a binary one (an image, an archive)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, code marks and punctuation dropped, spaces
    to hyphens."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "").strip().lower())
    return re.sub(r"\s", "-", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {slug(h) for h in HEADING.findall(text)}


PROJECT = [p for p in project_files() if p != Path(__file__).resolve()]
TEXTS = {p: t for p in PROJECT if (t := text_of(p)) is not None}


def test_the_scan_sees_the_project() -> None:
    """The scans below read the roles, plugins, CLI and docs (a listing that found nothing would pass)."""
    names = {str(p.relative_to(REPO)) for p in TEXTS}
    expected = {"docs/architecture.md", "plugins/plugin_utils/fast_path.py", "roles/efa/tasks/install.yml"}
    assert expected <= names
    assert len(names) > 300


@pytest.mark.parametrize("what", sorted(OUTSIDE))
def test_nothing_cites_a_file_outside_the_repository(what: str) -> None:
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path, text in TEXTS.items()
        for number, line in enumerate(text.splitlines(), 1)
        if OUTSIDE[what][1].search(line)
    ]
    advice = f"cites {OUTSIDE[what][0]}, outside the repository; cite docs/architecture.md instead"
    assert not found, advice + ":\n" + "\n".join(found)


def test_every_cited_architecture_section_exists() -> None:
    sections = anchors(ARCHITECTURE)
    cited = {
        (str(path.relative_to(REPO)), anchor)
        for path, text in TEXTS.items()
        for anchor in CITATION.findall(text)
    }
    assert cited, "nothing cites docs/architecture.md"
    missing = sorted(f"{where}: #{anchor}" for where, anchor in cited if anchor not in sections)
    advice = f"no such heading in docs/architecture.md (it has {sorted(sections)})"
    assert not missing, advice + ":\n" + "\n".join(missing)


def test_the_architecture_page_links_resolve() -> None:
    """Its links to its own sections and to the other pages (and their sections) land."""
    broken = []
    for target in LINK.findall(ARCHITECTURE.read_text()):
        name, _, anchor = target.partition("#")
        page = (ARCHITECTURE.parent / name).resolve() if name else ARCHITECTURE
        if not page.is_file():
            broken.append(f"{target}: no file {name}")
        elif anchor and page.suffix == ".md" and anchor not in anchors(page):
            broken.append(f"{target}: no heading #{anchor} in {page.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def test_the_paths_the_architecture_page_names_exist() -> None:
    """A module or role moved without the design of record following it fails here."""
    text = ARCHITECTURE.read_text()
    named = [p for p in PATH.findall(text) if (REPO / p.split("/")[0]).is_dir()]
    assert named, "the page names no repository path"
    missing = sorted({p for p in named if not any(REPO.glob(p.rstrip("/")))})
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
