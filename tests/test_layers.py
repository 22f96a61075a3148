"""The product package's layers: the AMI pipeline (gpuforge.ami) imports the cluster-config commands
(gpuforge.pcluster: its config editing, rollout and validation), never the other way, directly or through
another gpuforge module, so there is no import cycle between them; what both need lives below both, and
no product module imports the checkout's test doubles (gpuforge_lab). Read from the source's imports
(ast), so a function-level import counts as much as a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpuforge.amiid import check_ami_id, is_ami_id
from gpuforge.errors import UserError

PACKAGE = Path(__file__).resolve().parents[1] / "scripts" / "gpuforge"
# Below both ami and pcluster: the AMI-id check, reading one image, and whether it may be rolled out.
SHARED = ("amiid.py", "image.py", "fitness.py")


def _imports(path: Path) -> set[str]:
    """Every module the file imports (`from gpuforge import x` counts as gpuforge.x)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _importers(package: str, target: str) -> list[str]:
    """Files of the product subpackage `package` that import anything of `target`."""
    return [
        str(path.relative_to(PACKAGE))
        for path in sorted((PACKAGE / package).rglob("*.py"))
        if any(name == target or name.startswith(target + ".") for name in _imports(path))
    ]


def _module_files() -> dict[str, Path]:
    """Each product module's dotted name and file (a package is its __init__.py)."""
    files: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _reached(start: list[str], files: dict[str, Path]) -> set[str]:
    """The product modules that importing `start` loads: their imports, followed, with the packages
    above each module (importing gpuforge.x.y runs gpuforge/x/__init__.py too)."""
    reached: set[str] = set()
    todo = list(start)
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        parts = name.split(".")
        above = [".".join(parts[:n]) for n in range(1, len(parts))]
        todo.extend(m for m in [*above, *_imports(files[name])] if m in files)
    return reached


def test_pcluster_does_not_import_the_ami_pipeline() -> None:
    assert _importers("pcluster", "gpuforge.ami") == []


def test_pcluster_reaches_no_ami_module_through_another_so_there_is_no_cycle() -> None:
    files = _module_files()
    pcluster = [name for name in files if name.split(".")[:2] == ["gpuforge", "pcluster"]]
    assert pcluster
    reached = _reached(pcluster, files)
    assert sorted(name for name in reached if name.split(".")[:2] == ["gpuforge", "ami"]) == []


def test_what_ami_and_pcluster_share_imports_neither() -> None:
    for name in SHARED:
        above = ("gpuforge.ami", "gpuforge.pcluster")
        imported = _imports(PACKAGE / name)
        assert not [m for m in imported for a in above if m == a or m.startswith(a + ".")], name


def test_the_ami_id_check_is_written_once() -> None:
    defining = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if any(
            isinstance(node, ast.FunctionDef) and node.name in {"check_ami_id", "is_ami_id"}
            for node in ast.walk(ast.parse(path.read_text()))
        )
    ]
    assert defining == ["amiid.py"]


def test_no_product_module_imports_the_test_doubles() -> None:
    doubles = ("gpuforge_lab", "gpuforge.lab", "gpuforge.artifacts", "gpuforge.bench")
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if any(name == d or name.startswith(d + ".") for name in _imports(path) for d in doubles)
    ]
    assert offenders == []


@pytest.mark.parametrize("ami", ["ami-0123abcd", "ami-0123456789abcdef0"])
def test_ami_ids_of_both_lengths_pass(ami: str) -> None:
    assert is_ami_id(ami) and check_ami_id(ami) == ami


@pytest.mark.parametrize(
    "value", ["", "ami-", "ami-0123abc", "ami-0123456789ABCDEF0", "ami-0123456789abcdef01", "i-0123abcd", 7]
)
def test_anything_else_is_refused(value: object) -> None:
    assert not is_ami_id(value)
    with pytest.raises(UserError, match="invalid AMI id"):
        check_ami_id(value)  # type: ignore[arg-type]
