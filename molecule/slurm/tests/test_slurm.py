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
        assert (key.user, key.group) == ("munge", "munge")
        assert key.mode == 0o400
        assert key.size >= 32


# (path, owner and group, mode) as roles/slurm/tasks/configure_plain.yml, roles/health and
# roles/nccl_tuning write them. Configuration is readable by all (slurmd and job steps read it) and
# writable only by root; scripts Slurm runs as root are root's alone to change.
MANAGED_FILES = [
    ("/etc/slurm/slurm.conf", "root", 0o644),
    ("/etc/slurm/cgroup.conf", "root", 0o644),
    ("/etc/slurm/gres.conf", "root", 0o644),
    ("/etc/slurm/prolog.sh", "root", 0o755),
    ("/etc/slurm/epilog.sh", "root", 0o755),
    ("/etc/slurm/task_prolog.sh", "root", 0o755),
    ("/etc/slurm/prolog.d/50-gpuforge-health", "root", 0o755),
    ("/etc/slurm/epilog.d/50-gpuforge-health", "root", 0o755),
    ("/usr/local/sbin/gpuforge-health", "root", 0o755),
    ("/etc/gpuforge/health.json", "root", 0o644),
    ("/etc/gpuforge/nccl.env", "root", 0o644),
    ("/etc/nccl.conf", "root", 0o644),
    ("/etc/profile.d/gpuforge-nccl.sh", "root", 0o644),
]


@pytest.mark.parametrize(("path", "owner", "mode"), MANAGED_FILES, ids=[f[0] for f in MANAGED_FILES])
def test_managed_files_owner_and_mode(host, path, owner, mode):
    """Every file the Slurm, health and NCCL tuning roles write has the owner and mode they set."""
    managed = host.file(path)
    assert managed.is_file
    assert (managed.user, managed.group) == (owner, owner)
    assert managed.mode == mode


@pytest.mark.parametrize(
    ("path", "group", "owner"),
    [
        ("/etc/slurm", None, "root"),
        ("/etc/slurm/prolog.d", None, "root"),
        ("/etc/slurm/epilog.d", None, "root"),
        ("/var/log/slurm", None, "slurm"),
        ("/var/lib/slurm/slurmctld", "head_node", "slurm"),
        ("/var/lib/slurm/slurmd", "compute", "root"),
    ],
)
def test_slurm_directories_owner_and_mode(host, path, group, owner):
    """Slurm's directories: 0755, owned by root except where the slurm user writes (logs, state)."""
    if group is not None and group not in groups(host):
        pytest.skip(f"{path} is on {group} nodes")
    directory = host.file(path)
    assert directory.is_directory
    assert (directory.user, directory.group) == (owner, owner)
    assert directory.mode == 0o755


def test_sinfo_shows_both_compute_nodes_idle(head):
    """The controller sees exactly the two compute nodes, idle, in the gpu partition."""
    out = head.check_output("sinfo --noheader --Node --format='%N %P %T'")
    rows = [line.split() for line in out.splitlines()]
    assert len(rows) == 2
    assert all(partition == "gpu*" and state == "idle" for _, partition, state in rows)


def test_slurmctld_runs_with_the_roles_timers(head):
    """The controller took slurm.conf's timers (a prolog's health checks may run for minutes)."""
    config = head.check_output("scontrol show config")
    assert re.search(r"^BatchStartTimeout\s*=\s*180 sec", config, re.MULTILINE), config
    assert re.search(r"^MessageTimeout\s*=\s*60 sec", config, re.MULTILINE), config
    assert re.search(r"^UnkillableStepTimeout\s*=\s*300 sec", config, re.MULTILINE), config


def test_batch_job_runs_on_both_nodes(head):
    """A two-node sbatch job (srun env on each node) completes; its output is checked on the compute node."""
    out = head.check_output(
        "cd /tmp && sbatch --parsable --wait -N2 -o /tmp/molecule-%j.out --wrap 'srun env'"
    )
    job_id = out.strip().split(";")[0]
    # sbatch --wait returns when the job's steps end; the job stays COMPLETING while the nodes' epilogs
    # (the health checks) run, which under load takes seconds: its final state is read after that.
    state = head.check_output(
        f"for i in $(seq 300); do s=$(scontrol show job {job_id} --oneliner); "
        'case "$s" in *JobState=COMPLETING*) sleep 1 ;; *) break ;; esac; done; echo "$s"'
    )
    # On failure, say why: the job's state and reason, its output, and what the controller logged of it.
    why = "\n".join(
        (state, head.run(f"cat /tmp/molecule-{job_id}.out").stdout[-2000:],
         head.run(f"grep -h 'JobId={job_id}' /var/log/slurm/*.log | tail -n 20").stdout)
    )  # fmt: skip
    assert re.search(r"JobState=COMPLETED .*ExitCode=0:0", state), why
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
    # The provider and the p5 platform settings are the aws-ofi-nccl plugin's own (roles/nccl_tuning).
    assert not any(line.startswith(("FI_PROVIDER=", "NCCL_BUFFSIZE=")) for line in tuned)
    assert any(line.startswith("NCCL_SOCKET_IFNAME=") for line in tuned)
    assert any(line.startswith("NCCL_DEBUG=") for line in tuned)
    for line in tuned:
        assert line in job_env


def test_health_hooks_installed(compute):
    """The health checks run as Slurm prolog and epilog (draining on failure) and once after boot."""
    for mode in ("prolog", "epilog"):
        hook = compute.file(f"/etc/slurm/{mode}.d/50-gpuforge-health")
        assert f"--mode {mode} --drain" in hook.content_string
    assert compute.service("gpuforge-health-boot").is_enabled
    with compute.sudo():
        result = compute.run("/usr/local/sbin/gpuforge-health --mode prolog")
    assert result.rc == 0, result.stdout
    # The lab's test double, never a pass: the p5.48xlarge's GPUs are absent by design.
    assert "ABSENT_BY_DESIGN gpu_count: p5.48xlarge promises 8 GPU(s); absent by design" in result.stdout
