"""The product package's layers: the AMI pipeline (gpuforge.ami) imports the cluster-config commands
(gpuforge.pcluster: its config editing, rollout and validation), never the other way, directly or through
another gpuforge module, so there is no import cycle between them; what both need lives below both, and
no product module imports the checkout's test doubles (gpuforge_lab). The collection's Python is split
as Ansible ships it: controller code in plugins/plugin_utils, code a module carries to the managed host
in plugins/module_utils; the CLI imports the collection's names from the collection, under one name
(no gpuforge module re-exports them). Read from the source's imports (ast), so a function-level import
counts as much as a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpuforge.amiid import check_ami_id, is_ami_id
from gpuforge.errors import UserError

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "scripts" / "gpuforge"
# The repository root is the collection gpuforge.gpu.
COLLECTION = "ansible_collections.gpuforge.gpu"
PLUGINS = REPO / "plugins"
# Python that imports the CLI's modules: the product, its tests and the checkout's doubles.
PYTHON_TREES = ("scripts", "tests", "lab", "bench", "molecule", "plugins")
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


def _collection_module(path: Path) -> str:
    """plugins/module_utils/x.py -> ansible_collections.gpuforge.gpu.plugins.module_utils.x"""
    return ".".join([COLLECTION, *path.relative_to(REPO).with_suffix("").parts])


def _target_code() -> list[Path]:
    """What Ansible runs on a managed host: the collection's modules and the module_utils it ships with
    them. Controller plugins (filter, lookup, inventory, strategy, action) and the CLI run on the
    controller."""
    return sorted(p for d in ("modules", "module_utils") for p in (PLUGINS / d).rglob("*.py"))


def test_module_utils_holds_only_what_target_code_imports() -> None:
    """A module_utils module no module imports is controller code: it belongs in plugins/plugin_utils
    (as amazon.aws keeps its inventory base class there), where ansible-test checks it as controller code
    and no module can come to depend on it."""
    reached = _reached_collection(
        [_collection_module(p) for p in sorted((PLUGINS / "modules").rglob("*.py"))]
    )
    utils = [p for p in sorted((PLUGINS / "module_utils").rglob("*.py")) if p.name != "__init__.py"]
    assert [str(p.relative_to(REPO)) for p in utils if _collection_module(p) not in reached] == []


def _reached_collection(start: list[str]) -> set[str]:
    """The collection modules that importing `start` loads (its imports, followed)."""
    files = {_collection_module(p): p for p in PLUGINS.rglob("*.py")}
    reached: set[str] = set()
    todo = list(start)
    while todo:
        name = todo.pop()
        if name in reached or name not in files:
            continue
        reached.add(name)
        todo.extend(_imports(files[name]))
    return reached


def test_target_code_imports_no_controller_code() -> None:
    """Modules and module_utils import of the collection only module_utils: Ansible ships a module with
    the module_utils it imports, never plugin_utils or a controller plugin."""
    shipped = f"{COLLECTION}.plugins.module_utils"
    offenders = [
        f"{path.relative_to(REPO)}: {name}"
        for path in _target_code()
        for name in sorted(_imports(path))
        if name.startswith(COLLECTION + ".") and not name.startswith(shipped)
    ]
    assert offenders == []


def test_controller_plugins_take_the_collection_code_from_plugin_utils() -> None:
    """The filters are the roles' way into the decisions; they import them from plugin_utils."""
    filters = sorted((PLUGINS / "filter").glob("*.py"))
    importing = [p.name for p in filters if any(n.startswith(f"{COLLECTION}.plugins.") for n in _imports(p))]
    assert importing, "no filter imports the collection's code: the scan is looking in the wrong place"
    controller = f"{COLLECTION}.plugins.plugin_utils"
    offenders = [
        f"{path.relative_to(REPO)}: {name}"
        for path in filters
        for name in sorted(_imports(path))
        if name.startswith(f"{COLLECTION}.plugins.") and not name.startswith(controller)
    ]
    assert offenders == []


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """The module's own statements, with those under a top-level `if` (TYPE_CHECKING, try/except)."""
    body: list[ast.stmt] = []
    for node in tree.body:
        body.append(node)
        if isinstance(node, ast.If | ast.Try):
            body.extend(node.body)
            body.extend(node.orelse)
    return body


def _root(node: ast.expr) -> str | None:
    """`a` of `a`, `a.b`, `a.b.c`; None for anything else (a call, a literal)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _collection_names(path: Path) -> tuple[set[str], set[str]]:
    """The names a module binds to something of the collection: imported from it, and assigned a
    collection name as it is (`HASH_TAG = _rules.VERSIONS_HASH_TAG`: an alias)."""
    imported: set[str] = set()
    aliases: set[str] = set()
    for node in _top_level(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith(COLLECTION)
        ):
            imported.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.asname for a in node.names if a.name.startswith(COLLECTION) and a.asname)
    for node in _top_level(ast.parse(path.read_text())):
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if value is not None and _root(value) in imported | aliases:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            aliases.update(t.id for t in targets if isinstance(t, ast.Name))
    return imported, aliases


def _exported(path: Path) -> set[str]:
    """The names a module lists in __all__."""
    for node in _top_level(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {
                e.value
                for e in ast.walk(node.value)
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            }
    return set()


def test_no_cli_module_gives_a_collection_name_a_second_name() -> None:
    """The CLI uses the collection's decisions as the roles do, from the collection: a gpuforge module
    neither exports a name it imported from the collection nor binds one to a name of its own."""
    offenders: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        imported, aliases = _collection_names(path)
        where = path.relative_to(REPO)
        offenders += [f"{where}: exports {name}" for name in sorted(_exported(path) & (imported | aliases))]
        offenders += [f"{where}: {name} is a second name for the collection's" for name in sorted(aliases)]
    assert offenders == []


def _gpuforge_modules(tree: ast.Module, files: dict[str, Path]) -> dict[str, str]:
    """Local name -> the gpuforge module it is bound to (`from gpuforge import versions`,
    `import gpuforge.versions as v`, `from gpuforge.ami import bake`)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in files:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in files:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            bound.update({a.asname: a.name for a in node.names if a.asname and a.name in files})
    return bound


def test_nothing_takes_a_collection_name_from_a_cli_module() -> None:
    """Who needs the collection's policy, manifest reader or targets imports them from the collection,
    not through a gpuforge module that happens to have imported them (one name for one thing)."""
    files = _module_files()
    borrowed = {name: set().union(*_collection_names(path)) for name, path in files.items()}
    assert any(borrowed.values()), (
        "no gpuforge module imports the collection: the scan looks in the wrong place"
    )
    offenders: list[str] = []
    for tree_name in PYTHON_TREES:
        for path in sorted((REPO / tree_name).rglob("*.py")):
            tree = ast.parse(path.read_text())
            local = _gpuforge_modules(tree, files)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in borrowed:
                    taken = {a.name for a in node.names} & borrowed[node.module]
                    offenders += [f"{path.relative_to(REPO)}: {node.module}.{n}" for n in sorted(taken)]
                elif (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in local
                    and node.attr in borrowed.get(local[node.value.id], set())
                ):
                    offenders.append(
                        f"{path.relative_to(REPO)}:{node.lineno}: {local[node.value.id]}.{node.attr}"
                    )
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
