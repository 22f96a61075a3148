"""Where the aws_ofi_nccl role takes the plugin from, for each state of a node.

One play on the control host runs the role's probe against a prepared directory per case: the
EFA installer's bundle in either layout (before and from installer 1.44), a bundle of another
release, CUDA headers present or not. The bundled library is the compiled TEST FIXTURE stand-in
(gpuforge_lab.artifacts.fixtures), read by the same version probe production uses. Check mode, the
manifest off and IMDS off: nothing on the control host changes and no request leaves loopback.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import platform
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from gpuforge import versions
from gpuforge_lab.artifacts import fixtures
from localplay import REPO, record, run_cases

PIN = versions.load().version("aws_ofi_nccl")
FLOOR = versions.load().components["aws_ofi_nccl"].get("floor", PIN)
# A bundle newer than the pin, as a current DLAMI's EFA installer carries (tests/twins records).
NEWER = "1.21.1"


def _kept(bundle: str) -> str:
    """The policy's action for a bundle at or above the floor: kept at the pin, else adopted."""
    return "keep" if bundle == PIN else "adopt"


ARCH_LIB = f"lib/{platform.machine()}-linux-gnu"

pytestmark = pytest.mark.slow

# case -> (bundled library relative to the prefix, its version, CUDA headers?, aws_ofi_nccl_source)
# The image's targets are the host's type (p5.48xlarge, with EFA) unless TARGETS names others.
CASES: dict[str, tuple[str | None, str | None, bool, str]] = {
    "bundle-pre-1.44-layout": (f"{ARCH_LIB}/libnccl-net.so", PIN, False, "auto"),
    "bundle-1.44-layout": ("lib/libnccl-net-ofi.so", PIN, False, "auto"),
    "bundle-wins-over-cuda": (f"{ARCH_LIB}/libnccl-net.so", PIN, True, "auto"),
    "newer-bundle-adopted": ("lib/libnccl-net-ofi.so", NEWER, True, "auto"),
    "newer-bundle-required": ("lib/libnccl-net-ofi.so", NEWER, True, "bundled"),
    "other-bundle-with-cuda": (f"{ARCH_LIB}/libnccl-net.so", "1.9.1", True, "auto"),
    "other-bundle-no-cuda": (f"{ARCH_LIB}/libnccl-net.so", "1.9.1", False, "auto"),
    # A rerun after other-bundle-with-cuda: the pin gpuforge built is there (EARLIER_BUILD).
    "earlier-build-beside-an-older-bundle": (f"{ARCH_LIB}/libnccl-net.so", "1.9.1", True, "auto"),
    "no-bundle-no-cuda": (None, None, False, "auto"),
    "forced-build-with-bundle": (f"{ARCH_LIB}/libnccl-net.so", PIN, True, "build"),
    "required-bundle-mismatch": (f"{ARCH_LIB}/libnccl-net.so", "1.9.1", True, "bundled"),
    "forced-build-no-cuda": (None, None, False, "build"),
    "other-bundle-no-cuda-efa-target": (f"{ARCH_LIB}/libnccl-net.so", "1.9.1", False, "auto"),
    "no-bundle-no-cuda-efa-target": (None, None, False, "auto"),
}
# Cases whose pin gpuforge built on an earlier run (a library under aws_ofi_nccl_prefix).
EARLIER_BUILD = {"earlier-build-beside-an-older-bundle"}
# Targets without EFA (c5n.large): there NCCL has no EFA to use, and a skip is no loss.
TARGETS = {"other-bundle-no-cuda": "c5n.large", "no-bundle-no-cuda": "c5n.large"}

# case -> (plan, bundled version seen, library directory relative to the prefix, the version policy's
# record: "<action> <version> <source>", '' when nothing is recorded) or a failure
EXPECTED: dict[str, tuple[str, str, str, str] | str] = {
    "bundle-pre-1.44-layout": ("bundled", PIN, ARCH_LIB, f"keep {PIN} base_image"),
    "bundle-1.44-layout": ("bundled", PIN, "lib", f"keep {PIN} base_image"),
    "bundle-wins-over-cuda": ("bundled", PIN, ARCH_LIB, f"keep {PIN} base_image"),
    # Adopted, never replaced by a build of the older pin (the version policy: never downgrade).
    "newer-bundle-adopted": ("bundled", NEWER, "lib", f"{_kept(NEWER)} {NEWER} base_image"),
    "newer-bundle-required": ("bundled", NEWER, "lib", f"{_kept(NEWER)} {NEWER} base_image"),
    # Below the floor: the pin is built beside the bundle, and recorded as gpuforge's.
    "other-bundle-with-cuda": ("build", "1.9.1", ARCH_LIB, f"install {PIN} gpuforge"),
    # The earlier build is what runs: kept, as the other roles keep their pin on a rerun (it said
    # "install" on every rerun while nothing changed).
    "earlier-build-beside-an-older-bundle": ("built", "1.9.1", ARCH_LIB, f"keep {PIN} gpuforge"),
    # Nothing is installed: nothing is recorded.
    "other-bundle-no-cuda": ("skip", "1.9.1", ARCH_LIB, ""),
    "no-bundle-no-cuda": ("skip", "", "", ""),
    # The bundle left out: the policy sees nothing installed.
    "forced-build-with-bundle": ("build", PIN, ARCH_LIB, f"install {PIN} gpuforge"),
    "required-bundle-mismatch": f"holds aws-ofi-nccl 1.9.1, not {FLOOR} or newer",
    "forced-build-no-cuda": "aws_ofi_nccl_source is 'build' but there is no CUDA toolkit",
    # On a type with EFA NCCL would fall back to TCP: the bake stops.
    "other-bundle-no-cuda-efa-target": "p5.48xlarge have EFA, but this host has no aws-ofi-nccl",
    "no-bundle-no-cuda-efa-target": "NCCL would fall back to TCP sockets",
}


def _prepare(root: Path, case: str, plugins: dict[str, bytes]) -> dict[str, str]:
    lib, version, cuda, _ = CASES[case]
    prefix, cuda_home = root / case / "ofi-nccl", root / case / "cuda"
    prefix.mkdir(parents=True)
    if lib is not None and version is not None:
        (prefix / lib).parent.mkdir(parents=True, exist_ok=True)
        (prefix / lib).write_bytes(plugins[version])
    if case in EARLIER_BUILD:
        (root / case / "built/lib").mkdir(parents=True)
        (root / case / "built/lib/libnccl-net.so").write_bytes(plugins[PIN])
    if cuda:
        (cuda_home / "include").mkdir(parents=True)
        (cuda_home / "include" / "cuda.h").write_text("/* TEST FIXTURE: only its existence is probed */\n")
    return {"prefix": str(prefix), "cuda_home": str(cuda_home)}


def _standin_plugins(tmp_path_factory: pytest.TempPathFactory, *releases: str) -> dict[str, bytes]:
    """The compiled stand-in plugin of each version (skips without a C compiler)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("needs a C compiler for the stand-in plugin")
    work = tmp_path_factory.mktemp("ofi-plugin")
    return {v: fixtures.standin_plugin(v, work) for v in set(releases)}


def _with_decision(case: str, value: dict[str, str]) -> dict[str, Any]:
    """record(), with _decision: the aws_ofi_nccl entry of the node record ({} when none)."""
    task = record(case, value)
    task["vars"]["_decision"] = "{{ (ansible_facts.gpuforge_reality | default({})).get('aws_ofi_nccl', {}) }}"
    return task


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    plugins = _standin_plugins(tmp_path_factory, PIN, "1.9.1", NEWER)
    root = tmp_path_factory.mktemp("ofi-plan")
    cases: dict[str, list[dict[str, Any]]] = {}
    for case, (_, _, _, source) in CASES.items():
        dirs = _prepare(root, case, plugins)
        cases[case] = [
            # The image's targets, as gpuforge_common publishes them (it runs once, for the first case,
            # with the host's own type: p5.48xlarge, the first case's target too).
            {"ansible.builtin.set_fact": {"gpuforge_targets": [TARGETS.get(case, "p5.48xlarge")]}},
            {
                "ansible.builtin.include_role": {
                    "name": "gpuforge.gpu.aws_ofi_nccl",
                    "tasks_from": "probe.yml",
                },
                "vars": {
                    "aws_ofi_nccl_bundled_prefix": dirs["prefix"],
                    "aws_ofi_nccl_cuda_home": dirs["cuda_home"],
                    "aws_ofi_nccl_prefix": str(root / case / "built"),
                    "aws_ofi_nccl_source": source,
                },
            },
            # What the role records and hands the nccl role (check mode: the record is not written).
            {
                "ansible.builtin.include_role": {
                    "name": "gpuforge.gpu.aws_ofi_nccl",
                    "tasks_from": "register.yml",
                },
                "vars": {
                    "aws_ofi_nccl_prefix": str(root / case / "built"),
                    "aws_ofi_nccl_record_file": str(root / case / "aws_ofi_nccl.json"),
                    "aws_ofi_nccl_linker_enabled": False,
                },
            },
            _with_decision(
                case,
                {
                    "plan": "{{ _aws_ofi_nccl_plan | trim }}",
                    "bundled_version": "{{ _aws_ofi_nccl_bundled_version }}",
                    "lib_dir": "{{ _aws_ofi_nccl_bundled_lib_dir | trim }}",
                    # The version policy's record, as the manifest's "installed" takes it ('' when none).
                    "decision": "{{ _decision.action ~ ' ' ~ _decision.version ~ ' ' ~ _decision.source"
                    " if _decision else '' }}",
                    # The release in use, in the record file and as the nccl role takes it from the node
                    # record (roles/nccl/tasks/plugin_range.yml: its decision, else the pin).
                    "in_use": "{{ _aws_ofi_nccl_outcome.version | trim }}",
                    "range_of": "{{ gpuforge_versions.aws_ofi_nccl.version"
                    " | gpuforge.gpu.ofi_nccl_release_in_use(decision=_decision) }}",
                },
            ),
        ]
    play_vars = {
        "gpuforge_instance_type": "p5.48xlarge",
        "gpuforge_common_imds_enabled": False,
        "gpuforge_common_manifest_enabled": False,
    }
    collected = run_cases(tmp_path_factory.mktemp("ofi-play"), cases, play_vars)
    return {"results": collected, "root": root}


@pytest.mark.parametrize("case", list(CASES))
def test_plugin_source_decision(outcomes: dict[str, Any], case: str) -> None:
    """Bundled when the version policy keeps or adopts the bundle (the floor or newer, either layout),
    else build with CUDA, else a skip; the policy's decision is in gpuforge_reality unless skipped."""
    got = outcomes["results"][case]
    expected = EXPECTED[case]
    if isinstance(expected, str):
        assert isinstance(got, str), f"{case} did not fail: {got}"
        assert expected in got
        return
    plan, bundled_version, lib_dir, decision = expected
    prefix = outcomes["root"] / case / "ofi-nccl"
    assert got == {
        "plan": plan,
        "bundled_version": bundled_version,
        "lib_dir": str(prefix / lib_dir) if lib_dir else "",
        "decision": decision,
        # The adopted bundle's release, else the pin (built, or wanted where skipped).
        "in_use": bundled_version if plan == "bundled" else PIN,
        "range_of": bundled_version if plan == "bundled" else PIN,
    }


# Where nccl_tuning then finds the plugin: the record the aws_ofi_nccl role wrote names a plugin it
# built (any build prefix), else the EFA installer's bundle. The role's own probe.yml runs as shipped.
# case -> (record the aws_ofi_nccl role left, or None; library under the built lib_dir; bundled library)
FIND_CASES: dict[str, tuple[dict[str, str] | None, str | None, str | None]] = {
    "built-recorded": ({"source": "built", "lib_dir": "built/lib"}, "libnccl-net.so", None),
    "built-1.14-name": ({"source": "built", "lib_dir": "built/lib"}, "libnccl-net-ofi.so", None),
    "built-wins-over-bundle": (
        {"source": "built", "lib_dir": "built/lib"},
        "libnccl-net.so",
        "lib/libnccl-net.so",
    ),
    "bundled-no-record": (None, None, "lib/libnccl-net-ofi.so"),
    "skipped-nothing-found": ({"source": "skipped", "lib_dir": ""}, None, None),
}
BUILT_VERSION = "1.13.2"


@pytest.fixture(scope="module")
def found(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    plugins = _standin_plugins(tmp_path_factory, PIN, BUILT_VERSION)
    root = tmp_path_factory.mktemp("ofi-find")
    cases: dict[str, list[dict[str, Any]]] = {}
    for case, (record_data, built_lib, bundled_lib) in FIND_CASES.items():
        base = root / case
        (base / "etc").mkdir(parents=True)
        if record_data is not None:
            lib_dir = str(base / record_data["lib_dir"]) if record_data["lib_dir"] else ""
            (base / "etc/aws_ofi_nccl.json").write_text(
                json.dumps({**record_data, "lib_dir": lib_dir, "version": BUILT_VERSION})
            )
        if built_lib is not None:
            (base / "built/lib").mkdir(parents=True)
            (base / "built/lib" / built_lib).write_bytes(plugins[BUILT_VERSION])
        if bundled_lib is not None:
            (base / "bundle" / bundled_lib).parent.mkdir(parents=True)
            (base / "bundle" / bundled_lib).write_bytes(plugins[PIN])
        cases[case] = [
            {
                "ansible.builtin.include_tasks": str(REPO / "roles/nccl_tuning/tasks/probe.yml"),
                "vars": {
                    "gpuforge_ofi_nccl_record": str(base / "etc/aws_ofi_nccl.json"),
                    "gpuforge_ofi_nccl_bundled_prefix": str(base / "bundle"),
                    "gpuforge_ofi_nccl_bundled_libs": [
                        "lib/x86_64-linux-gnu/libnccl-net.so",
                        "lib/libnccl-net.so",
                        "lib/libnccl-net-ofi.so",
                    ],
                    "_nccl_tuning_fi_info_paths": [str(base / "no-fi_info")],
                    "nccl_tuning_aws_ofi_nccl_version": PIN,
                    "nccl_tuning_libfabric_version": "",
                },
            },
            record(
                case,
                {
                    "version": "{{ _nccl_tuning_versions.aws_ofi_nccl | trim }}",
                    "installed": "{{ _nccl_tuning_versions.aws_ofi_nccl_installed }}",
                },
            ),
        ]
    return run_cases(tmp_path_factory.mktemp("ofi-find-play"), cases, {"gpuforge_common_imds_enabled": False})


@pytest.mark.parametrize(
    ("case", "version", "installed"),
    [
        ("built-recorded", BUILT_VERSION, True),
        ("built-1.14-name", BUILT_VERSION, True),
        ("built-wins-over-bundle", BUILT_VERSION, True),
        ("bundled-no-record", PIN, True),
        # Nothing installed: the settings are checked against the pin, and the report says so.
        ("skipped-nothing-found", PIN, False),
    ],
)
def test_nccl_tuning_finds_the_recorded_plugin(
    found: dict[str, Any], case: str, version: str, installed: bool
) -> None:
    assert found[case] == {"version": version, "installed": installed}


# The source download of a build: the role's own download.yml (and build.yml's refusal) against a
# loopback server holding a TEST FIXTURE tarball. Not check mode: each case only writes its own
# directory under the test's tmp path.
PINNED = versions.load().components["aws_ofi_nccl"]
# case -> (sha256, sha512); "right" stands for the fixture's real digest. no-hash runs build.yml.
DOWNLOAD_CASES: dict[str, tuple[str, str]] = {
    "right-sha512": ("", "right"),
    "right-sha256": ("right", ""),
    "wrong-sha512": ("", "0" * 128),
    "no-hash": ("", ""),
}


@pytest.fixture(scope="module")
def downloads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    served = tmp_path_factory.mktemp("ofi-served")
    tarball = served / f"aws-ofi-nccl-{PIN}.tar.gz"
    tarball.write_bytes(b"TEST FIXTURE: not aws-ofi-nccl, only its hash is checked\n")
    digests = {
        "sha256": hashlib.sha256(tarball.read_bytes()).hexdigest(),
        "sha512": hashlib.sha512(tarball.read_bytes()).hexdigest(),
    }
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    root = tmp_path_factory.mktemp("ofi-download")
    cases: dict[str, list[dict[str, Any]]] = {}
    try:
        for case, (sha256, sha512) in DOWNLOAD_CASES.items():
            (root / case).mkdir()
            task_file = "build.yml" if case == "no-hash" else "download.yml"
            cases[case] = [
                {
                    "ansible.builtin.include_tasks": str(REPO / "roles/aws_ofi_nccl/tasks" / task_file),
                    "vars": {
                        "aws_ofi_nccl_version": PIN,
                        "aws_ofi_nccl_build_dir": str(root / case),
                        "aws_ofi_nccl_source_url": f"http://127.0.0.1:{server.server_port}/{tarball.name}",
                        "aws_ofi_nccl_source_sha256": digests["sha256"] if sha256 == "right" else sha256,
                        "aws_ofi_nccl_source_sha512": digests["sha512"] if sha512 == "right" else sha512,
                    },
                },
                record(case, "downloaded"),
            ]
        results = run_cases(tmp_path_factory.mktemp("ofi-download-play"), cases, {}, check=False)
    finally:
        server.shutdown()
    return {"results": results, "root": root, "tarball": tarball, "digests": digests}


@pytest.mark.parametrize("case", ["right-sha512", "right-sha256"])
def test_download_with_the_right_hash_passes(downloads: dict[str, Any], case: str) -> None:
    assert downloads["results"][case] == "downloaded"
    got = downloads["root"] / case / downloads["tarball"].name
    assert got.read_bytes() == downloads["tarball"].read_bytes()


def test_download_with_a_wrong_sha512_fails_and_keeps_nothing(downloads: dict[str, Any]) -> None:
    message = downloads["results"]["wrong-sha512"]
    # get_url hashes the download with the pinned algorithm: it names the tarball's real sha512.
    assert f"did not match {'0' * 128}; it was {downloads['digests']['sha512']}" in message
    assert not (downloads["root"] / "wrong-sha512" / downloads["tarball"].name).exists()


def test_build_without_a_hash_refuses_before_downloading(downloads: dict[str, Any]) -> None:
    message = downloads["results"]["no-hash"]
    assert f"No sha256 or sha512 is pinned for the aws-ofi-nccl {PIN} source tarball" in message
    assert list((downloads["root"] / "no-hash").iterdir()) == []


def test_the_pin_is_the_release_tarball_with_its_published_sha512() -> None:
    """versions.yml pins the release asset's sha512 (the release notes' value), and no sha256 beside it."""
    assert PINNED["url_base"] == "https://github.com/aws/aws-ofi-nccl/releases/download"
    assert re.fullmatch("[0-9a-f]{128}", PINNED["source_sha512"])
    assert "source_sha256" not in PINNED and "sha256" not in PINNED
