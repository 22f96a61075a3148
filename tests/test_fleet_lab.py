"""The fleet roles on a lab cluster: real slurmctld/slurmd, sbatch, a rolling update, ansible-pull.

Three lab hosts (head + 2 compute, systemd-nspawn, real systemd and sshd) found through the real
aws_ec2 inventory against moto (the test double for EC2 and SSM). Needs root and systemd-nspawn;
takes several minutes.

The hosts boot from this tree's golden lab image (tests/goldenlab.py: baked once per tree and shared
with test_ami_local_bake and test_partial_failure_lab), as a fleet's nodes boot from the baked AMI:
munge and the Slurm daemons are already installed, so fleet.yml only finds them there and configures.
Its installing them on a bare host (the slurm role's install.yml, a configure-phase run with no
install phase before it) is covered by molecule/slurm, whose hosts are bare; the whole install
phase on bare hosts by molecule/stack, test_twins and the bake itself.
"""

from __future__ import annotations

import base64
import json
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

import goldenlab
import labtools
import ssmdouble
from gpuforge import cli as gpuforge_cli
from gpuforge import versions
from gpuforge.fleet import document as fleet_document
from gpuforge.nccl.parse import parse as parse_nccl
from gpuforge_lab import core as lab_core
from labtools import LAB_MARKS, REPO, gpuforge_lab, lab_up, recap

LAB = labtools.lab_name("fleet")
SITE = "playbooks/fleet.yml"

pytestmark = [*LAB_MARKS, pytest.mark.slow]


def on(host: str, command: str, check: bool = True) -> str:
    """Run a shell command on a host of this module's lab as root; its stdout."""
    return labtools.on(LAB, host, command, check=check)


def playbook(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return labtools.playbook(env, "--flush-cache", *args)


def job(head: str, job_id: str) -> dict[str, str]:
    """The job's record once its nodes' epilogs have run: sbatch --wait returns while the job is still
    COMPLETING (the health checks, which take seconds under load)."""
    text = on(
        head,
        f"for i in $(seq 300); do s=$(scontrol show job {job_id} --oneliner); "
        'case "$s" in *JobState=COMPLETING*) sleep 1 ;; *) break ;; esac; done; echo "$s"',
    )
    return dict(re.findall(r"(\w+)=(\S+)", text))


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    """The lab, its environment, and the cluster brought up by the fleet roles."""
    info = lab_up(LAB, 3, image=goldenlab.shared_golden_image()["image"])
    env = lab_core.env_exports(LAB)
    # The munge key lives in SSM Parameter Store (moto here), where the slurm role reads it.
    key = labtools.put_munge_key(env)
    run = playbook(env, SITE)
    assert run.returncode == 0, run.stdout[-6000:]
    hosts = {h["role"]: h["name"] for h in info["hosts"]}
    yield {
        "env": env,
        "info": info,
        "munge_key": key,
        "first_run": run.stdout,
        "head": hosts["HeadNode"],
        "compute": [h["name"] for h in info["hosts"] if h["role"] == "Compute"],
    }
    gpuforge_lab("down", "--name", LAB)


def test_sinfo_shows_the_compute_nodes_idle(cluster: dict[str, Any]) -> None:
    """slurmctld on the head node knows both compute nodes and they are idle."""
    states = dict(
        line.split() for line in on(cluster["head"], "sinfo --noheader --Node --format='%N %T'").splitlines()
    )
    assert states == {name: "idle" for name in cluster["compute"]}


def test_munge_key_comes_from_ssm_with_mode_0400(cluster: dict[str, Any]) -> None:
    """Every node has the SSM key, owned by munge, readable by nobody else."""
    for host in [cluster["head"], *cluster["compute"]]:
        assert on(host, "stat -c '%U %a' /etc/munge/munge.key").split() == ["munge", "400"]
        assert on(host, "cat /etc/munge/munge.key") == cluster["munge_key"]
    assert cluster["munge_key"] not in cluster["first_run"]


@pytest.mark.parametrize("index", [0, 1], ids=["compute-1", "compute-2"])
def test_sbatch_job_sees_the_nccl_environment(cluster: dict[str, Any], index: int) -> None:
    """A batch job gets every setting of the node's nccl.env via the task prolog; on a p5 that file leaves
    the provider and the platform settings (NCCL_BUFFSIZE...) to the aws-ofi-nccl plugin."""
    node = cluster["compute"][index]
    submitted = on(
        cluster["head"], f"sbatch --parsable --wait -w {node} -o /tmp/env-%j.out --wrap 'env | sort'"
    )
    job_id = submitted.strip().split(";")[0]
    assert job(cluster["head"], job_id)["JobState"] == "COMPLETED"
    job_env = set(on(node, f"cat /tmp/env-{job_id}.out").splitlines())
    tuned = {
        line
        for line in on(node, "cat /etc/gpuforge/nccl.env").splitlines()
        if line and not line.startswith("#")
    }
    assert not any(line.startswith(("FI_PROVIDER=", "NCCL_BUFFSIZE=")) for line in tuned)
    assert any(line.startswith("NCCL_SOCKET_IFNAME=") for line in tuned)
    assert any(line.startswith("NCCL_DEBUG=") for line in tuned)
    assert tuned <= job_env


def test_nccl_allreduce_sbatch_runs_the_baked_nccl_tests(cluster: dict[str, Any], tmp_path: Path) -> None:
    """The golden image carries nccl-tests as the nccl_tests role built it in the bake (from the lab's
    stand-in source, a TEST FIXTURE: lab hosts have no GPU and no CUDA compiler; that a rerun changes
    nothing is test_ami_local_bake's install-phase rerun). scripts/slurm/nccl-allreduce.sbatch launches
    it with srun --mpi=pmix over both compute nodes and `gpuforge nccl-report` judges the log.

    Lab overrides, on the sbatch command line and nothing else: one task per node, and the
    --gpus-per-node directive dropped (lab nodes have no GPU gres). The stand-in takes its rank from
    srun's environment, not from MPI: the PMIx wire-up of a real MPI program is not shown here."""
    head, nodes = cluster["head"], cluster["compute"]
    pin = versions.load().version("nccl_tests")
    for node in nodes:
        assert json.loads(on(node, "cat /opt/nccl-tests/gpuforge-build.json"))["version"] == pin
        on(node, "test -x /opt/nccl-tests/build/all_reduce_perf")
    script = "\n".join(
        line
        for line in (REPO / "scripts/slurm/nccl-allreduce.sbatch").read_text().splitlines()
        if not line.startswith("#SBATCH --gpus-per-node")
    )
    encoded = base64.b64encode(f"{script}\n".encode()).decode()
    on(head, f"echo {encoded} | base64 -d > /tmp/nccl-allreduce.sbatch")
    submitted = on(
        head,
        f"sbatch --parsable --wait --nodes=2 --ntasks-per-node=1 -w {','.join(nodes)} --chdir=/tmp "
        "-o /tmp/nccl-%j.out --export=ALL,NCCL_MAX_BYTES=8G,NCCL_ITERS=5 /tmp/nccl-allreduce.sbatch",
    )
    job_id = submitted.strip().split(";")[0]
    state = job(head, job_id)
    log = on(state["BatchHost"], f"cat /tmp/nccl-{job_id}.out")
    assert state["JobState"] == "COMPLETED", log[-3000:]
    assert f"# nccl-tests version {pin} " in log
    (run,) = parse_nccl(log, "lab")
    assert run.complete and len(run.hosts) == 2
    (tmp_path / "nccl.out").write_text(log)
    argv = [
        "nccl-report",
        str(tmp_path / "nccl.out"),
        "--instance-type",
        "p5.48xlarge",
        "--out",
        str(tmp_path / "r"),
    ]
    # It ran no collective: its bus bandwidth (from a fixed one-second time) fails the p5 baseline.
    assert gpuforge_cli.main(argv) == 1
    assert "2 nodes" in (tmp_path / "r/report.md").read_text()


def test_second_run_changes_nothing(cluster: dict[str, Any]) -> None:
    """Running the fleet roles again reports changed=0 on every host."""
    run = playbook(cluster["env"], SITE)
    assert run.returncode == 0, run.stdout[-4000:]
    stats = recap(run.stdout)
    assert len(stats) == 3
    assert {host: s["changed"] for host, s in stats.items()} == {host: 0 for host in stats}


def test_a_lab_node_without_the_test_double_fails_and_is_drained(cluster: dict[str, Any]) -> None:
    """Without gpuforge_lab_hardware_absent a lab "p5.48xlarge" is a p5 without its GPUs and EFA.

    Its post-boot check and its job prolog fail, and each drains the node on the real slurmctld
    with a reason naming the failed checks; a job sent there does not run. Put back with the test
    double, the node checks healthy and takes jobs again.
    """
    head, node = cluster["head"], cluster["compute"][1]
    ip = next(h["ip"] for h in cluster["info"]["hosts"] if h["name"] == node)
    limit = ("--limit", f"ip-{ip.replace('.', '-')}.ec2.internal", "--tags", "health")
    try:
        run = playbook(cluster["env"], SITE, *limit, "-e", "gpuforge_lab_hardware_absent=false")
        assert run.returncode == 0, run.stdout[-4000:]
        assert json.loads(on(node, "cat /etc/gpuforge/health.json"))["hardware_absent_by_design"] is False
        # The post-boot run, as systemd starts it at boot.
        assert "failed" in on(
            node,
            "systemctl start gpuforge-health-boot.service; systemctl is-failed gpuforge-health-boot",
            check=False,
        )
        shown = on(head, f"scontrol show node {node}")
        assert "Reason=gpuforge-health boot: gpu_count" in shown, shown
        assert "0 of 8 GPUs usable" in on(node, "journalctl -u gpuforge-health-boot --no-pager -q")
        on(head, f"scontrol update NodeName={node} State=RESUME")
        # A job's prolog: the node is drained again, naming the check, and the job does not run there.
        job_id = on(head, f"sbatch --parsable -w {node} -o /dev/null --wrap true").strip()
        reason = ""
        for _ in range(60):
            reason = on(head, f"sinfo --noheader --nodes={node} --format='%T|%E'").strip()
            if "gpuforge-health prolog" in reason:
                break
            time.sleep(1)
        assert reason.startswith("drain") and "gpuforge-health prolog: gpu_count" in reason, reason
        assert "efa_devices" in reason
        assert job(head, job_id)["JobState"] != "COMPLETED"
        on(head, f"scancel {job_id}")
    finally:
        # Back to the lab's test double: the same checks report absent_by_design and pass.
        run = playbook(cluster["env"], SITE, *limit)
        assert run.returncode == 0, run.stdout[-4000:]
        on(head, f"scontrol update NodeName={node} State=RESUME", check=False)
    assert "ABSENT_BY_DESIGN gpu_count" in on(node, "/usr/local/sbin/gpuforge-health --mode prolog")
    states = dict(line.split() for line in on(head, "sinfo --noheader --Node --format='%N %T'").splitlines())
    assert states[node] == "idle"


# A job that runs until its node is draining, then a little longer: the drain must find it running
# however slowly the update reaches the node (fixed sleeps of 20 and 30 s ended first under CI's load).
_UNTIL_DRAINED = (
    'for i in $(seq 600); do scontrol show node $(hostname -s) | grep -q "State=.*DRAIN" && break; '
    "sleep 1; done; sleep 3"
)


@pytest.fixture
def no_job_left(cluster: dict[str, Any]) -> Iterator[None]:
    """A job a failed test leaves running (they run until their node drains) is cancelled, so the next
    test's drain does not wait on it too."""
    yield
    on(cluster["head"], "squeue -h -o %i | xargs -r scancel", check=False)


def _job_failed(head: str, node: str, job_id: str, finished: dict[str, str]) -> str:
    """Why a job did not end as it should: its record, its node, and what slurmctld logged of it."""
    return "\n".join(
        (
            repr(finished),
            on(head, f"scontrol show node {node} --oneliner", check=False),
            on(head, f"grep -h 'JobId={job_id}' /var/log/slurm/slurmctld.log | tail -n 20", check=False),
        )
    )


def test_rolling_update_waits_for_the_running_job(
    cluster: dict[str, Any], tmp_path: Path, no_job_left: None
) -> None:
    """A tuning change rolls through drained nodes; the running job ends untouched; a dead host is named."""
    head, first = cluster["head"], cluster["compute"][0]
    job_id = on(
        head,
        f"sbatch --parsable -w {first} -o /tmp/sleep-%j.out --wrap 'echo start; {_UNTIL_DRAINED}; echo done'",
    )
    job_id = job_id.strip().split(";")[0]
    on(
        head,
        f"for i in $(seq 30); do squeue -h -j {job_id} -t R | grep -q . && exit 0; sleep 1; done; exit 1",
    )
    # A compute node that does not answer (nothing listens at .99 on the lab bridge).
    subnet = cluster["info"]["hosts"][0]["ip"].rsplit(".", 1)[0]
    ghost = tmp_path / "ghost.ini"
    ghost.write_text(f"[compute]\nghost-node ansible_host={subnet}.99 ansible_connection=ssh\n")
    run = playbook(
        cluster["env"],
        "-i",
        "inventory/aws_ec2.yml",
        "-i",
        str(ghost),
        "playbooks/rolling_update.yml",
        "-e",
        "nccl_tuning_debug=INFO",
        "-e",
        json.dumps({"rolling_update_roles": ["nccl_tuning"]}),
    )
    assert "ghost-node: unreachable" in run.stdout, run.stdout[-6000:]
    assert run.stdout.count(": updated'") == 2, run.stdout[-6000:]
    finished = job(head, job_id)
    why = _job_failed(head, first, job_id, finished)
    assert (finished["JobState"], finished["ExitCode"]) == ("COMPLETED", "0:0"), why
    assert on(first, f"cat /tmp/sleep-{job_id}.out").split() == ["start", "done"], why
    # The node was changed only after its job had ended.
    end = datetime.fromisoformat(finished["EndTime"]).timestamp()
    changed = float(on(first, "stat -c %Y /etc/gpuforge/nccl.env"))
    assert changed >= end, (changed, why)
    node = on(head, f"scontrol show node {first}")
    assert "Reason=gpuforge rolling update" not in node, node
    assert "drain" in on(head, "grep -i drain /var/log/slurm/slurmctld.log").lower(), why
    for name in cluster["compute"]:
        assert "NCCL_DEBUG=INFO" in on(name, "cat /etc/nccl.conf /etc/gpuforge/nccl.env"), name
    states = dict(line.split() for line in on(head, "sinfo --noheader --Node --format='%N %T'").splitlines())
    assert states == {name: "idle" for name in cluster["compute"]}, why


# A stand-in for the node-side entry point (TEST FIXTURE): it records when it ran. The SSM path is shown
# here, not the entry point itself (the node-side lab test below runs the real one).
_ENTRY_STANDIN = "/usr/local/sbin/gpuforge-node-ssm-standin"
_ENTRY_SCRIPT = '#!/bin/sh\ndate +%s.%N > /var/tmp/gpuforge-ssm-applied\necho "applied: $*"\n'


def test_ssm_apply_waits_for_the_running_job(cluster: dict[str, Any], no_job_left: None) -> None:
    """The shipped SSM document's script, run on both compute nodes by the Run Command stand-in
    (tests/ssmdouble.py, a TEST DOUBLE) one node at a time with MaxErrors 0: each node drains, its
    running job ends untouched, the entry point runs after it, and the node takes jobs again."""
    head, (first, second) = cluster["head"], cluster["compute"]
    job_id = on(
        head,
        f"sbatch --parsable -w {first} -o /tmp/ssm-%j.out --wrap 'echo start; {_UNTIL_DRAINED}; echo done'",
    )
    job_id = job_id.strip().split(";")[0]
    on(
        head,
        f"for i in $(seq 30); do squeue -h -j {job_id} -t R | grep -q . && exit 0; sleep 1; done; exit 1",
    )
    encoded = base64.b64encode(_ENTRY_SCRIPT.encode()).decode()
    for node in (first, second):
        on(node, f"echo {encoded} | base64 -d > {_ENTRY_STANDIN} && chmod 755 {_ENTRY_STANDIN}")
        on(node, "rm -f /var/tmp/gpuforge-ssm-applied")

    def execute(target: str, script: str) -> tuple[int, str]:
        payload = base64.b64encode(script.encode()).decode()
        command = f"echo {payload} | base64 -d > /tmp/ssm-apply.sh && sh /tmp/ssm-apply.sh"
        run = gpuforge_lab(
            "ssh", "--name", LAB, target, "--", f"sudo sh -c {shlex.quote(command)}", timeout=600
        )
        return run.returncode, run.stdout + run.stderr

    parameters = {"EntryPoint": _ENTRY_STANDIN, "PollSeconds": "2", "DrainTimeoutSeconds": "300"}
    runner = ssmdouble.document_runner(fleet_document.load(), parameters, execute)
    outcome = ssmdouble.run([first, second], runner, max_concurrency="1", max_errors="0")
    assert outcome.status == "Success", [(r.target, r.status, r.output[-2000:]) for r in outcome.results]
    assert outcome.peak == 1
    finished = job(head, job_id)
    why = _job_failed(head, first, job_id, finished)
    assert (finished["JobState"], finished["ExitCode"]) == ("COMPLETED", "0:0"), why
    assert on(first, f"cat /tmp/ssm-{job_id}.out").split() == ["start", "done"], why
    first_result = next(r for r in outcome.results if r.target == first)
    assert f"waiting for jobs {job_id} on {first}" in first_result.output
    # The change came only after the job had ended, and the node is back in service.
    end = datetime.fromisoformat(finished["EndTime"]).timestamp()
    assert float(on(first, "cat /var/tmp/gpuforge-ssm-applied")) >= end
    assert "Reason=gpuforge fleet apply" not in on(head, f"scontrol show node {first}")
    states = dict(line.split() for line in on(head, "sinfo --noheader --Node --format='%N %T'").splitlines())
    assert states == {name: "idle" for name in cluster["compute"]}
    for node in (first, second):
        on(node, f"rm -f {_ENTRY_STANDIN} /var/tmp/gpuforge-ssm-applied /tmp/ssm-apply.sh")


def _cut_network_to_s3(netns: str, gateway: str, s3_ip: str) -> None:
    """Leave the host's namespace a route to nothing but the emulated S3 address and (for SSH replies to
    this test) the gateway: its /24, and with it the other hosts, goes. The control host has no packet
    filter (no nft or iptables), so routes are the cut."""
    subprocess.run(["ip", "-n", netns, "route", "flush", "dev", "eth0"], check=True)
    for address in (gateway, s3_ip):
        subprocess.run(["ip", "-n", netns, "route", "add", f"{address}/32", "dev", "eth0"], check=True)


def test_on_node_configured_configures_the_node_offline_from_its_image(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    """scripts/pcluster/on_node_configured.sh as ParallelCluster runs it (root, the Args generate writes)
    on a golden compute node whose namespace routes only to the emulated S3 (moto_server on an address of
    its own on the bridge): the baked revision converges with exit 0 and then changes nothing; a newer
    revision published with `gpuforge node-revision publish` is fetched from S3, verified and run; a wrong
    sha256 fails after its retries with the reason. /opt/parallelcluster marks the node a ParallelCluster
    node (TEST DOUBLE, as in test_parallelcluster_mode_only_adds_scripts): plain Slurm's slurm.conf needs
    every node's facts and is the SSH path's."""
    from gpuforge import noderev
    from gpuforge_lab import state as lab_state
    from gpuforge_lab.moto import free_port

    lab = lab_state.load(LAB)
    assert lab is not None
    node = cluster["compute"][1]
    host = next(h for h in lab.hosts if h.name == node)
    s3_ip = f"{lab.subnet_prefix}.250"
    subprocess.run(["ip", "addr", "replace", f"{s3_ip}/32", "dev", lab.bridge], check=True)
    port = free_port(s3_ip)
    moto = subprocess.Popen(
        [str(labtools.BIN / "python"), "-m", "gpuforge_lab.motoserver", "-H", s3_ip, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        endpoint = f"http://{s3_ip}:{port}"
        import boto3

        s3 = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )  # fmt: skip
        # moto_server takes a while to start on a loaded machine (10 s was not enough under CI's load).
        deadline = time.monotonic() + 120
        while True:
            try:
                s3.create_bucket(Bucket="gpuforge-revs")
                break
            except Exception:  # moto_server is still starting
                assert moto.poll() is None, f"moto_server on {endpoint} exited with {moto.returncode}"
                assert time.monotonic() < deadline, f"moto_server on {endpoint} not ready after 120 s"
                time.sleep(0.5)
        newer = noderev.publish(s3, REPO, "HEAD", "gpuforge-revs", "gpuforge/revisions/")
        older = noderev.resolve(REPO, "HEAD~1")
        script = base64.b64encode((REPO / "scripts/pcluster/on_node_configured.sh").read_bytes()).decode()
        on(
            node,
            f"echo {script} | base64 -d > /tmp/on_node_configured.sh && chmod 755 /tmp/on_node_configured.sh",
        )
        on(node, "mkdir -p /opt/parallelcluster")
        _cut_network_to_s3(host.netns, lab.gateway, s3_ip)
        env = (
            f"AWS_ENDPOINT_URL={endpoint} AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing "
            "AWS_EC2_METADATA_SERVICE_ENDPOINT=http://127.0.0.1:9"
        )
        action = (
            f"{env} /tmp/on_node_configured.sh --node-type Compute --queue {host.queue or 'compute'} "
            f"--instance-type {host.instance_type} --region us-east-1 --attempts 2"
        )
        for attempt in (1, 2):
            started = time.monotonic()
            output = on(node, f"{action} 2>&1")
            assert recap(output)["localhost"]["failed"] == 0, output[-4000:]
            if attempt == 2:
                assert recap(output)["localhost"]["changed"] == 0, output[-4000:]
                assert time.monotonic() - started < 300
        assert "gpuforge-node: ok: revision c" in on(node, "cat /var/log/gpuforge/node.log")
        assert on(node, f"ip route | grep -v -e '^{lab.gateway} ' -e '^{s3_ip} ' || true").strip() == ""

        fetched = on(node, f"{action} --revision {newer['revision']} --sha256 {newer['sha256']} "
                           "--bucket gpuforge-revs 2>&1")  # fmt: skip
        assert f"fetching s3://gpuforge-revs/{newer['key']}" in fetched
        assert recap(fetched)["localhost"]["failed"] == 0, fetched[-4000:]
        on(node, f"test -f /opt/gpuforge/node/revisions/{newer['revision']}/.gpuforge-revision")

        s3.put_object(
            Bucket="gpuforge-revs", Key=f"gpuforge/revisions/gpuforge-{older}.tar.gz", Body=b"not it"
        )
        wrong = labtools.gpuforge_lab(
            "ssh", "--name", LAB, node, "--",
            f"sudo sh -c '{action} --revision {older} --sha256 {newer['sha256']} --bucket gpuforge-revs'",
        )  # fmt: skip
        assert wrong.returncode == 3, wrong.stdout[-2000:] + wrong.stderr[-2000:]
        assert f"not the {newer['sha256']} the custom action names (after 2 attempts)" in wrong.stderr
        on(node, f"test ! -e /opt/gpuforge/node/revisions/{older}")
    finally:
        moto.terminate()
        moto.wait(timeout=30)
        subprocess.run(["ip", "addr", "del", f"{s3_ip}/32", "dev", lab.bridge], check=False)
        # Give the node its /24 back for the tests after this one.
        subprocess.run(["ip", "-n", host.netns, "route", "flush", "dev", "eth0"], check=False)
        subprocess.run(
            [
                "ip",
                "-n",
                host.netns,
                "route",
                "add",
                f"{lab.subnet_prefix}.0/24",
                "dev",
                "eth0",
                "src",
                host.ip,
            ],
            check=False,
        )


def test_parallelcluster_mode_only_adds_scripts(cluster: dict[str, Any]) -> None:
    """On a ParallelCluster node (/opt/parallelcluster exists) slurm.conf is left alone; scripts are added."""
    node = cluster["compute"][1]
    ip = next(h["ip"] for h in cluster["info"]["hosts"] if h["name"] == node)
    on(node, "mkdir -p /opt/parallelcluster")
    before = on(node, "sha256sum /etc/slurm/slurm.conf; systemctl show -p ActiveEnterTimestamp slurmd")
    run = playbook(cluster["env"], SITE, "--limit", f"ip-{ip.replace('.', '-')}.ec2.internal")
    assert run.returncode == 0, run.stdout[-4000:]
    assert "no TaskProlog=/opt/slurm/etc/scripts/gpuforge_task_prolog.sh" in run.stdout
    assert (
        on(node, "sha256sum /etc/slurm/slurm.conf; systemctl show -p ActiveEnterTimestamp slurmd") == before
    )
    assert "/etc/gpuforge/nccl.env" in on(node, "cat /opt/slurm/etc/scripts/gpuforge_task_prolog.sh")
    # ParallelCluster shares /opt/slurm with every node: the hooks run the script copied there, with
    # the node's own configuration or, on a node without one, the shared fallback next to it.
    shared = "/opt/slurm/etc/scripts/gpuforge"
    assert on(node, f"stat -c %a {shared}/gpuforge-health").strip() == "755"
    for mode in ("prolog", "epilog"):
        hook = on(node, f"cat /opt/slurm/etc/scripts/{mode}.d/50-gpuforge-health")
        assert (
            f"exec {shared}/gpuforge-health --config /etc/gpuforge/health.json --config {shared}/health.json "
            f"--mode {mode} --drain"
        ) in hook
    # The fallback knows no instance type until IMDS names one (the lab has no IMDS): nothing is
    # promised, so the GPU checks skip, never pass.
    fallback = on(node, f"{shared}/gpuforge-health --config {shared}/health.json")
    assert "gpu_count: instance type unknown is not in data/instance_types.yml" in fallback
    on(node, "rm -rf /opt/parallelcluster /opt/slurm/etc/scripts/gpuforge")


def test_a_head_node_alone_runs_slurmctld_and_queues_jobs() -> None:
    """Before any compute node exists, the fleet roles still converge: slurmctld answers, jobs queue.

    Slurm refuses to start without a node and a partition; the role then defines a FUTURE placeholder.
    """
    name = labtools.lab_name("solo")
    with labtools.lab(name, 1, image=goldenlab.shared_golden_image()["image"]) as info:
        head = info["hosts"][0]["name"]
        first = playbook(info["env"], SITE)
        assert first.returncode == 0, first.stdout[-4000:]
        assert labtools.on(name, head, "scontrol ping").split()[-1] == "UP"
        job_id = labtools.on(name, head, "sbatch --parsable --wrap true").strip()
        state = labtools.on(name, head, f"squeue -h -j {job_id} -o %T").strip()
        assert state == "PENDING"
        again = playbook(info["env"], SITE)
        assert again.returncode == 0, again.stdout[-4000:]
        assert {host: s["changed"] for host, s in recap(again.stdout).items()} == {
            host: 0 for host in recap(again.stdout)
        }
