"""The nccl_tests role, the nccl-tests pin, its lab stand-in and the sbatch script that runs it.

The role's decision (build, keep, rebuild, refuse) runs on the control host in check mode against a
prepared directory per case (a record of an earlier build, the binary, an mpi.h), as
test_aws_ofi_nccl_plan does: nothing on the control host changes. The stand-in source archive (TEST
FIXTURE) is built with its own Makefile against the stand-in libnccl (tests/fixtures/nvidia/files/
libnccl-standin.c) and its output goes through the parser and `gpuforge nccl-report`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

import twinlab
from gpuforge import versions
from gpuforge.commands.nccl import NcclReport
from gpuforge.nccl.evaluate import THRESHOLD
from gpuforge.nccl.parse import parse
from gpuforge_lab.artifacts import fixtures
from localplay import REPO, record, run_cases

PINS = versions.load().components["nccl_tests"]
PIN = str(PINS["version"])
NCCL_PIN = versions.load().version("nccl")
SBATCH = REPO / "scripts/slurm/nccl-allreduce.sbatch"
ROLE = REPO / "roles/nccl_tests"


def test_pin_is_a_hashed_tag_archive() -> None:
    """versions.yml pins a 2.17+ release with the sha256 of GitHub's tag archive, which the role downloads."""
    assert re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+", PIN)
    assert tuple(int(n) for n in PIN.split(".")) >= (2, 17, 6)
    assert re.fullmatch(r"[0-9a-f]{64}", str(PINS["sha256"]))
    assert PINS["url_base"] == "https://github.com/NVIDIA/nccl-tests/archive/refs/tags"
    assert PINS["provided_by"] == "gpuforge"
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    assert defaults["nccl_tests_source_url"] == "{{ nccl_tests_url_base }}/v{{ nccl_tests_version }}.tar.gz"


def test_bake_runs_the_role_right_after_nccl() -> None:
    plays = yaml.safe_load((REPO / "playbooks/bake.yml").read_text())
    roles = [r["role"] for r in plays[1]["roles"]]
    assert roles.index("gpuforge.gpu.nccl_tests") == roles.index("gpuforge.gpu.nccl") + 1


# --- the role's decision ------------------------------------------------------------------------

SHA = str(PINS["sha256"])


def _wanted(case_dir: Path, mpi_h: bytes) -> dict[str, str]:
    return {
        "version": PIN,
        "sha256": SHA,
        "nccl": NCCL_PIN,
        "nccl_home": "/usr",
        "cuda_home": str(case_dir / "cuda-13.0"),
        "mpi_home": str(case_dir / "mpi"),
        "mpi_h_sha1": hashlib.sha1(mpi_h).hexdigest(),  # noqa: S324 - what ansible's stat reports
    }


# A base image's build: (release in its banner or None, links libmpi, other X.Y.Z strings in it)
BASES: dict[str, tuple[str | None, bool, tuple[str, ...]]] = {
    "base-newer-than-pin": ("9.1.0", True, ()),
    "base-at-pin": (PIN, True, ()),
    "base-below-floor": ("2.17.3", True, ()),
    "base-before-the-banner": (None, True, ()),
    "base-without-mpi": ("2.18.0", False, ()),
    # Without MPI a base build is no candidate whatever its release: the pin is built beside it, never kept
    # because it equals the pin, never refused as a downgrade (gpuforge builds into its own prefix).
    "base-at-pin-without-mpi": (PIN, False, ()),
    "base-newer-than-pin-without-mpi": ("9.1.0", False, ()),
    "base-release-ambiguous": ("9.1.0", True, ("9.2.0",)),
    "gpuforge-build-beside-base": ("9.1.0", True, ()),
    # Linked with MPI, but its libnccl does not resolve with the library directory the launch would use.
    "base-nccl-unresolved": ("9.1.0", True, ()),
}
# Base builds whose libnccl.so.2 is not put in the library directory (nccl_tests_base_library_dir).
NCCL_MISSING = {"base-nccl-unresolved"}

# case -> (record to leave, or None; binary present; mpi.h present; extra role variables)
CASES: dict[str, tuple[dict[str, str] | None, bool, bool, dict[str, Any]]] = {
    "fresh-host": (None, False, True, {}),
    "same-build": ({}, True, True, {}),
    "nccl-changed": ({"nccl": "2.27.7"}, True, True, {}),
    "cuda-changed": ({"cuda_home": "/usr/local/cuda-12.8"}, True, True, {}),
    "binary-gone": ({}, False, True, {}),
    "newer-other-inputs": ({"version": "9.0.0", "nccl": "2.27.7"}, True, True, {}),
    "no-mpi": (None, False, False, {}),
    "bad-version": (None, False, True, {"nccl_tests_version": "latest"}),
    "bad-sha": (None, False, True, {"nccl_tests_source_sha256": "abc"}),
    **{case: (None, False, True, {}) for case in BASES if case != "gpuforge-build-beside-base"},
    "gpuforge-build-beside-base": ({}, True, True, {}),
}
EXPECTED: dict[str, tuple[str, bool] | str] = {
    "fresh-host": ("install", True),
    "same-build": ("keep", False),
    "nccl-changed": ("keep", True),
    "cuda-changed": ("keep", True),
    "binary-gone": ("install", True),
    "newer-other-inputs": "gpuforge never downgrades",
    "no-mpi": "include/mpi.h does not exist",
    "bad-version": "must be exact nccl-tests releases",
    "bad-sha": "is not a sha256",
    # A base image's build at or above the floor, linking MPI, is used as it is (nothing built) ...
    "base-newer-than-pin": ("adopt", False),
    "base-at-pin": ("keep", False),
    # ... else the pin is built.
    "base-below-floor": ("install", True),
    "base-before-the-banner": ("install", True),
    "base-without-mpi": ("install", True),
    "base-at-pin-without-mpi": ("install", True),
    "base-newer-than-pin-without-mpi": ("install", True),
    "base-release-ambiguous": ("install", True),
    "base-nccl-unresolved": ("install", True),
    # gpuforge's own build is judged first: the base's is not adopted over it.
    "gpuforge-build-beside-base": ("keep", False),
}
# Where the decision uses the base image's build in place (<prefix>/build links to it).
ADOPTED = {"base-newer-than-pin", "base-at-pin"}
# Base builds found but not candidates: the manifest entry says why (what the reason names).
NOT_CANDIDATES = {
    "base-without-mpi": "does not link libmpi",
    "base-at-pin-without-mpi": "does not link libmpi",
    "base-newer-than-pin-without-mpi": "does not link libmpi",
    "base-before-the-banner": "shows no single nccl-tests release",
    "base-release-ambiguous": "shows no single nccl-tests release",
    "base-nccl-unresolved": "libnccl.so.2 does not resolve",
}


FRESH = "check-mode-fresh-host"
SYSTEM_PYTHON = "/usr/bin/python3"
DEBIAN = yaml.safe_load((ROLE / "vars/Debian.yml").read_text())


def _prepare(root: Path, case: str) -> dict[str, Any]:
    base = root / case
    recorded, binary, mpi, _ = CASES[case]
    (base / "cuda-13.0").mkdir(parents=True)
    (base / "cuda").symlink_to(base / "cuda-13.0")
    (base / "prefix/build").mkdir(parents=True)
    mpi_h = b"/* TEST FIXTURE: only its checksum is read */\n"
    if mpi:
        (base / "mpi/include").mkdir(parents=True)
        (base / "mpi/include/mpi.h").write_bytes(mpi_h)
    if binary:
        (base / "prefix/build/all_reduce_perf").write_text("#!/bin/sh\n")
        (base / "prefix/build/all_reduce_perf").chmod(0o755)
    if recorded is not None:
        (base / "prefix/gpuforge-build.json").write_text(json.dumps({**_wanted(base, mpi_h), **recorded}))
    if case in BASES:
        # The twin's stand-in (a real ELF program needing libnccl.so.2, and libmpi.so.40 when linked with
        # MPI), its libraries where the launch's library path finds them: NCCL in the base's library
        # directory, Open MPI's under the MPI home.
        release, links_mpi, extra = BASES[case]
        built = twinlab.nccl_tests_standin(base / "standin", release, links_mpi=links_mpi, extra=extra)
        (base / "base-build").mkdir()
        (base / "base-build/all_reduce_perf").write_bytes(built["all_reduce_perf"])
        (base / "base-build/all_reduce_perf").chmod(0o755)
        (base / "base-lib").mkdir()
        if case not in NCCL_MISSING:
            (base / "base-lib/libnccl.so.2").write_bytes(built["libnccl.so.2"])
        if links_mpi:
            (base / "mpi/lib").mkdir(parents=True)
            (base / "mpi/lib/libmpi.so.40").write_bytes(built["libmpi.so.40"])
    return {
        "nccl_tests_base_dirs": [str(base / "no-such-dir"), str(base / "base-build")],
        "nccl_tests_base_library_dir": str(base / "base-lib"),
        "nccl_tests_prefix": str(base / "prefix"),
        "nccl_tests_cuda_home": str(base / "cuda"),
        "nccl_tests_mpi_home": str(base / "mpi"),
        "nccl_tests_nccl_home": "/usr",
    }


def _apt_python() -> str:
    """The control host's Python with python3-apt, which the apt module needs even in check mode."""
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import apt"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"the role's apt task needs python3-apt for {SYSTEM_PYTHON} on the control host")
    return SYSTEM_PYTHON


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("nccl-tests-plan")
    cases: dict[str, list[dict[str, Any]]] = {}
    # The whole role (its argument check included) with the OS defaults, on a host without a build; first,
    # so that no case before it has loaded the role's vars/ into the host's variables.
    cases[FRESH] = [
        {
            "ansible.builtin.include_role": {"name": "gpuforge.gpu.nccl_tests"},
            "vars": {
                "nccl_tests_prefix": str(root / FRESH / "prefix"),
                "nccl_tests_build_dir": str(root / FRESH / "build"),
            },
        },
        record(
            FRESH,
            {
                "action": "{{ gpuforge_reality.nccl_tests.action }}",
                "build": "{{ _nccl_tests_build_needed | bool }}",
                "mpi_pending": "{{ _nccl_tests_mpi_pending | bool }}",
                # The role's defaults stay inside it; what it looked at does not.
                "mpi_h": "{{ _nccl_tests_stats.results[3].item }}",
                "mpi_h_sha1": "{{ _nccl_tests_wanted.mpi_h_sha1 }}",
            },
        ),
    ]
    for case, (_, _, _, extra) in CASES.items():
        role_vars = {**_prepare(root, case), **extra}
        cases[case] = [
            {
                "ansible.builtin.include_role": {"name": "gpuforge.gpu.nccl_tests", "tasks_from": task},
                "vars": role_vars,
            }
            for task in ("validate.yml", "install.yml")
        ] + [
            record(
                case,
                {
                    "action": "{{ gpuforge_reality.nccl_tests.action }}",
                    "build": "{{ _nccl_tests_build_needed | bool }}",
                    "source": "{{ gpuforge_reality.nccl_tests.source }}",
                    "version": "{{ gpuforge_reality.nccl_tests.version }}",
                    "adopted_dir": "{{ _nccl_tests_adopted_dir }}",
                    "entry_dir": "{{ gpuforge_reality.nccl_tests.dir | default('') }}",
                    "library_path": "{{ _nccl_tests_library_path }}",
                    "reason": "{{ gpuforge_reality.nccl_tests.reason }}",
                },
            )
        ]
    play_vars = {
        "gpuforge_instance_type": "p5.48xlarge",
        "gpuforge_common_imds_enabled": False,
        "gpuforge_common_manifest_enabled": False,
        # The role's first task is apt (its prerequisites, check mode here): the module needs python3-apt,
        # which only the system's Python has, and mitogen cannot respawn a module into another Python.
        "ansible_python_interpreter": _apt_python(),
    }
    return run_cases(tmp_path_factory.mktemp("nccl-tests-play"), cases, play_vars)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_build_decision(outcomes: dict[str, Any], case: str) -> None:
    """Build on a fresh host or a missing binary; keep a build of the same inputs; rebuild when the NCCL or
    CUDA it was built against changed; refuse a newer build of other inputs and bad or missing inputs."""
    got = outcomes[case]
    expected = EXPECTED[case]
    if isinstance(expected, str):
        assert isinstance(got, str), f"{case} did not fail: {got}"
        assert expected in got
        return
    action, build = expected
    adopted_dir = got.pop("adopted_dir")
    version = got.pop("version")
    # The manifest entry names the base build it uses, or says why a base build found is not used.
    entry_dir, reason = got.pop("entry_dir"), got.pop("reason")
    assert entry_dir == (adopted_dir if case in ADOPTED else ""), (entry_dir, adopted_dir)
    # The launch environment the role writes names the adopted build's library directory, else nothing.
    library_path = got.pop("library_path")
    assert library_path == (str(Path(adopted_dir).parent / "base-lib") if case in ADOPTED else ""), (
        library_path
    )
    if case in NOT_CANDIDATES:
        assert NOT_CANDIDATES[case] in reason and "/base-build/all_reduce_perf" in reason, reason
    assert got == {"action": action, "build": build, "source": "gpuforge"} or (
        # keep: the source stays what the previous manifest said (none here: base_image by default).
        action in ("keep", "adopt") and got == {"action": action, "build": build, "source": "base_image"}
    )
    assert adopted_dir.endswith("/base-build") == (case in ADOPTED), adopted_dir
    if case in ADOPTED:
        assert version == BASES[case][0]
    elif build:
        assert version == PIN


@pytest.mark.slow
def test_check_mode_on_a_fresh_host_passes_the_whole_role(outcomes: dict[str, Any]) -> None:
    """The role as a play runs it, in check mode on a Debian host where Debian's Open MPI headers are not
    installed yet: its argument check passes before vars/ are loaded (the defaults name no per-OS constant
    without a fallback), and as the prerequisites would bring mpi.h, check mode reports the build it would
    make instead of failing on the missing header. A missing header elsewhere still fails (case no-mpi)."""
    mpi_h = Path(DEBIAN["_nccl_tests_mpi_home"]) / "include/mpi.h"
    if _os_release().get("ID") != "debian" or mpi_h.exists():
        pytest.skip(f"needs a Debian control host without {mpi_h} (a fresh host for the role's MPI)")
    assert outcomes[FRESH] == {
        "action": "install",
        "build": True,
        "mpi_pending": True,
        "mpi_h": str(mpi_h),
        "mpi_h_sha1": "",
    }


def _os_release() -> dict[str, str]:
    lines = Path("/etc/os-release").read_text().splitlines()
    return dict((k, v.strip('"')) for k, _, v in (line.partition("=") for line in lines) if k)


def _task_index(tasks: list[dict[str, Any]], predicate: Any) -> int:
    found = [i for i, task in enumerate(tasks) if predicate(task)]
    assert len(found) == 1, found
    return found[0]


def test_prerequisites_are_installed_before_the_build_inputs_are_read() -> None:
    """On Debian the prerequisites bring mpi.h: they are installed once, before the task that reads its
    checksum into the build inputs, so a first run records the header a rerun will find (no rebuild)."""
    install = yaml.safe_load((ROLE / "tasks/install.yml").read_text())
    build = yaml.safe_load((ROLE / "tasks/build.yml").read_text())
    apt = _task_index(install, lambda t: "ansible.builtin.apt" in t)
    assert install[apt]["ansible.builtin.apt"]["name"] == "{{ _nccl_tests_build_packages }}"
    reads = _task_index(
        install,
        lambda t: "ansible.builtin.stat" in t and any("mpi.h" in str(item) for item in t.get("loop", [])),
    )
    assert apt < reads
    assert not [t for t in build if "ansible.builtin.apt" in t]
    assert DEBIAN["_nccl_tests_mpi_package"] == "libopenmpi-dev"
    assert "{{ _nccl_tests_mpi_package }}" in DEBIAN["_nccl_tests_build_packages"]


# --- the lab's stand-in source archive ----------------------------------------------------------


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in archive unpacked, a stand-in libnccl of the NCCL pin under an NCCL_HOME, an mpi.h."""
    if shutil.which("cc") is None or shutil.which("make") is None:
        pytest.skip("needs cc and make")
    root = tmp_path_factory.mktemp("nccl-tests-standin")
    archive = root / f"v{PIN}.tar.gz"
    fixtures.nccl_tests_source_tarball(archive, PIN)
    with tarfile.open(archive) as tar:
        assert {m.name.split("/")[0] for m in tar.getmembers()} == {f"nccl-tests-{PIN}"}
        tar.extractall(root, filter="data")
    major, minor, patch = (int(n) for n in NCCL_PIN.split("."))
    (root / "nccl/lib").mkdir(parents=True)
    subprocess.run(
        [
            "cc",
            "-shared",
            "-fPIC",
            f"-DNCCL_VERSION_CODE={major * 10000 + minor * 100 + patch}",
            "-Wl,-soname,libnccl.so.2",
            "-o",
            str(root / "nccl/lib/libnccl.so.2"),
            str(REPO / "tests/fixtures/nvidia/files/libnccl-standin.c"),
        ],
        check=True,
    )
    (root / "mpi/include").mkdir(parents=True)
    (root / "mpi/include/mpi.h").write_text("/* TEST FIXTURE */\n")
    return root


def _make(src: Path, root: Path, mpi_home: Path) -> subprocess.CompletedProcess[str]:
    argv = ["make", "MPI=1", f"MPI_HOME={mpi_home}", "CUDA_HOME=/nonexistent", f"NCCL_HOME={root / 'nccl'}"]
    return subprocess.run(argv, cwd=src, capture_output=True, text=True, check=False)


def test_standin_refuses_mpi_without_mpi_h(standin: Path) -> None:
    run = _make(standin / f"nccl-tests-{PIN}", standin, standin / "no-mpi")
    assert run.returncode != 0
    assert "include/mpi.h does not exist" in run.stderr


def test_standin_output_is_read_by_nccl_report(standin: Path, tmp_path: Path) -> None:
    """Two ranks of the stand-in, as srun prints them into one log: one table, both ranks' devices,
    the pinned version in the banner; nccl-report judges it against the p5 baseline and fails it (it ran
    nothing: its bus bandwidth comes from a fixed one-second time)."""
    src = standin / f"nccl-tests-{PIN}"
    run = _make(src, standin, standin / "mpi")
    assert run.returncode == 0, run.stderr
    binary = src / "build/all_reduce_perf"
    argv = [str(binary), "-b", "8", "-e", "8G", "-f", "2", "-g", "1", "-c", "1", "-n", "5"]
    log = ""
    for rank in (1, 0):
        env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "PATH": "/usr/bin:/bin"}
        log += subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    assert f"# nccl-tests version {PIN} " in log
    (result,) = parse(log, "standin.log")
    assert result.complete and result.collective == "all_reduce"
    assert [d.rank for d in result.devices] == [1, 0]
    assert len(result.rows) == 31 and result.rows[-1].size_bytes == 8 << 30
    assert all(r.out_of_place.wrong is None for r in result.rows)
    (tmp_path / "standin.log").write_text(log)
    code = NcclReport().execute(
        argparse.Namespace(
            logs=[tmp_path / "standin.log"],
            instance_type="p5.48xlarge",
            nodes=2,
            collective=None,
            baseline=None,
            threshold=THRESHOLD,
            out=tmp_path / "report",
        )
    )
    assert code == 1
    report = (tmp_path / "report/report.md").read_text()
    assert "FAIL" in report and "2 nodes" in report


# --- the sbatch script -----------------------------------------------------------------------------


def test_sbatch_runs_what_the_role_installs() -> None:
    """The script's default binary is where the role installs it, and it passes shellcheck."""
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    text = SBATCH.read_text()
    assert f"NCCL_TESTS_BIN:-{defaults['nccl_tests_prefix']}/build/all_reduce_perf" in text
    assert "roles/nccl_tests" in text
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-s", "bash", str(SBATCH)], check=True)


def _exports(text: str) -> dict[str, str]:
    """The defaults the script exports (NAME="${NAME:-default}" or NAME=value), by name."""
    found = {}
    for name, value in re.findall(r'^export (\w+)="?([^"\n]*)"?$', text, re.MULTILINE):
        default = re.fullmatch(r"\$\{\w+:-(.*)\}", value)
        found[name] = default.group(1) if default else value
    return found


def test_sbatch_sets_what_an_srun_launch_of_the_efa_open_mpi_needs() -> None:
    """Under srun there is no mpirun to pass --mca flags: the script exports what AWS passes when it launches
    nccl-tests with the EFA installer's Open MPI (pml ^cm,ucx, btl tcp,self and the TCP interfaces to leave
    out: awsome-distributed-training's srun images, e.g. 3.test_cases/megatron/nemo/Dockerfile), and the
    PMIx datastore both PMIx releases of an srun launch share (slurmstepd's and Open MPI 4.1's;
    open-mpi/ompi#7516). Each is a default the caller can override."""
    text = SBATCH.read_text()
    exports = _exports(text)
    assert {name: exports.get(name) for name in ("OMPI_MCA_pml", "OMPI_MCA_btl", "PMIX_MCA_gds")} == {
        "OMPI_MCA_pml": "^cm,ucx",
        "OMPI_MCA_btl": "tcp,self",
        "PMIX_MCA_gds": "hash",
    }
    # Docker's bridge has the same address on every DLAMI node; loopback never reaches a peer.
    assert {"lo", "docker0"} <= set(exports["OMPI_MCA_btl_tcp_if_exclude"].split(","))
    for name in ("OMPI_MCA_pml", "OMPI_MCA_btl", "OMPI_MCA_btl_tcp_if_exclude", "PMIX_MCA_gds"):
        assert f'export {name}="${{{name}:-' in text, f"{name} must stay overridable"
    # Exported before the one srun that starts the ranks.
    assert max(text.index(f"export {name}=") for name in exports) < text.index("\nsrun --mpi=pmix")
