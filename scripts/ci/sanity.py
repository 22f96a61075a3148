"""`ansible-test sanity` on the built collection, with no network.

ansible-test gives each sanity test a virtualenv of its own (~/.ansible/test/venv) and fills it
in two steps: it runs a get-pip script, which it downloads from ci-files.testing.ansible.com
into ~/.ansible/test/cache/get_pip_<version>.py unless one is there, to install the pip it pins;
then that pip installs the test's pinned requirements (ansible_test/_data/requirements/sanity.*.txt)
from PyPI. Neither is reachable offline, and ci-files is no package registry.

So `wheels` (run by `make setup`, online, as the rest of setup) downloads those pinned wheels and
that pip into .cache/ansible-test/wheels, and `run` gives ansible-test a HOME of its own
(.cache/ansible-test/home; ansible-test passes HOME, and only a few other variables, to what it runs)
holding:
- .ansible/test/cache/get_pip_<version>.py: a bootstrap that installs pip from its wheel in the
  wheelhouse (a wheel is importable as a zip), so ansible-test finds it cached and downloads nothing;
- .config/pip/pip.conf: no index, the wheelhouse as the only source, for every pip ansible-test runs.
The test virtualenvs stay in that HOME between runs. Then it builds the collection with
ansible-galaxy (galaxy.yml's build_ignore decides what ships), installs it at
<tmp>/ansible_collections/gpuforge/gpu and runs `ansible-test sanity` there with this Python.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "ansible-test"
WHEELS = CACHE / "wheels"
HOME = CACHE / "home"
BIN = Path(sys.executable).parent
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"

# Installed as ~/.ansible/test/cache/get_pip_<version>.py. ansible-test runs it inside a new test
# virtualenv as `get_pip.py --disable-pip-version-check pip==<version> --no-setuptools --no-wheel`
# (ansible_test/_util/target/setup/requirements.py, bootstrap()); the last two are get-pip's own
# options, not pip's, and ask for what this bootstrap never installs anyway.
BOOTSTRAP = '''\
"""ansible-test's pip bootstrap, offline: pip {pip} from the wheelhouse (scripts/ci/sanity.py)."""
import sys

sys.path.insert(0, {wheel!r})
from pip._internal.cli.main import main  # noqa: E402

args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
sys.exit(main(["install", "--no-index", "--find-links", {wheels!r}, *args]))
'''


class SanityError(Exception):
    """What is missing, and the command that provides it."""


def requirement_files() -> list[Path]:
    """ansible-test's pinned requirements of every sanity test, from the installed ansible-test."""
    import ansible_test  # type: ignore[import-untyped]

    data = Path(ansible_test.__file__).parent / "_data" / "requirements"
    return sorted(data.glob("sanity.*.txt"))


def bootstrap_pip_version() -> str:
    """The pip ansible-test bootstraps into each test virtualenv (it pins one per Python)."""
    from ansible_test._internal.python_requirements import (  # type: ignore[import-untyped]
        get_venv_packages,
    )

    # It reads only the Python version of the config it is given.
    packages: dict[str, str] = get_venv_packages(types.SimpleNamespace(version=PYTHON))
    return packages["pip"]


def download_wheels(wheels: Path = WHEELS) -> None:
    """Download (online) everything the sanity virtualenvs install, for this Python and platform."""
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [str(BIN / "python"), "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(wheels)]
    for path in requirement_files():
        cmd += ["-r", str(path)]
    subprocess.run([*cmd, f"pip=={bootstrap_pip_version()}"], check=True)


def _dist(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def missing_wheels(wheels: Path = WHEELS) -> list[str]:
    """The pinned requirements (name==version) that have no wheel in the wheelhouse."""
    pins = {f"pip=={bootstrap_pip_version()}"}
    for path in requirement_files():
        pins.update(line.split(";")[0].strip() for line in path.read_text().splitlines() if "==" in line)
    have = {tuple(_dist(part) for part in w.name.split("-")[:2]) for w in wheels.glob("*.whl")}
    return sorted(pin for pin in pins if (_dist(pin.split("==")[0]), _dist(pin.split("==")[1])) not in have)


def prepare_home(home: Path = HOME, wheels: Path = WHEELS) -> None:
    """ansible-test's HOME: the cached pip bootstrap and a pip.conf that keeps pip offline."""
    missing = missing_wheels(wheels)
    if missing:
        raise SanityError(
            f"no wheel in {wheels} for {', '.join(missing)}: run `python scripts/ci/sanity.py wheels` "
            "(online: `make setup` runs it once)"
        )
    pip = bootstrap_pip_version()
    wheel = sorted(wheels.glob(f"pip-{pip}-*.whl"))
    cache = home / ".ansible" / "test" / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    script = BOOTSTRAP.format(pip=pip, wheel=str(wheel[0]), wheels=str(wheels))
    (cache / f"get_pip_{pip.replace('.', '_')}.py").write_text(script)
    conf = home / ".config" / "pip"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "pip.conf").write_text(f"[global]\nno-index = true\nfind-links = {wheels}\n")


def build(out: Path) -> Path:
    """The collection, built by ansible-galaxy and installed at out/ansible_collections/<ns>/<name>."""
    galaxy = str(BIN / "ansible-galaxy")
    dist = out / "dist"
    subprocess.run(
        [galaxy, "collection", "build", "--output-path", str(dist), str(REPO)],
        check=True,
        cwd=out,
        stdout=subprocess.DEVNULL,
    )
    (tarball,) = dist.glob("*.tar.gz")
    collections = out / "collections"
    subprocess.run(
        [galaxy, "collection", "install", "--no-deps", "--offline", "-p", str(collections), str(tarball)],
        check=True,
        cwd=out,
        stdout=subprocess.DEVNULL,
    )
    namespace, name = tarball.name.split("-")[:2]
    return collections / "ansible_collections" / namespace / name


def sanity(root: Path, extra: list[str], home: Path = HOME) -> int:
    """Run `ansible-test sanity` in the installed collection; its exit status."""
    env = {**os.environ, "HOME": str(home)}
    # The collection's own config only (ansible-test runs ansible-doc and the rest in the collection).
    env.pop("ANSIBLE_CONFIG", None)
    cmd = [str(BIN / "ansible-test"), "sanity", "--python", PYTHON, "--color", "no", *extra]
    return subprocess.run(cmd, cwd=root, env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Arguments after `run` go to ansible-test sanity (e.g. run --test pylint).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("wheels", help="download what the sanity test virtualenvs install (online; make setup)")
    sub.add_parser("run", help="build the collection and run ansible-test sanity on it (offline)")
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "run":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "wheels":
            download_wheels()
            return 0
        prepare_home()
        with tempfile.TemporaryDirectory(prefix="gpuforge-sanity-") as tmp:
            return sanity(build(Path(tmp)), extra)
    except SanityError as exc:
        print(f"sanity: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
