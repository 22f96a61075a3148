"""The lab end to end: real hosts over SSH, moto as EC2, the real aws_ec2 inventory, clean teardown.

Needs root, systemd-nspawn and debootstrap (the CI runs as root and installs them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import labtools
from gpuforge_lab import core as lab_core
from gpuforge_lab import state
from labtools import LAB_MARKS, REPO, gpuforge_lab, lab_up

LAB = labtools.lab_name("itest")

pytestmark = LAB_MARKS


def lab_env() -> dict[str, str]:
    """What `eval "$(gpuforge-lab env)"` sets in a shell: the command's output, used as users use it."""
    out = subprocess.run(
        ["bash", "-c", f'eval "$({sys.executable} -m gpuforge_lab.cli env --name {LAB})" && env -0'],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={"PATH": os.environ["PATH"]},
    )
    exported = dict(item.split("=", 1) for item in out.stdout.split("\0") if "=" in item)
    expected = lab_core.env_exports(LAB)
    assert {k: exported.get(k) for k in expected} == expected
    return expected


@pytest.fixture(scope="module")
def lab() -> Iterator[dict[str, object]]:
    info = lab_up(LAB, 3)
    yield info
    gpuforge_lab("down", "--name", LAB)


def test_every_host_answers_ssh_with_its_own_name(lab: dict[str, object]) -> None:
    hosts = lab["hosts"]
    assert isinstance(hosts, list) and len(hosts) == 3
    for node in hosts:
        out = gpuforge_lab("ssh", "--name", LAB, node["name"], "--", "hostname; ps -p 1 -o comm=")
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [node["name"], "systemd"]


def test_inventory_groups_by_parallelcluster_tags(lab: dict[str, object]) -> None:
    env = lab_env()
    out = subprocess.run(
        ["ansible-inventory", "-i", "inventory/aws_ec2.yml", "--graph", "--flush-cache"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **env},
        check=True,
    )
    for group in (
        "@cluster_lab",
        "@node_type_HeadNode",
        "@node_type_Compute",
        "@queue_gpu",
        "@instance_type_p5_48xlarge",
        "@head_node",
        "@compute",
    ):
        assert group in out.stdout, out.stdout
    addresses = labtools.inventory_addresses(env, "-i", "inventory/aws_ec2.yml")
    assert sorted(addresses.values()) == sorted(h["ip"] for h in lab["hosts"])


def test_ansible_ping_reaches_every_host(lab: dict[str, object]) -> None:
    out = subprocess.run(
        ["ansible", "all", "-m", "ansible.builtin.ping"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **lab_env()},
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == 3


def test_hosts_install_debian_packages_through_the_proxy(lab: dict[str, object]) -> None:
    out = gpuforge_lab(
        "ssh",
        "--name",
        LAB,
        lab["hosts"][1]["name"],
        "--",
        "sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hello "
        ">/dev/null && hello",
    )
    assert out.returncode == 0, out.stderr
    assert "Hello, world!" in out.stdout


def test_second_up_is_refused(lab: dict[str, object]) -> None:
    again = gpuforge_lab("up", "--name", LAB)
    assert again.returncode == 2
    assert "already up" in again.stderr


def test_busy_moto_port_is_refused(lab: dict[str, object]) -> None:
    other = gpuforge_lab("up", "--name", "itest2", "--moto-port", str(lab["moto_port"]))
    assert other.returncode == 2
    assert "already in use" in other.stderr
    assert state.load("itest2") is None


def test_each_host_runs_systemd_in_a_cgroup_tree_of_its_own(lab: dict[str, object]) -> None:
    """Hosts sharing one cgroup tree broke each other's units (an intermittent boot without sshd).

    Two hosts start and stop a unit of the same name at once: in one shared tree (the lab before
    gpuforge_lab.cgroup) 293-296 of 300 starts failed on one of them ("Unit gfrace.service was
    already loaded": the other host's process kept the cgroup populated).
    """
    hosts = lab["hosts"]
    assert isinstance(hosts, list)
    inits = {}
    for node in hosts:
        init = Path(f"/proc/{node['pid']}/task/{node['pid']}/children").read_text().split()[0]
        inits[node["name"]] = Path(f"/proc/{init}/cgroup").read_text()
        assert f"/{node['netns']}/payload/init.scope" in inits[node["name"]], inits[node["name"]]
        assert node["cgroups"] and all(Path(d).is_dir() for d in node["cgroups"])
    loop = (
        "f=0; for n in $(seq 100); do sudo -n systemd-run --quiet --unit=gfrace --wait --collect true"
        " >/dev/null 2>&1 || f=$((f+1)); done; echo $f"
    )
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "gpuforge_lab.cli", "ssh", "--name", LAB, node["name"], "--", loop],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for node in hosts[:2]
    ]
    failed = [run.communicate(timeout=300)[0].strip() for run in runs]
    assert failed == ["0", "0"], f"failed starts of 100 per host: {failed}"


def _ifindex(link: str) -> int | None:
    try:
        return int(Path(f"/sys/class/net/{link}/ifindex").read_text())
    except FileNotFoundError:
        return None


def test_down_leaves_nothing_behind(lab: dict[str, object]) -> None:
    bridge = str(lab["bridge"])
    ours = _ifindex(bridge)
    assert ours is not None
    down = gpuforge_lab("down", "--name", LAB)
    assert down.returncode == 0, down.stderr
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"gpuforge-{LAB}-" not in netns
    # `down` frees the lab's subnet, so a lab starting beside this one (CI runs several) may take
    # it and make a bridge of the same name at once; ifindexes are not reused, so only ours counts.
    assert _ifindex(bridge) != ours, f"bridge {bridge} left behind"
    lab_dir = str(state.lab_root() / LAB)
    assert lab_dir not in Path("/proc/self/mounts").read_text()
    assert not Path(lab_dir).exists()
    pids = [h["pid"] for h in lab["hosts"]] + [lab["moto_pid"], lab["proxy_pid"]]
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z", f"pid {pid} still running"
    assert gpuforge_lab("status", "--name", LAB).returncode == 2
    leftover = [d for h in lab["hosts"] for d in h["cgroups"] if Path(d).exists()]
    assert leftover == [], "host cgroups left behind"


def test_down_also_ends_a_host_whose_nspawn_was_killed() -> None:
    """SIGKILL to systemd-nspawn orphans the container; `lab down` must still end it."""
    name = "itest3"
    gpuforge_lab("down", "--name", name)
    up = gpuforge_lab("up", "--name", name, "--nodes", "1", "--no-ec2", "--json")
    assert up.returncode == 0, up.stderr
    node = json.loads(up.stdout)["hosts"][0]
    netns_inode = Path(f"/run/netns/{node['netns']}").stat().st_ino
    os.kill(node["pid"], 9)

    def inside() -> list[str]:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and (proc / "ns" / "net").stat().st_ino == netns_inode:
                    found.append(proc.name)
            except OSError:
                pass
        return found

    assert inside(), "expected the container to outlive its nspawn"
    down = gpuforge_lab("down", "--name", name)
    assert down.returncode == 0, down.stderr
    assert inside() == []
    assert [d for d in node["cgroups"] if Path(d).exists()] == [], "the killed host's cgroups were left"
