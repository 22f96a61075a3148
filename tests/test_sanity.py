"""The collection as `ansible-test sanity` sees it, and the offline pip bootstrap that runs it.

`make lint` runs the sanity tests themselves on the built collection (scripts/ci/sanity.py run);
these check, cheaply, what that run relies on: what the build ships, the ignore file's reasons,
that ansible-test's pip bootstrap works from the wheelhouse alone, and the optional strategy
plugin without its optional package.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from ansible.errors import AnsibleError
from ansible.plugins.strategy import StrategyBase

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts" / "ci"))

import sanity  # noqa: E402


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The files in the collection tarball ansible-galaxy builds from this checkout."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-galaxy"),
            "collection",
            "build",
            "--output-path",
            str(out),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        cwd=out,
    )
    (tarball,) = out.glob("*.tar.gz")
    with tarfile.open(tarball) as tar:
        return [member.name for member in tar.getmembers() if member.isfile()]


def test_build_ships_the_ignore_file_and_no_test_suite(shipped: list[str]) -> None:
    """ansible-test reads tests/sanity/ from the collection it checks; suite, lab and CLI stay out."""
    ignores = sorted(p.name for p in (REPO / "tests" / "sanity").glob("ignore-*.txt"))
    assert ignores
    assert sorted(p for p in shipped if p.startswith("tests/") and not p.endswith("/")) == [
        f"tests/sanity/{name}" for name in ignores
    ]
    for top in ("bench", "lab", "scripts", "molecule", ".cache", ".venv"):
        assert not [p for p in shipped if p == top or p.startswith(f"{top}/")], top
    # What the roles read through the gpuforge.gpu.data_file lookup at run time.
    assert {"versions.yml", "data/instance_types.yml", "meta/runtime.yml"} <= set(shipped)


def test_every_ignore_names_why_the_rule_does_not_apply() -> None:
    for path in (REPO / "tests" / "sanity").glob("ignore-*.txt"):
        for line in path.read_text().splitlines():
            entry, _hash, reason = line.partition(" # ")
            assert len(entry.split(" ")) == 2, line
            assert len(reason.split()) >= 4, f"{path.name}: give the reason after ' # ': {line}"
            assert (REPO / entry.split(" ")[0]).is_file(), line


@pytest.mark.slow  # a virtualenv and a pip install: about 5 s of CPU
def test_ansible_test_pip_bootstrap_works_from_the_wheelhouse(tmp_path: Path) -> None:
    """The get-pip stand-in, run as ansible-test runs it in a new virtualenv, installs pip offline."""
    assert not sanity.missing_wheels(), "run `make setup`: it downloads the sanity wheels"
    home = tmp_path / "home"
    sanity.prepare_home(home)
    pip = sanity.bootstrap_pip_version()
    # The cache path and arguments of ansible_test/_util/target/setup/requirements.py, bootstrap().
    script = home / ".ansible" / "test" / "cache" / f"get_pip_{pip.replace('.', '_')}.py"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    args = ["--disable-pip-version-check", f"pip=={pip}", "--no-setuptools", "--no-wheel"]
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    subprocess.run([python, str(script), *args], check=True, capture_output=True, env=env)
    version = subprocess.run(
        [python, "-m", "pip", "--version"], check=True, capture_output=True, text=True, env=env
    )
    assert version.stdout.startswith(f"pip {pip} ")
    # Every later pip in HOME (the test requirements) reads the offline configuration.
    config = subprocess.run(
        [python, "-m", "pip", "config", "list"], check=True, capture_output=True, text=True, env=env
    )
    assert "global.no-index='true'" in config.stdout
    assert f"global.find-links='{sanity.WHEELS}'" in config.stdout


def _documentation(path: Path) -> Any:
    if path.suffix == ".yml":
        return yaml.safe_load(path.read_text())["DOCUMENTATION"]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["DOCUMENTATION"]:
            assert isinstance(node.value, ast.Constant)
            return yaml.safe_load(node.value.value)
    return None


def _descriptions(doc: Any) -> list[object]:
    found: list[object] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key in ("description", "short_description"):
                found += value if isinstance(value, list) else [value]
            else:
                found += _descriptions(value)
    elif isinstance(doc, list):
        for item in doc:
            found += _descriptions(item)
    return found


# An action plugin's documentation is its plugins/modules file; plugin_utils holds no plugins.
PLUGIN_DOCS = sorted(
    p
    for p in (REPO / "plugins").glob("*/*")
    if p.suffix in (".py", ".yml") and p.parent.name not in ("action", "plugin_utils")
)


@pytest.mark.parametrize("path", PLUGIN_DOCS, ids=lambda p: str(p.relative_to(REPO / "plugins")))
def test_plugin_descriptions_are_text(path: Path) -> None:
    """A plain YAML scalar with ': ' in it is a mapping, which ansible-doc cannot render (the full
    check is ansible-test's ansible-doc test in make lint; this one costs no virtualenv)."""
    doc = _documentation(path)
    if doc is None:
        assert path.parent.name == "filter", f"{path.name}: no DOCUMENTATION"  # the .yml holds it
        return
    assert [d for d in _descriptions(doc) if not isinstance(d, str)] == []


def _strategy_without_mitogen(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    for name in ("ansible_mitogen", "ansible_mitogen.plugins.strategy.mitogen_linear"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: the import fails
    spec = importlib.util.spec_from_file_location(
        "gpuforge_test_mitogen_linear", REPO / "plugins/strategy/mitogen_linear.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mitogen_strategy_loads_without_mitogen_and_refuses_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """ansible-doc and the import sanity test load it; a play that picks it fails saying what to install."""
    module = _strategy_without_mitogen(monkeypatch)
    # Ansible's strategy loader takes only StrategyBase subclasses (else: "invalid play strategy").
    assert issubclass(module.StrategyModule, StrategyBase)
    with pytest.raises(AnsibleError, match=r"needs the mitogen package.*pip install 'gpuforge\[mitogen\]'"):
        module.StrategyModule(None)
