"""`pip install .` (not editable) gives a gpuforge that works outside the checkout.

The wheel is built from a copy of the project's files, installed into a new virtualenv in a temporary
directory, and its `gpuforge` runs from another temporary directory with no GPUFORGE_ROOT. Its
dependencies are the pinned ones of the development venv, linked in (not downloaded again): what is
tested is the wheel's own code and data.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from gpuforge_lab.moto import MotoServer

REPO = Path(__file__).resolve().parents[1]
DEV_BIN = Path(sys.executable).parent
DEV_SITE = Path(sysconfig.get_paths()["purelib"])
NCCL_LOG = REPO / "tests/fixtures/nccl/adt-p5-2node-srun-label.excerpt.log"
# What the wheel must not carry: the lab and the other test doubles (the checkout's lab/ project), under
# their name today and the names they had inside the product package before.
DOUBLES = ("gpuforge_lab/", "gpuforge/lab/", "gpuforge/artifacts/", "gpuforge/bench/")
DOUBLE_MODULES = ("gpuforge_lab", "gpuforge.lab", "gpuforge.artifacts", "gpuforge.bench")


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, capture_output=True, text=True, check=False, cwd=cwd, env=env or dict(os.environ), timeout=600
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built by pip from a copy of the project's files (the checkout gets no build/)."""
    src = tmp_path_factory.mktemp("src")
    listed = _run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO)
    assert listed.returncode == 0, listed.stderr
    for name in filter(None, listed.stdout.split("\0")):
        path = REPO / name
        if path.is_symlink() or not path.is_file():
            continue
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, src / name)
    dist = tmp_path_factory.mktemp("dist")
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)], cwd=dist
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (found,) = dist.glob("gpuforge-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtualenv with the wheel installed from the local file only."""
    root = tmp_path_factory.mktemp("venv")
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(root)], cwd=root)
    assert made.returncode == 0, made.stderr
    python = root / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root
        ).stdout.strip()
    )
    # The development venv's dependencies, without its own (editable) gpuforge.
    deps = root / "deps"
    deps.mkdir()
    for entry in DEV_SITE.iterdir():
        if (
            not entry.name.lower().startswith(("gpuforge", "__editable__", "_gpuforge"))
            and entry.suffix != ".pth"
        ):
            (deps / entry.name).symlink_to(entry)
    (site / "dev-deps.pth").write_text(f"{deps}\n")
    installed = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            str(wheel),
        ],
        cwd=root,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    return root


@pytest.fixture
def outside(venv: Path, tmp_path: Path) -> dict[str, str]:
    """Environment for commands run outside the checkout: the wheel's bin first, no GPUFORGE_ROOT."""
    env = {k: v for k, v in os.environ.items() if k not in {"GPUFORGE_ROOT", "VIRTUAL_ENV", "PYTHONPATH"}}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), str(DEV_BIN), "/usr/bin", "/bin"])
    return env


def test_the_wheel_carries_the_data_once_and_no_test_doubles(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    share = "ansible_collections/gpuforge/gpu/"
    for path in (
        "versions.yml",
        "data/instance_types.yml",
        "packer/gpuforge.pkr.hcl",
        "playbooks/bake.yml",
        "roles/efa/tasks/main.yml",
        "plugins/lookup/data_file.py",
        # The decisions the CLI and the filters import.
        "plugins/plugin_utils/policy.py",
        "galaxy.yml",
        "ansible.cfg",
    ):
        assert names.count(share + path) == 1, path
    assert not [n for n in names if n.startswith(DOUBLES) or "__pycache__" in n or "/tests/" in n]
    # One copy: nothing of the data under the gpuforge package itself.
    assert not [n for n in names if n.startswith("gpuforge/") and not n.endswith((".py", "py.typed"))]


def test_the_wheel_carries_each_plugin_doc_once(wheel: Path) -> None:
    """A filter's documentation is its own YAML file beside the .py (plugins/filter/<name>.yml); the
    wheel carries each of the checkout's, so ansible-doc documents the installed filters too."""
    names = zipfile.ZipFile(wheel).namelist()
    docs = sorted(str(path.relative_to(REPO)) for path in (REPO / "plugins").rglob("*.yml"))
    assert docs
    share = "ansible_collections/gpuforge/gpu/"
    assert [doc for doc in docs if names.count(share + doc) != 1] == []


def test_the_installed_collection_documents_every_filter(
    venv: Path, outside: dict[str, str], tmp_path: Path
) -> None:
    """ansible-doc of the wheel's collection (found on sys.path; no collections path of the checkout's)
    lists each filter with its short description, none UNDOCUMENTED."""
    empty = tmp_path / "collections"
    empty.mkdir()
    env = {**outside, "ANSIBLE_COLLECTIONS_PATH": str(empty), "ANSIBLE_CONFIG": str(tmp_path / "none.cfg")}
    result = _run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "ansible",
            "doc",
            "-t",
            "filter",
            "-l",
            "gpuforge.gpu",
            "--json",
        ],
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    listed: dict[str, str] = json.loads(result.stdout)
    assert "gpuforge.gpu.version_at_least" in listed
    assert sorted(name for name, text in listed.items() if text == "UNDOCUMENTED") == []


def test_data_files_come_from_the_installed_package(
    venv: Path, outside: dict[str, str], tmp_path: Path
) -> None:
    probe = (
        "import importlib.util, json; from gpuforge import paths, versions; "
        "print(json.dumps({'root': str(paths.share_root()), 'hash': versions.load().digest, "
        f"'doubles': [m for m in {DOUBLE_MODULES!r} if importlib.util.find_spec(m)]}}))"
    )
    result = _run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, env=outside)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["root"].startswith(str(venv)) and info["root"].endswith("ansible_collections/gpuforge/gpu")
    from gpuforge import versions

    assert info["hash"] == versions.load().digest
    assert info["doubles"] == []


def test_cluster_config_generate_and_validate(outside: dict[str, str], tmp_path: Path) -> None:
    shutil.copy(REPO / "examples/cluster-spec.yml", tmp_path / "spec.yml")
    generated = _run(
        ["gpuforge", "cluster-config", "generate", "spec.yml", "-o", "cluster.yml"], cwd=tmp_path, env=outside
    )
    assert generated.returncode == 0, generated.stderr
    validated = _run(["gpuforge", "cluster-config", "validate", "cluster.yml"], cwd=tmp_path, env=outside)
    assert validated.returncode == 0, validated.stderr


def test_nccl_report(outside: dict[str, str], tmp_path: Path) -> None:
    result = _run(
        ["gpuforge", "nccl-report", str(NCCL_LOG), "--instance-type", "p5.48xlarge", "--out", "report"],
        cwd=tmp_path,
        env=outside,
    )
    assert result.returncode in (0, 1), result.stderr  # 1: the runs are judged below their baseline.
    assert "Traceback" not in result.stderr
    assert any((tmp_path / "report").iterdir())


def test_preflight_and_ami_commands_against_emulated_ec2(
    outside: dict[str, str], tmp_path: Path, moto_server: MotoServer
) -> None:
    moto_server.reset()
    env = {**outside, **moto_server.env()}
    preflight = _run(["gpuforge", "preflight", "--cluster-name", "nothing-here"], cwd=tmp_path, env=env)
    # A real report: no node carries that cluster's tag.
    assert preflight.returncode == 1, preflight.stderr
    assert "preflight FAILED: 0 passed, 1 failed" in preflight.stdout
    prune = _run(["gpuforge", "prune", "--dry-run"], cwd=tmp_path, env=env)
    assert prune.returncode == 0, prune.stderr
    assert "Traceback" not in prune.stderr


@pytest.mark.skipif(shutil.which("packer") is None, reason="packer binary absent (apt-get install packer)")
def test_the_installed_packer_templates_validate(venv: Path, outside: dict[str, str], tmp_path: Path) -> None:
    """The wheel's templates, staged as a bake stages them, pointing at the wheel's playbooks."""
    script = f"""
import json, subprocess, sys
from pathlib import Path
from gpuforge import paths, versions
from gpuforge.ami.packer import Packer, template_dir, write_var_file
out = Path({str(tmp_path)!r})
packer = Packer.find()
staged = packer.stage(template_dir(), out / "staged")
var_file = write_var_file(out / "vars.json", {{
    "repo_root": str(paths.share_root()), "source_ami": "ami-0123456789abcdef0",
    "image_tags": versions.load().image_tags(), "manifest_path": str(out / "manifest.json"),
    # A bake always names the builder's profile (Session Manager needs one): gpuforge-builder-<region>.
    "iam_instance_profile": "gpuforge-builder-us-east-1"}})
result = subprocess.run([packer.executable, "validate", f"-var-file={{var_file}}", str(staged)],
                        capture_output=True, text=True)
print(json.dumps({{"dir": str(template_dir()), "rc": result.returncode,
                  "out": result.stdout + result.stderr}}))
"""
    (tmp_path / "staged").mkdir()
    result = _run(
        [str(venv / "bin" / "python"), "-c", script], cwd=tmp_path, env={**outside, "CHECKPOINT_DISABLE": "1"}
    )
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["dir"].startswith(str(venv))
    assert info["rc"] == 0, info["out"]


def test_the_lab_is_not_a_command_of_the_wheel(outside: dict[str, str], tmp_path: Path) -> None:
    result = _run(["gpuforge", "--help"], cwd=tmp_path, env=outside)
    assert result.returncode == 0, result.stderr
    commands = {
        line.split()[0] for line in result.stdout.splitlines() if line.startswith("    ") and line.split()
    }
    assert "cluster-config" in commands and "lab" not in commands
    local = _run(["gpuforge", "bake", "--local"], cwd=tmp_path, env=outside)
    assert local.returncode == 2
    assert local.stderr.strip() == (
        "gpuforge: error: --local: lab hosts are baked with `gpuforge-lab bake`, the lab of a gpuforge "
        "checkout (pip install -e ./lab); `gpuforge bake` bakes AMIs on AWS"
    )


def test_the_package_list_is_the_product_with_nothing_left_out_by_hand() -> None:
    """pyproject lists every package under scripts/gpuforge and the collection, no more: the test doubles
    are a project of their own (lab/), so the product's list needs no exclusions to keep them out."""
    import tomllib

    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    scripts = REPO / "scripts"
    inits = (scripts / "gpuforge").rglob("__init__.py")
    on_disk = sorted(".".join(init.parent.relative_to(scripts).parts) for init in inits)
    assert sorted(listed) == sorted([*on_disk, "ansible_collections.gpuforge.gpu"])
    assert not [name for name in on_disk if name.startswith(DOUBLE_MODULES)]
    lab = tomllib.loads((REPO / "lab" / "pyproject.toml").read_text())
    assert lab["project"]["scripts"] == {"gpuforge-lab": "gpuforge_lab.cli:main"}
