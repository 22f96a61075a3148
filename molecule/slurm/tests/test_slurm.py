"""Verifier for the slurm scenario: a real Slurm cluster on lab hosts, asserted through sinfo/sbatch."""

from __future__ import annotations

import re

import pytest

testinfra_hosts = ["all"]


def groups(host) -> list[str]:
    return host.ansible.get_variables()["group_names"]


@pytest.fixture
def head(host):
    if "head_node" not in groups(host):
        pytest.skip("checked from the head node")
    return host


@pytest.fixture
def compute(host):
    if "compute" not in groups(host):
        pytest.skip("a compute-node check")
    return host


@pytest.mark.parametrize(
    ("group", "service"), [("head_node", "slurmctld"), ("compute", "slurmd"), (None, "munge")]
)
def test_daemons_run(host, group, service):
    """slurmctld on the head node, slurmd on compute nodes, munge everywhere: enabled and running."""
    if group is not None and group not in groups(host):
        pytest.skip(f"{service} runs on {group}")
    unit = host.service(service)
    assert unit.is_running
    assert unit.is_enabled


def test_munge_key_is_private(host):
    """The munge key belongs to munge and only it can read it."""
    with host.sudo():
        key = host.file("/etc/munge/munge.key")
        assert key.user == "munge"
        assert key.mode == 0o400
        assert key.size >= 32


def test_sinfo_shows_both_compute_nodes_idle(head):
    """The controller sees exactly the two compute nodes, idle, in the gpu partition."""
    out = head.check_output("sinfo --noheader --Node --format='%N %P %T'")
    rows = [line.split() for line in out.splitlines()]
    assert len(rows) == 2
    assert all(partition == "gpu*" and state == "idle" for _, partition, state in rows)


def test_batch_job_runs_on_both_nodes(head):
    """A two-node sbatch job (srun env on each node) completes; its output is checked on the compute node."""
    out = head.check_output(
        "cd /tmp && sbatch --parsable --wait -N2 -o /tmp/molecule-%j.out --wrap 'srun env'"
    )
    job_id = out.strip().split(";")[0]
    state = head.check_output(f"scontrol show job {job_id} --oneliner")
    assert re.search(r"JobState=COMPLETED .*ExitCode=0:0", state)
    assert "NumNodes=2 " in state


def test_job_output_has_nccl_settings(compute):
    """A job submitted from a compute node to itself sees every setting of that node's nccl.env."""
    name = compute.check_output("hostname")
    out = compute.check_output(
        f"cd /tmp && sbatch --parsable --wait -w {name} -o /tmp/self-%j.out --wrap 'env | sort'"
    )
    job_id = out.strip().split(";")[0]
    job_env = compute.file(f"/tmp/self-{job_id}.out").content_string.splitlines()  # noqa: S108 (a path on the lab host)
    tuned = [
        line
        for line in compute.file("/etc/gpuforge/nccl.env").content_string.splitlines()
        if line and not line.startswith("#")
    ]
    assert "FI_PROVIDER=efa" in tuned
    assert any(line.startswith("NCCL_SOCKET_IFNAME=") for line in tuned)
    for line in tuned:
        assert line in job_env


def test_health_hooks_installed(compute):
    """The health checks run as Slurm prolog and epilog."""
    for mode in ("prolog", "epilog"):
        hook = compute.file(f"/etc/slurm/{mode}.d/50-gpuforge-health")
        assert hook.mode == 0o755
        assert f"--mode {mode}" in hook.content_string
    result = compute.run("/usr/local/sbin/gpuforge-health --mode prolog")
    assert result.rc == 0
    assert "NOT_PRESENT  gpu_count: no NVIDIA GPU present (the instance type has 8)" in result.stdout
