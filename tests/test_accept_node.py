"""gpuforge accept's node stage and Slurm plumbing without a cluster: gpuforge-accept-node.sh
(scripts/slurm) run here against stand-in tools (TEST DOUBLES: a health script, fi_info replaying a
recorded p5 listing, fi_pingpong, all_reduce_perf replaying a published nccl-tests log), its output
judged by gpuforge.accept.nodecheck; scontrol's node lines; the multi-node environment; the command
end to end against a Slurm test double; its errors where Slurm is absent. The same run through real
Slurm is tests/test_accept_lab.py."""

from __future__ import annotations

import getpass
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuforge import cli as gpuforge_cli
from gpuforge.accept import nodecheck, slurm, stages
from gpuforge.errors import ExternalError
from gpuforge.nccl.evaluate import settings
from test_fleet_health import HEALTH, config, tools  # noqa: F401 (the health script's fixtures)

REPO = Path(__file__).resolve().parents[1]
NCCL_LOG = REPO / "tests/fixtures/nccl/gcp-a3mega-h100-2node.log"
FI_INFO = REPO / "tests/fixtures/health/fi_info-efa-p5.txt"


def stand_in(directory: Path, name: str, body: str) -> str:
    path = directory / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def health_report(status: str = "pass", check: str = "gpu_count", detail: str = "8 of 8 GPUs") -> str:
    return json.dumps(
        {
            "mode": "adhoc",
            "healthy": status != "fail",
            "results": [{"check": check, "status": status, "detail": detail}],
        }
    )


def node_check(
    tmp_path: Path,
    *,
    health: str,
    pingpong_fails: str = "",
    gpus: int = 8,
    efa: bool = True,
    listing: Path = FI_INFO,
) -> str:
    """gpuforge-accept-node.sh's output as srun --label prints task 0's, run here with the stand-ins."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    report = tmp_path / "health.json"
    report.write_text(health)
    health_bin = stand_in(
        bin_dir,
        "gpuforge-health",
        f'[[ "$*" == "--mode adhoc --json --dcgm-level 2" ]] || exit 9\ncat {report}\nexit 0',
    )
    efa_dir = tmp_path / "efa"
    efa_dir.mkdir(exist_ok=True)
    if efa:
        stand_in(efa_dir, "fi_info", f'[[ "$*" == "-p efa -t FI_EP_RDM" ]] && cat {listing}')
        stand_in(
            efa_dir,
            "fi_pingpong",
            'for a in "$@"; do [[ "$a" == "'
            + (pingpong_fails or "none")
            + '" ]] && { echo "fi_av_insert(): -22"; exit 1; }; done\n'
            '[[ "$FI_EFA_ENABLE_SHM_TRANSFER" == 0 ]] || exit 3\necho "bytes #sent #ack total time MB/sec"',
        )
    all_reduce = stand_in(
        bin_dir, "all_reduce_perf", f'[[ -z "${{SLURM_PROCID:-}}" ]] || exit 7\ncat {NCCL_LOG}'
    )
    script = REPO / stages.NODE_CHECK
    env = {**os.environ, "SLURMD_NODENAME": "gpu-st-p5-1", "SLURM_PROCID": "0"}
    proc = subprocess.run(
        ["bash", str(script), health_bin, "2", str(efa_dir), str(gpus), all_reduce, "8G", "20"],
        capture_output=True, text=True, env=env, check=True, timeout=120,
    )  # fmt: skip
    return "".join(f"0: {line}\n" for line in proc.stdout.splitlines())


def baseline_file(tmp_path: Path, busbw: float) -> Path:
    path = tmp_path / "baseline.yml"
    path.write_text(
        "gpuforge_nccl_baselines:\n  p5.48xlarge:\n    all_reduce:\n"
        f"      - {{nodes: 1, busbw_gb_s: {busbw}, size_bytes: 1073741824, source: test}}\n"
    )
    return path


def judged(tmp_path: Path, log: str, busbw: float = 100.0, efa_devices: int = 32) -> nodecheck.NodeJudgement:
    nccl = settings("p5.48xlarge", baseline_file(tmp_path, busbw), 0.9, 1, "all_reduce")
    outputs = nodecheck.split(log)
    assert list(outputs) == ["gpu-st-p5-1"]
    return nodecheck.judge(outputs["gpu-st-p5-1"], "gpu-st-p5-1", nccl, 8, efa_devices)


def test_a_healthy_node_passes_every_part(tmp_path: Path) -> None:
    verdict = judged(tmp_path, node_check(tmp_path, health=health_report()))
    assert verdict.result.passed and verdict.result.judged, verdict.result.figure
    assert [d["rc"] for d in verdict.efa] == [0] * 32 and len({d["device"] for d in verdict.efa}) == 32
    assert "efa loopback: 32 of 32 devices" in verdict.result.figure
    assert verdict.allreduce is not None and verdict.result.busbw_gb_s == verdict.allreduce.busbw_gb_s


def test_libfabric_2_lists_each_device_twice_and_each_is_looped_back_once(tmp_path: Path) -> None:
    """libfabric 2.x lists an efa-direct entry per device before the efa ones (the fixture is
    constructed from ofiwg/libfabric v2.6.0 efa_prov.c): 32 devices, not 64 loopbacks on 32 ports."""
    listing = REPO / "tests/fixtures/health/fi_info-efa-p5-libfabric2.txt"
    verdict = judged(tmp_path, node_check(tmp_path, health=health_report(), listing=listing))
    assert verdict.result.passed, verdict.result.figure
    assert len(verdict.efa) == 32 and len({d["device"] for d in verdict.efa}) == 32
    assert "efa loopback: 32 of 32 devices" in verdict.result.figure


def test_each_part_fails_the_node_with_its_figure(tmp_path: Path) -> None:
    failing = health_report("fail", "dcgm_diag", "dcgmi diag -r 2: Memory Fail - GPU 3")
    verdict = judged(
        tmp_path, node_check(tmp_path, health=failing, pingpong_fails="rdmap80s0-rdm"), busbw=1000.0
    )
    figure = verdict.result.figure
    assert not verdict.result.passed
    assert "health dcgm_diag: dcgmi diag -r 2: Memory Fail - GPU 3" in figure
    assert "efa loopback rdmap80s0-rdm: fi_pingpong exit 1 fi_av_insert(): -22" in figure
    assert re.search(
        r"all_reduce alone: all_reduce FAIL: busbw [\d.]+ GB/s at >= 1073741824 B is \d+% of", figure
    )


def test_a_missing_efa_installer_fails_unless_the_lab_declares_it_absent(tmp_path: Path) -> None:
    missing = judged(tmp_path, node_check(tmp_path, health=health_report(), efa=False))
    assert not missing.result.passed and "fi_pingpong not found" in missing.result.figure
    absent = health_report("absent_by_design", "efa_devices", "TEST DOUBLE: no EFA in the lab")
    lab = judged(tmp_path, node_check(tmp_path, health=absent, efa=False))
    assert lab.result.passed and "efa loopback absent_by_design" in lab.result.figure


def test_no_baseline_is_reported_not_passed(tmp_path: Path) -> None:
    nccl = settings("p5.48xlarge", None, 0.9, 1, "all_reduce")
    output = nodecheck.split(node_check(tmp_path, health=health_report()))["gpu-st-p5-1"]
    verdict = nodecheck.judge(output, "gpu-st-p5-1", nccl, 8, 32)
    assert verdict.result.passed and not verdict.result.judged
    assert "no intra-node (1-node) all_reduce baseline for p5.48xlarge" in verdict.result.figure


def test_a_node_that_printed_nothing_fails(tmp_path: Path) -> None:
    nccl = settings("p5.48xlarge", None, 0.9, 1, "all_reduce")
    verdict = nodecheck.judge(None, "gpu-st-p5-9", nccl, 8, 32)
    assert not verdict.result.passed and "no output from the node stage" in verdict.result.figure


def test_labels_of_many_tasks_are_split_per_node() -> None:
    log = "".join(
        f"{i:>2}: @@gpuforge-accept node=n{i}\n{i:>2}: @@health begin\n{i:>2}: {{}}\n"
        f"{i:>2}: @@health end rc=0\n"
        for i in range(12)
    )
    outputs = nodecheck.split(log)
    assert sorted(outputs) == sorted(f"n{i}" for i in range(12))
    assert all(o.health_rc == "0" for o in outputs.values())


def test_scontrol_nodes_and_which_can_be_tested() -> None:
    text = (
        "NodeName=gpu-st-p5-1 Arch=x86_64 CPUTot=192 Gres=gpu:h100:8(S:0-1) State=IDLE+CLOUD Partitions=gpu "
        "Reason=\n"
        "NodeName=gpu-st-p5-2 Gres=gpu:8 State=IDLE+DRAIN+CLOUD Partitions=gpu,all "
        "Reason=gpuforge accept pairs: round 1 with gpu-st-p5-1 [root@2026-12-07T17:00:00]\n"
        "NodeName=gpu-dy-p5-3 Gres=(null) State=IDLE+CLOUD+POWERED_DOWN Partitions=gpu\n"
        "NodeName=gpu-st-p5-4 State=DOWN+NOT_RESPONDING Partitions=gpu Reason=Not responding\n"
    )
    nodes = slurm.parse_nodes(text)
    assert [(n.name, n.gpus, n.partitions) for n in nodes] == [
        ("gpu-st-p5-1", 8, ("gpu",)),
        ("gpu-st-p5-2", 8, ("gpu", "all")),
        ("gpu-dy-p5-3", 0, ("gpu",)),
        ("gpu-st-p5-4", 0, ("gpu",)),
    ]
    assert [n.untestable for n in nodes] == [
        None,
        "state IDLE+DRAIN+CLOUD (gpuforge accept pairs: round 1 with gpu-st-p5-1 [root@2026-12-07T17:00:00])",
        None,
        "state DOWN+NOT_RESPONDING (Not responding)",
    ]


def test_the_multi_node_environment_is_the_sbatch_scripts() -> None:
    """stages.NCCL_ENV and scripts/slurm/nccl-allreduce.sbatch set the same variables to the same defaults."""
    text = (REPO / "scripts/slurm/nccl-allreduce.sbatch").read_text()
    found = {}
    for name, value in re.findall(r'^export (\w+)="?([^"\n]*)"?$', text, re.MULTILINE):
        default = re.fullmatch(r"\$\{\w+:-(.*)\}", value)
        found[name] = default.group(1) if default else value
    adopted = "${NCCL_TESTS_LIBRARY_PATH:+${NCCL_TESTS_LIBRARY_PATH}:}"
    assert found["LD_LIBRARY_PATH"].startswith(adopted)
    found["LD_LIBRARY_PATH"] = found["LD_LIBRARY_PATH"].removeprefix(adopted).split("${")[0].rstrip(":")
    assert found == stages.NCCL_ENV


def _prefix_with_env(root: Path, library_path: str) -> Path:
    """An nccl-tests prefix as the nccl_tests role leaves it: build/all_reduce_perf (here a script printing
    its LD_LIBRARY_PATH) and the launch environment beside build/ (roles/nccl_tests: nccl_tests_env_file)."""
    (root / "build").mkdir(parents=True)
    binary = root / "build/all_reduce_perf"
    binary.write_text('#!/bin/sh\necho "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"\n')
    binary.chmod(0o755)
    (root / "env").write_text(f"# TEST FIXTURE\nNCCL_TESTS_LIBRARY_PATH={library_path}\n")
    return binary


def test_both_launchers_put_the_adopted_builds_library_directory_first(tmp_path: Path) -> None:
    """The role's env file names the adopted base build's NCCL directory (the DLAMI's
    /usr/local/cuda-13.0/lib): the sbatch script (run here with an srun TEST DOUBLE that runs its command)
    and gpuforge accept's node command both put it first on LD_LIBRARY_PATH; without the file, neither adds
    anything."""
    defaults = yaml.safe_load((REPO / "roles/nccl_tests/defaults/main.yml").read_text())
    assert defaults["nccl_tests_env_file"] == "{{ nccl_tests_prefix }}/env"
    binary = _prefix_with_env(tmp_path / "prefix", "/usr/local/cuda-13.0/lib")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/bin/bash\nwhile [[ $1 == -* ]]; do shift; done\nexec "$@"\n')
    (fake / "srun").chmod(0o755)
    env = {
        "PATH": f"{fake}:/usr/bin:/bin",
        "NCCL_TESTS_BIN": str(binary),
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_NTASKS": "1",
    }
    script = REPO / "scripts/slurm/nccl-allreduce.sbatch"
    sbatch = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True)
    launched = subprocess.run(
        ["bash", "-c", stages.LAUNCH, "nccl-tests", str(binary), "-b", "8"],
        env={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": stages.NCCL_ENV["LD_LIBRARY_PATH"]},
        capture_output=True,
        text=True,
        check=True,
    )
    for out in (sbatch.stdout, launched.stdout):
        line = next(x for x in out.splitlines() if x.startswith("LD_LIBRARY_PATH="))
        assert line.startswith("LD_LIBRARY_PATH=/usr/local/cuda-13.0/lib:/opt/amazon/ofi-nccl/lib:"), out
    (tmp_path / "prefix/env").unlink()
    bare = subprocess.run(
        ["bash", "-c", stages.LAUNCH, "nccl-tests", str(binary)],
        env={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/x"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert bare.stdout == "LD_LIBRARY_PATH=/x\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--iters", "0"], "0 must be at least 1"), (["--baseline", "/nonexistent/b.yml"], "does not exist")],
)
def test_bad_arguments_are_refused_by_argparse(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        gpuforge_cli.main(["accept", "--partition", "gpu", "--instance-type", "p5.48xlarge", *extra])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_without_slurm_the_command_says_where_to_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    code = gpuforge_cli.main(["accept", "--partition", "gpu", "--instance-type", "p5.48xlarge"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Slurm's commands are not on PATH" in err and "head node" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--instance-type", "c5n.18xlarge"], "has no GPUs"),
        (["--instance-type", "p9.hugexlarge"], "p9.hugexlarge"),
    ],
)
def test_bad_input_fails_before_slurm(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpuforge_cli.main(["accept", "--partition", "gpu", *argv]) == 2
    assert message in capsys.readouterr().err


def test_health_takes_the_dcgm_level_of_the_run(
    config: dict[str, Any],  # noqa: F811 (test_fleet_health's fixture)
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """gpuforge-health --dcgm-level N runs dcgmi diag -r N in place of the mode's configured level."""
    path = tmp_path / "health.json"
    path.write_text(json.dumps(config))
    HEALTH.main(["--config", str(path), "--mode", "adhoc", "--json", "--dcgm-level", "2"])
    results = {r["check"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert results["dcgm_diag"]["detail"] == "dcgmi diag -r 2 passed"
    HEALTH.main(["--config", str(path), "--mode", "adhoc", "--json"])
    results = {r["check"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert results["dcgm_diag"]["detail"] == "dcgmi diag -r 3 passed"


# TEST DOUBLE of all_reduce_perf for the fake Slurm: nccl-tests' output format (as the lab's stand-in
# prints it), 1 GiB to 8 GiB; the bus bandwidth is FAKE_BUSBW, or a quarter of it when one of the step's
# nodes (SLURMD_NODENAME alone, FAKE_STEP_NODES in a multi-node step) is listed in FAKE_SLOW.
FAKE_ALL_REDUCE = r"""#!/usr/bin/env python3
import os
rank = int(os.environ.get("SLURM_PROCID", "0"))
if rank:
    raise SystemExit(0)
nodes = os.environ.get("FAKE_STEP_NODES", "").split(",") if "SLURM_PROCID" in os.environ else []
nodes = nodes or [os.environ["SLURMD_NODENAME"]]
slow = set(os.environ.get("FAKE_SLOW", "").split(",")) & set(nodes)
busbw = float(os.environ["FAKE_BUSBW"]) / (4 if slow else 1)
print("# nccl-tests version 2.17.6 nccl-headers=22703 nccl-library=22703")
print("# Collective test starting: all_reduce_perf")
print("# nThread 1 nGpus 8 minBytes 1073741824 maxBytes 8589934592 step: 2(factor) warmup iters: 1 iters: 20")
for r, node in enumerate(nodes):
    print(f"#  Rank {r:2d} Group  0 Pid   100 on {node:>10} device  0 [0000:00:00] TEST DOUBLE")
half = "    time   algbw   busbw #wrong"
print("#       size         count      type   redop    root" + half + half)
size = 1 << 30
while size <= 8 << 30:
    cells = f"   1000.0  {busbw:6.2f}  {busbw:6.2f}      0"
    print(f"{size:12d}  {size // 4:12d}     float     sum      -1" + cells + cells)
    size *= 2
print("# Out of bounds values : 0 OK")
print(f"# Avg bus bandwidth    : {busbw}")
"""


@pytest.fixture
def fake_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Four p4d nodes in partition gpu behind the Slurm TEST DOUBLE, the health script passing on each."""
    state = tmp_path / "slurm"
    bin_dir = tmp_path / "fakebin"
    for directory in (state, bin_dir):
        directory.mkdir()
    nodes = {
        f"gpu-st-p4d-{i}": {"state": "IDLE", "partitions": ["gpu"], "gres": "gpu:8"} for i in range(1, 5)
    }
    nodes["gpu-st-p4d-5"] = {"state": "IDLE+DRAIN", "partitions": ["gpu"], "gres": "gpu:8"}
    (state / "nodes.json").write_text(json.dumps(nodes))
    for name in slurm.COMMANDS:
        (bin_dir / name).symlink_to(REPO / "tests/fixtures/accept/fakeslurm.py")
    all_reduce = bin_dir / "all_reduce_perf"
    all_reduce.write_text(FAKE_ALL_REDUCE)
    all_reduce.chmod(0o755)
    report = tmp_path / "health.json"
    report.write_text(health_report())
    health_bin = stand_in(bin_dir, "gpuforge-health", f"cat {report}")
    efa_dir = tmp_path / "efa"
    efa_dir.mkdir()
    # A p4d's four EFA devices: the first four of the recorded p5 listing.
    listing = tmp_path / "fi_info-4.txt"
    listing.write_text("".join(FI_INFO.read_text().splitlines(keepends=True)[:24]))
    stand_in(efa_dir, "fi_info", f"cat {listing}")
    stand_in(efa_dir, "fi_pingpong", "exit 0")
    base = tmp_path / "base.yml"
    base.write_text(
        "gpuforge_nccl_baselines:\n  p4d.24xlarge:\n    all_reduce:\n"
        + "".join(
            f"      - {{nodes: {n}, busbw_gb_s: 100, size_bytes: 8589934592, source: test}}\n"
            for n in (1, 2, 4)
        )
    )
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM", str(state))
    monkeypatch.setenv("FAKE_BUSBW", "99")
    monkeypatch.setattr(stages, "POLL_S", 0.05)
    argv = [
        "accept", "--partition", "gpu", "--instance-type", "p4d.24xlarge", "--baseline", str(base),
        "--all-reduce", str(all_reduce), "--health", health_bin, "--efa-bin", str(efa_dir),
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    return {"argv": argv, "state": state, "out": tmp_path / "out"}


@pytest.mark.slow
def test_fake_slurm_healthy_nodes_are_accepted_and_nothing_drained(
    fake_cluster: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpuforge_cli.main(fake_cluster["argv"]) == 0
    out = capsys.readouterr().out
    assert "projected wall time for 4 nodes" in out.splitlines()[0]
    assert "gpuforge accept: ACCEPTED (p4d.24xlarge, 4 nodes tested of 5)" in out
    assert "not tested: gpu-st-p4d-5 (state IDLE+DRAIN)" in out
    assert not (fake_cluster["state"] / "drained.json").exists()
    report = json.loads((fake_cluster["out"] / "report.json").read_text())
    assert report["accepted"] and [p["nodes"] for p in report["pairs"]] == [
        ["gpu-st-p4d-1", "gpu-st-p4d-2"],
        ["gpu-st-p4d-3", "gpu-st-p4d-4"],
    ]
    assert [(s["nodes"], s["result"]["passed"]) for s in report["doubling"]] == [(2, True), (4, True)]
    for picture in ("doubling.png", "pairs.png"):
        assert (fake_cluster["out"] / picture).read_bytes()[:4] == b"\x89PNG"
    calls = [json.loads(line) for line in (fake_cluster["state"] / "calls.log").read_text().splitlines()]
    allocations = [c for c in calls if c[0] == "salloc"]
    # One job per stage: the node stage, one pair round, two doubling steps; all exclusive, --no-kill.
    assert len(allocations) == 4 and all("--exclusive" in c and "--no-kill" in c for c in allocations)
    multi = [c for c in calls if c[0] == "srun" and "--mpi=pmix" in c]
    assert multi and all(f"NCCL_SOCKET_IFNAME={stages.NCCL_ENV['NCCL_SOCKET_IFNAME']}" in c for c in multi)
    assert all("--gpus-per-node=8" in c for c in calls if c[0] in ("salloc", "srun"))


@pytest.mark.slow
def test_fake_slurm_slow_node_is_named_drained_and_the_rest_accepted(
    fake_cluster: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SLOW", "gpu-st-p4d-3")
    assert gpuforge_cli.main(fake_cluster["argv"]) == 1
    out = capsys.readouterr().out
    drained = json.loads((fake_cluster["state"] / "drained.json").read_text())
    assert list(drained) == ["gpu-st-p4d-3"]
    assert drained["gpu-st-p4d-3"].startswith(
        "gpuforge accept node: all_reduce alone: all_reduce FAIL: busbw 24.75"
    )
    assert "failed gpu-st-p4d-3: node: all_reduce alone" in out and "drained: gpu-st-p4d-3" in out
    report = json.loads((fake_cluster["out"] / "report.json").read_text())
    assert {n: v["status"] for n, v in report["nodes"].items()} == {
        "gpu-st-p4d-1": "accepted",
        "gpu-st-p4d-2": "accepted",
        "gpu-st-p4d-3": "failed",
        "gpu-st-p4d-4": "accepted",
        "gpu-st-p4d-5": "not tested",
    }


@pytest.mark.slow
def test_fake_slurm_report_only_drains_nothing(
    fake_cluster: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SLOW", "gpu-st-p4d-2")
    assert gpuforge_cli.main([*fake_cluster["argv"], "--report-only"]) == 1
    assert "--report-only: would drain gpu-st-p4d-2" in capsys.readouterr().out
    assert not (fake_cluster["state"] / "drained.json").exists()


def wrap_srun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: Path, body: str) -> None:
    """A TEST DOUBLE around the fake srun: `body` (bash) runs for the node stage's step (--label),
    with $REAL the fake srun; other steps go straight to it."""
    wrap = tmp_path / "wrap"
    wrap.mkdir()
    real = state.parent / "fakebin" / "srun"
    stand_in(
        wrap,
        "srun",
        f'REAL={real}\nif [[ " $* " == *" --label "* ]]; then\n{body}\nfi\nexec "$REAL" "$@"',
    )
    monkeypatch.setenv("PATH", f"{wrap}:{os.environ['PATH']}")


@pytest.mark.slow
def test_fake_slurm_a_node_stage_srun_that_fails_drains_nobody(
    fake_cluster: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The review's case: srun cannot create the step. Before: every node 'no output' -> FAILED -> drained."""
    wrap_srun(
        tmp_path,
        monkeypatch,
        fake_cluster["state"],
        "echo 'srun: error: Unable to create step for job 4242: Invalid generic resource (gres) "
        "specification' >&2; exit 1",
    )
    assert gpuforge_cli.main(fake_cluster["argv"]) == 1
    out = capsys.readouterr().out
    assert not (fake_cluster["state"] / "drained.json").exists()
    report = json.loads((fake_cluster["out"] / "report.json").read_text())
    tested = {n: v for n, v in report["nodes"].items() if v["status"] != "not tested"}
    assert {v["status"] for v in tested.values()} == {"unresolved"}
    figure = tested["gpu-st-p4d-1"]["figure"]
    assert (
        "no result (no output): the node stage's srun exited 1 (srun: error: Unable to create step" in figure
    )
    assert "unresolved gpu-st-p4d-1: node: no result" in out


@pytest.mark.slow
def test_fake_slurm_a_node_stage_cut_by_its_time_limit_leaves_the_rest_unresolved(
    fake_cluster: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Only task 0 finished before the limit: it is judged; the others are unresolved, not drained."""
    wrap_srun(
        tmp_path,
        monkeypatch,
        fake_cluster["state"],
        '"$REAL" "$@" | grep "^0: "\n'
        "echo 'slurmstepd: error: *** STEP 4242.0 ON gpu-st-p4d-1 CANCELLED AT 2026-12-07T18:00:00 DUE TO "
        "TIME LIMIT ***'\nexit 1",
    )
    monkeypatch.setenv("FAKE_SLOW", "gpu-st-p4d-1")
    assert gpuforge_cli.main(fake_cluster["argv"]) == 1
    capsys.readouterr()
    drained = json.loads((fake_cluster["state"] / "drained.json").read_text())
    assert list(drained) == ["gpu-st-p4d-1"]
    report = json.loads((fake_cluster["out"] / "report.json").read_text())
    for node in ("gpu-st-p4d-2", "gpu-st-p4d-3", "gpu-st-p4d-4"):
        assert report["nodes"][node]["status"] == "unresolved"
        assert "DUE TO TIME LIMIT" in report["nodes"][node]["figure"]


def test_a_time_limit_below_the_projected_node_stage_is_refused(
    fake_cluster: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """dcgmi diag level 4 (an hour, projected) does not fit the default 60-minute stage job."""
    code = gpuforge_cli.main([*fake_cluster["argv"], "--dcgm-level", "4"])
    err = capsys.readouterr().err
    assert code == 2
    assert "the node stage is projected at 62 min (dcgmi diag level 4), over --time-limit 60" in err
    assert "--time-limit 78 or more" in err
    calls = (fake_cluster["state"] / "calls.log").read_text()
    assert "salloc" not in calls


@pytest.mark.slow
def test_fake_slurm_nothing_judged_is_not_accepted_unless_asked(
    fake_cluster: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The review's case: an empty baseline file. Before: ACCEPTED, exit 0, with nothing judged."""
    argv = list(fake_cluster["argv"])
    empty = tmp_path / "empty.yml"
    empty.write_text("gpuforge_nccl_baselines: {}\n")
    argv[argv.index("--baseline") + 1] = str(empty)
    assert gpuforge_cli.main(argv) == 3
    captured = capsys.readouterr()
    first = next(line for line in captured.out.splitlines() if "ACCEPTED" in line)
    assert first.startswith(
        "gpuforge accept: NOT ACCEPTED (p4d.24xlarge, 4 nodes tested of 5): 4 pair/doubling"
    )
    assert "not judged (pair gpu-st-p4d-1 + gpu-st-p4d-2: all_reduce SKIP" in first
    assert "WARNING: empty.yml has no 1-node all_reduce baseline for p4d.24xlarge" in captured.err
    assert "no all_reduce baseline for p4d.24xlarge at 2, 4 nodes" in captured.err
    assert gpuforge_cli.main([*argv, "--accept-unjudged"]) == 0
    assert "ACCEPTED (p4d.24xlarge, 4 nodes tested of 5) with --accept-unjudged" in capsys.readouterr().out


@pytest.mark.slow
def test_fake_slurm_without_a_1_node_baseline_a_slow_nvlink_node_fails_against_its_peers(
    fake_cluster: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    argv = list(fake_cluster["argv"])
    multi = tmp_path / "multi.yml"
    multi.write_text(
        "gpuforge_nccl_baselines:\n  p4d.24xlarge:\n    all_reduce:\n"
        + "".join(
            f"      - {{nodes: {n}, busbw_gb_s: 100, size_bytes: 8589934592, source: test}}\n" for n in (2, 4)
        )
    )
    argv[argv.index("--baseline") + 1] = str(multi)
    monkeypatch.setenv("FAKE_SLOW", "gpu-st-p4d-2")
    assert gpuforge_cli.main(argv) == 1
    capsys.readouterr()
    drained = json.loads((fake_cluster["state"] / "drained.json").read_text())
    assert list(drained) == ["gpu-st-p4d-2"]
    assert drained["gpu-st-p4d-2"].startswith(
        "gpuforge accept node: all_reduce alone: busbw 24.75 GB/s at 8589934592 B is 25% of the median of "
        "4 nodes (99.00 GB/s), below 90% (no 1-node baseline: relative check)"
    )


@pytest.mark.slow
def test_fake_slurm_pairs_and_steps_run_one_rank_per_gpu_as_the_sbatch(
    fake_cluster: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpuforge_cli.main(fake_cluster["argv"]) == 0
    capsys.readouterr()
    calls = [json.loads(line) for line in (fake_cluster["state"] / "calls.log").read_text().splitlines()]
    multi = [c for c in calls if c[0] == "srun" and "--mpi=pmix" in c]
    assert multi
    for call in multi:
        nodes = len(next(a for a in call if a.startswith("--nodelist=")).split("=", 1)[1].split(","))
        assert "--ntasks-per-node=8" in call and f"--ntasks={8 * nodes}" in call and "--cpu-bind=none" in call
        assert call[call.index("-g") + 1] == "1"
    (alone,) = [c for c in calls if c[0] == "srun" and "--label" in c]
    assert "--ntasks-per-node=1" in alone and "--cpu-bind=none" not in alone


@pytest.mark.slow
def test_fake_slurm_a_drain_that_fails_keeps_the_report_and_drains_the_rest(
    fake_cluster: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """scontrol refuses one drain (not root, say): the others are drained, report.json says which failed."""
    wrap = tmp_path / "wrap"
    wrap.mkdir()
    real = fake_cluster["state"].parent / "fakebin" / "scontrol"
    stand_in(
        wrap,
        "scontrol",
        'if [[ "$*" == *"nodename=gpu-st-p4d-1 "* ]]; then\n'
        '  echo "slurm_update error: Access/permission denied" >&2; exit 1\n'
        f'fi\nexec {real} "$@"',
    )
    monkeypatch.setenv("PATH", f"{wrap}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLOW", "gpu-st-p4d-1,gpu-st-p4d-3")
    assert gpuforge_cli.main(fake_cluster["argv"]) == 1
    out = capsys.readouterr().out
    assert list(json.loads((fake_cluster["state"] / "drained.json").read_text())) == ["gpu-st-p4d-3"]
    report = json.loads((fake_cluster["out"] / "report.json").read_text())
    assert "Access/permission denied" in report["drain_errors"]["gpu-st-p4d-1"]
    assert report["nodes"]["gpu-st-p4d-3"]["drained"] and not report["nodes"]["gpu-st-p4d-1"]["drained"]
    assert "NOT drained gpu-st-p4d-1: scontrol update nodename=gpu-st-p4d-1 failed" in out


@pytest.mark.slow
def test_fake_slurm_an_allocation_that_fails_mid_run_keeps_a_partial_report(
    fake_cluster: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    wrap = tmp_path / "wrap"
    wrap.mkdir()
    real = fake_cluster["state"].parent / "fakebin" / "salloc"
    stand_in(
        wrap,
        "salloc",
        'if [[ "$*" == *"pairs-1"* ]]; then echo "salloc: error: Job submit/allocate failed: Node count '
        f'specification invalid" >&2; exit 1; fi\nexec {real} "$@"',
    )
    monkeypatch.setenv("PATH", f"{wrap}:{os.environ['PATH']}")
    assert gpuforge_cli.main(fake_cluster["argv"]) == 1
    assert "Node count specification invalid" in capsys.readouterr().err
    report = json.loads((fake_cluster["out"] / "report.json").read_text())
    assert report["partial"] and not report["accepted"] and "Node count" in report["error"]
    assert sorted(report["node_stage"]) == [f"gpu-st-p4d-{i}" for i in range(1, 5)]


def test_busy_nodes_are_left_out_not_waited_for() -> None:
    nodes = slurm.parse_nodes(
        "NodeName=gpu-st-p5-1 Gres=gpu:8 State=ALLOCATED Partitions=gpu\n"
        "NodeName=gpu-st-p5-2 Gres=gpu:8 State=MIXED+CLOUD Partitions=gpu\n"
        "NodeName=gpu-st-p5-3 Gres=gpu:8 State=IDLE+CLOUD Partitions=gpu\n"
    )
    assert [n.untestable for n in nodes] == [
        "busy: state ALLOCATED (a job runs there; accept it again when the job ends)",
        "busy: state MIXED+CLOUD (a job runs there; accept it again when the job ends)",
        None,
    ]


def test_an_salloc_that_is_never_granted_cancels_its_pending_job(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """ParallelCluster's InactiveLimit=0 keeps a pending salloc queued after its process is killed."""
    calls: list[list[str]] = []

    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(list(argv))
        if argv[0] == "salloc":
            raise subprocess.TimeoutExpired(argv, kwargs["timeout"])
        return subprocess.CompletedProcess(argv, 0, "gpu-st-p5-[1-2]\n", "")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(getpass, "getuser", lambda: "ubuntu")
    runner = slurm.Slurm(tmp_path, "gpu", 10, "gpuforge-accept")
    with pytest.raises(ExternalError, match="salloc for node was not granted in 10 min"):
        runner.allocate(["gpu-st-p5-1", "gpu-st-p5-2"], "node", 8)
    assert calls[-1] == ["scancel", "--name=gpuforge-accept-node", "--user=ubuntu", "--state=PENDING"]


def test_a_malformed_node_list_is_a_usage_error(
    fake_cluster: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    wrap = tmp_path / "wrap"
    wrap.mkdir()
    stand_in(wrap, "scontrol", 'echo "scontrol: error: Invalid node name specified" >&2; exit 1')
    monkeypatch.setenv("PATH", f"{wrap}:{os.environ['PATH']}")
    code = gpuforge_cli.main(["accept", "--nodes", "gpu-st-p5-[1-", "--instance-type", "p5.48xlarge"])
    err = capsys.readouterr().err
    assert code == 2 and "--nodes 'gpu-st-p5-[1-' is not a Slurm node list" in err


def test_accept_never_judges_a_step_against_a_smaller_clusters_figure() -> None:
    """p4de has a 2-node figure only: nccl-report still uses it for 4 nodes (and says so); accept's
    doubling does not (not judged, so not accepted without --accept-unjudged)."""
    from gpuforge.nccl import baseline

    table = baseline.load(baseline.default_file())
    file = baseline.default_file()
    report = baseline.choose(table, file, "p4de.24xlarge", "all_reduce", 4)
    assert report is not None and "used for a 4-node run" in report.describe()
    assert baseline.choose(table, file, "p4de.24xlarge", "all_reduce", 4, beyond_largest=False) is None
    assert baseline.choose(table, file, "p5.48xlarge", "all_reduce", 3, beyond_largest=False) is not None
    assert baseline.choose(table, file, "p5.48xlarge", "all_reduce", 64, beyond_largest=False) is None
