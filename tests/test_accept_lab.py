"""`gpuforge accept` through real Slurm (slurmctld/slurmd 22.05, munge, PMIx) on a lab cluster.

Four lab hosts (head + 3 compute) booted from this tree's golden lab image and configured by
playbooks/fleet.yml, as in test_fleet_lab. The compute nodes carry the nccl-tests stand-in (a TEST
FIXTURE printing all_reduce_perf's real output format, tests/fixtures/artifacts/nccl-tests) and the
real gpuforge-health. `gpuforge accept` runs here, in the checkout; Slurm's commands it calls (sinfo,
scontrol, salloc, srun, scancel) run on the lab's head node, reached over the lab's ssh by wrappers of
those names (the lab's head carries the node runtime, not the CLI): every allocation, step, label
and drain is real Slurm's.

What the lab cannot show: real GPUs (dcgmi diag and the NVLink bandwidth; gpuforge-health reports
the GPU checks absent_by_design, the lab's one test-double switch), real EFA (no fi_info or
fi_pingpong: the loopbacks are reported absent, and the pairs' network is not checked for EFA) and
real bandwidth (the stand-in's figures come from a fixed time; a lab-only knob,
/etc/gpuforge-lab/all_reduce_perf.slow, makes one host report a fraction of them). The baselines are
recorded here with `gpuforge nccl-baseline` from the stand-in's own runs, as an operator records a
known-good cluster's. On a real cluster the same command runs unchanged on the head node, with
gpuforge-health, fi_pingpong and nccl-tests where the bake put them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import goldenlab
import labtools
from gpuforge.accept import slurm
from gpuforge_lab import core as lab_core
from labtools import LAB_MARKS, gpuforge, gpuforge_lab, lab_up

LAB = labtools.lab_name("accept")
KNOB = "/etc/gpuforge-lab/all_reduce_perf.slow"
ALL_REDUCE = "/opt/nccl-tests/build/all_reduce_perf"

pytestmark = [*LAB_MARKS, pytest.mark.slow]

WRAPPER = """#!{python}
# TEST TRANSPORT: runs Slurm's {name} on the lab's head node with these arguments, quoted for its shell.
import os, shlex, sys
command = "sudo " + shlex.join([{name!r}, *sys.argv[1:]])
lab = ["-m", "gpuforge_lab.cli", "ssh", "--name", {lab!r}, {head!r}, "--", command]
os.execv({python!r}, [{python!r}, *lab])
"""


def on(host: str, command: str, check: bool = True) -> str:
    return labtools.on(LAB, host, command, check=check)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    info = lab_up(LAB, 4, image=goldenlab.shared_golden_image()["image"])
    env = lab_core.env_exports(LAB)
    labtools.put_munge_key(env)
    run = labtools.playbook(env, "--flush-cache", "playbooks/fleet.yml")
    assert run.returncode == 0, run.stdout[-6000:]
    head = next(h["name"] for h in info["hosts"] if h["role"] == "HeadNode")
    compute = sorted(h["name"] for h in info["hosts"] if h["role"] == "Compute")
    bin_dir = tmp_path_factory.mktemp("slurm-on-head")
    for name in slurm.COMMANDS:
        path = bin_dir / name
        path.write_text(WRAPPER.format(python=sys.executable, name=name, lab=LAB, head=head))
        path.chmod(0o755)
    work = tmp_path_factory.mktemp("accept")
    yield {"head": head, "compute": compute, "path": f"{bin_dir}:{labtools.BIN}", "work": work}
    gpuforge_lab("down", "--name", LAB)


def accept(cluster: dict[str, Any], out: Path, *extra: str) -> Any:
    return gpuforge(
        "accept", "--nodes", ",".join(cluster["compute"]), "--instance-type", "p5.48xlarge", "--iters", "5",
        "--time-limit", "10", "--out", str(out), *extra,
        env={"PATH": f"{cluster['path']}:{os.environ['PATH']}"}, timeout=1200,
    )  # fmt: skip


@pytest.fixture(scope="module")
def baseline(cluster: dict[str, Any]) -> Path:
    """1-, 2- and 3-node baselines recorded from the stand-in's runs with `gpuforge nccl-baseline`, as an
    operator records them on a known-good cluster (every node count the doubling reaches)."""
    head, compute = cluster["head"], cluster["compute"]
    work: Path = cluster["work"]
    logs = []
    for count in (1, 2, 3):
        nodes = ",".join(compute[:count])
        text = on(
            head,
            f"srun --nodes={count} --ntasks-per-node=1 --mpi=pmix --nodelist={nodes} "
            f"{ALL_REDUCE} -b 8 -e 8G -f 2 -g 8 -c 1 -n 5",
        )
        logs.append(work / f"nodes-{count}.log")
        logs[-1].write_text(text)
    path = work / "lab-baseline.yml"
    recorded = gpuforge(
        "nccl-baseline", *map(str, logs), "--instance-type", "p5.48xlarge", "--out", str(path)
    )
    assert recorded.returncode == 0, recorded.stderr
    assert all(f"{n} nodes" in recorded.stdout for n in (1, 2, 3)), recorded.stdout
    return path


def node_state(cluster: dict[str, Any], node: str) -> dict[str, str]:
    text = on(cluster["head"], f"scontrol --oneliner show node {node}")
    fields = dict(re.findall(r"(\w+)=(\S+)", text))
    fields["Reason"] = text.split(" Reason=", 1)[1].strip() if " Reason=" in text else ""
    return fields


def test_without_a_baseline_for_the_stand_in_nothing_passes_and_report_only_drains_nothing(
    cluster: dict[str, Any],
) -> None:
    """Judged against the published p5 figures, the stand-in's pairs all fall far short: every node is
    named unresolved (no node passed a pair, so none is a reference to tell which), and --report-only
    leaves Slurm untouched."""
    out = cluster["work"] / "published"
    run = accept(cluster, out, "--report-only")
    assert run.returncode == 1, run.stdout + run.stderr
    report = json.loads((out / "report.json").read_text())
    assert {n: v["status"] for n, v in report["nodes"].items()} == dict.fromkeys(
        cluster["compute"], "unresolved"
    )
    assert re.search(
        r"busbw [\d.]+ GB/s at >= 8589934592 B is \d+% of the baseline, below 90%",
        report["pairs"][0]["figure"],
    )
    for node in cluster["compute"]:
        assert "DRAIN" not in node_state(cluster, node)["State"]


def test_healthy_lab_is_accepted_and_nothing_drained(cluster: dict[str, Any], baseline: Path) -> None:
    out = cluster["work"] / "healthy"
    run = accept(cluster, out, "--baseline", str(baseline))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "gpuforge accept: ACCEPTED (p5.48xlarge, 3 nodes tested of 3)" in run.stdout
    assert "projected wall time for 3 nodes" in run.stdout
    report = json.loads((out / "report.json").read_text())
    assert all(v["status"] == "accepted" and not v["drained"] for v in report["nodes"].values())
    assert [(s["nodes"], s["result"]["passed"]) for s in report["doubling"]] == [(2, True), (3, True)]
    for node in cluster["compute"]:
        assert "DRAIN" not in node_state(cluster, node)["State"]
        # What the lab cannot show is said, never passed: the GPUs and the EFA devices are absent by design.
        assert "efa loopback absent_by_design" in report["alone"][node]["figure"]
    assert (out / "doubling.png").stat().st_size > 0 and (out / "pairs.png").stat().st_size > 0


def test_a_slow_host_is_named_and_drained_and_the_other_kept(cluster: dict[str, Any], baseline: Path) -> None:
    """The slow host fails alone, is drained with the figure; the other two pass as a pair, the doubling
    reaches them both, and they are accepted."""
    slow = cluster["compute"][1]
    kept = [n for n in cluster["compute"] if n != slow]
    on(slow, f"mkdir -p /etc/gpuforge-lab && echo 0.5 > {KNOB}")
    try:
        out = cluster["work"] / "slow"
        run = accept(cluster, out, "--baseline", str(baseline))
        assert run.returncode == 1, run.stdout + run.stderr
        report = json.loads((out / "report.json").read_text())
        assert report["nodes"][slow]["status"] == "failed" and report["nodes"][slow]["drained"]
        for node in kept:
            assert report["nodes"][node]["status"] == "accepted", report["nodes"][node]
            assert not report["nodes"][node]["drained"]
            assert "DRAIN" not in node_state(cluster, node)["State"]
        assert [(s["nodes"], s["result"]["passed"]) for s in report["doubling"]] == [(2, True)]
        state = node_state(cluster, slow)
        assert "DRAIN" in state["State"]
        assert re.match(
            r"gpuforge accept node: all_reduce alone: all_reduce FAIL: busbw 7\.\d+ GB/s", state["Reason"]
        )
        assert "50% of the baseline, below 90%" in state["Reason"]
        assert f"failed {slow}: node: all_reduce alone" in run.stdout and f"drained: {slow}" in run.stdout
    finally:
        on(slow, f"rm -f {KNOB}")
        on(cluster["head"], f"scontrol update nodename={shlex.quote(slow)} state=RESUME", check=False)
