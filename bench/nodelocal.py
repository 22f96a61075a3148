#!/usr/bin/env python3
"""SSH fan-out vs node-local configuration, side by side in one run (issue 29, item 5).

One golden lab image (`gpuforge-lab bake --save-image` for the lab's two instance types, as
bench/fleet.py --golden bakes it; not in the figures), then three fresh labs booted from it:

a. SSH fan-out (lab `nlssh`, N hosts): `ansible-playbook site.yml --tags configure` from this
   controller (the golden fast-path decision, one round trip, then the fleet's configure phase).
b. Node-local (lab `nlnode`, N hosts): scripts/pcluster/on_node_configured.sh, i.e. `gpuforge-node
   apply`, started on every host at once by that host's own systemd (`systemd-run --wait`, entered
   with nsenter, no SSH): the controller only triggers and waits; the run belongs to the node.
c. Boot to ready (lab `nlboot`, 2 hosts; its compute host): the same custom action as soon as the
   host is up, then the health check; from the container's init start to both done.
d. Outbound connections of that host: strace (on the controller, attached from the start, seccomp
   filtered to connect/sendto/sendmsg/sendmmsg) of the custom action and all its children, by
   destination; and the kernel's TCP/UDP counters of the host's network namespace, made at boot.
e. The 1,000-node model, from the measured per-node costs, printed with its formulas.

Both configuration paths do the same work: every host is marked a ParallelCluster node
(/opt/parallelcluster, the TEST DOUBLE test_fleet_lab uses), because plain-mode Slurm cannot be
configured node-locally (docs/node-side.md). Controller CPU is the cpu.stat of a cgroup each path's
controller-side commands run in (ansible-playbook, its forks, ssh and the ControlPersist masters
that outlive it; or nsenter + systemd-run); node CPU is the cpu.stat of each host's own cgroup, and
for (b) also what the host's systemd says the custom action's unit consumed.
Run (as root; labs nlbake, nlssh, nlnode, nlboot; image nlgolden-<pid>, removed at the end):
  .venv/bin/python bench/nodelocal.py --nodes 16
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuforge.errors import ExternalError
from gpuforge_lab import cgroup, host, state
from gpuforge_lab.bench import labrun, nodecost
from gpuforge_lab.bench.timing import load_average, run_timed, table

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ACTION = REPO / "scripts/pcluster/on_node_configured.sh"
ACTION_ON_NODE = "/usr/local/sbin/gpuforge-on-node-configured"
# The lab has no IMDS: gpuforge-node is told where (a closed loopback port, as test_fleet_lab does),
# so its reads fail at once; the facts IMDS would give come from the Args (--instance-type, --region).
IMDS_STANDIN = "http://127.0.0.1:9"
# The lab's one override for a node-local run: promised hardware is absent by design (the lab group's
# gpuforge_lab_hardware_absent, which the SSH path gets from inventory/group_vars/gpuforge_lab).
LAB_EXTRA = ["--", "-e", "gpuforge_lab_hardware_absent=true"]
HEALTH = "/usr/local/sbin/gpuforge-health"  # roles/health defaults: health_script_path
CLEAN_ENV = ["env", "-i", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"]
STEP_TIMEOUT_S = 1800.0


@dataclass
class Node:
    name: str
    role: str
    instance_type: str
    queue: str | None
    netns: str
    init: str
    cgroup: Path  # the host's own cgroup (unified hierarchy): its cpu.stat counts every process in it


@dataclass
class PathResult:
    """One configuration path on N hosts."""

    wall: float
    cpu: float  # the controller's
    node_cpus: list[float]  # each host's cgroup, over the run
    unit_cpus: list[float]  # each custom action's unit, as the host's systemd counted it
    changed: int
    ok: bool


@dataclass
class BootResult:
    up: float
    action: float
    ready: float
    ok: bool
    health: str
    connections: nodecost.Connections
    boot_counters: nodecost.SnmpDelta
    action_counters: nodecost.SnmpDelta


def nodes_of(lab_name: str) -> list[Node]:
    lab = state.load(lab_name)
    if lab is None:
        raise ExternalError(f"lab {lab_name} is not up")
    found = []
    for h in lab.hosts:
        init = host.init_pid(h)
        stats = [Path(d) for d in h.cgroups if (Path(d) / "cpu.stat").is_file()]
        if init is None or not stats:
            raise ExternalError(f"host {h.name}: no running init or no cgroup with cpu.stat")
        found.append(Node(h.name, h.role, h.instance_type, h.queue, h.netns, init, stats[0]))
    return found


def inside(node: Node, *command: str) -> list[str]:
    return [*host.inside(node.init), *command]


def on(node: Node, command: str, stdin: str | None = None, timeout: float = 120) -> str:
    """A shell command inside the host (nsenter, not SSH); its stdout; ExternalError when it fails."""
    out = subprocess.run(
        inside(node, "sh", "-c", command), input=stdin, capture_output=True, text=True, timeout=timeout
    )
    if out.returncode != 0:
        raise ExternalError(f"{node.name}: {command} exited {out.returncode}: {out.stderr.strip()[-500:]}")
    return out.stdout


def node_cpu(node: Node) -> float:
    return nodecost.cgroup_cpu_seconds((node.cgroup / "cpu.stat").read_text())


def action_args(node: Node, cluster: str) -> list[str]:
    """The Args `gpuforge cluster-config generate` writes for this node's part, plus the lab's facts."""
    part = ["--node-type", node.role, "--cluster", cluster]
    if node.role == "Compute":
        part += ["--queue", node.queue or "compute"]
    return [*part, "--instance-type", node.instance_type, "--region", "us-east-1", *LAB_EXTRA]


def prepare(nodes: Sequence[Node], with_action: bool) -> None:
    """Untimed: the ParallelCluster marker on every host, and the custom action where it will run."""
    script = ACTION.read_text()
    for node in nodes:
        on(node, "mkdir -p /opt/parallelcluster")
        if with_action:
            on(node, f"cat > {ACTION_ON_NODE} && chmod 755 {ACTION_ON_NODE}", stdin=script)


class ControllerCgroup:
    """A cgroup of its own for one path's controller-side commands, so their CPU is counted whole."""

    def __init__(self, name: str) -> None:
        self.dirs = cgroup.create(f"{name}-{os.getpid()}")
        self.stat = next(d for d in self.dirs if (d / "cpu.stat").is_file())

    def wrap(self, argv: Sequence[str]) -> list[str]:
        return cgroup.enter_command(self.dirs, list(argv))

    def cpu(self) -> float:
        return nodecost.cgroup_cpu_seconds((self.stat / "cpu.stat").read_text())

    def close(self) -> None:
        # What is left are processes this script started (ssh ControlPersist masters): end them by id.
        for pid in (self.stat / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 15)
        cgroup.remove(self.dirs)


def ssh_path(nodes: int, image: str, work: Path) -> PathResult:
    lab = labrun.up("nlssh", nodes, image=image)
    ctl = ControllerCgroup("nlssh-ctl")
    try:
        # This project's ansible.cfg (forks 25, pipelining, ControlPersist) with an empty fact cache of
        # its own, as bench/fleet.py's "project" configuration.
        env = {**os.environ, **lab.env(), "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")}
        env["ANSIBLE_CACHE_PLUGIN_CONNECTION"] = str(work / "facts")
        run_timed([str(BIN / "ansible-inventory"), "--list", "--flush-cache"], env=env, cwd=REPO)
        hosts = nodes_of(lab.name)
        prepare(hosts, with_action=False)
        node_before = [node_cpu(n) for n in hosts]
        cpu_before = ctl.cpu()
        command = [str(BIN / "ansible-playbook"), "site.yml", "--tags", "configure"]
        wall, out = run_timed(ctl.wrap(command), env=env, cwd=REPO, check=False, timeout=STEP_TIMEOUT_S)
        cpu = ctl.cpu() - cpu_before
        node_cpus = [node_cpu(n) - b for n, b in zip(hosts, node_before, strict=True)]
        seen, changed, bad = labrun.recap_totals(out.stdout)
        if out.returncode != 0:
            print(f"[ssh] site.yml exited {out.returncode}:\n{out.stdout[-3000:]}", file=sys.stderr)
        ok = out.returncode == 0 and seen == nodes and bad == 0
    finally:
        ctl.close()
        labrun.down(lab.name)
    return PathResult(wall, cpu, node_cpus, [], changed, ok)


def nodelocal_path(nodes: int, image: str) -> PathResult:
    lab = labrun.up("nlnode", nodes, image=image)
    ctl = ControllerCgroup("nlnode-ctl")
    try:
        hosts = nodes_of(lab.name)
        prepare(hosts, with_action=True)
        cluster = _cluster(lab.name)
        node_before = [node_cpu(n) for n in hosts]
        cpu_before = ctl.cpu()
        started = time.monotonic()
        procs = [
            subprocess.Popen(
                ctl.wrap(inside(n, *trigger(n, cluster))),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for n in hosts
        ]
        runs = []
        for proc in procs:
            left = max(1.0, STEP_TIMEOUT_S - (time.monotonic() - started))
            _, err = proc.communicate(timeout=left)
            runs.append(nodecost.parse_unit_run(err))
        wall = time.monotonic() - started
        cpu = ctl.cpu() - cpu_before
        node_cpus = [node_cpu(n) - b for n, b in zip(hosts, node_before, strict=True)]
        logs = [nodecost.node_ok(on(n, "cat /var/log/gpuforge/node.log")) for n in hosts]
        for n, r in zip(hosts, runs, strict=True):
            if not r.ok:
                print(
                    f"[node-local] {n.name}: {r}\n{on(n, 'tail -n 40 /var/log/gpuforge/node.log')}",
                    file=sys.stderr,
                )
        ok = all(r.ok for r in runs) and all(logs)
    finally:
        ctl.close()
        labrun.down(lab.name)
    unit_cpus = [r.cpu_s for r in runs if r.cpu_s is not None]
    changed = sum(entry[1] for entry in logs if entry)
    return PathResult(wall, cpu, node_cpus, unit_cpus, changed, ok)


def trigger(node: Node, cluster: str) -> list[str]:
    """The custom action as a transient unit of the host's own systemd, waited for (its summary)."""
    return [
        "systemd-run",
        "--wait",
        "--unit=gpuforge-bench-apply",
        "-p",
        "CPUAccounting=yes",
        f"--setenv=AWS_EC2_METADATA_SERVICE_ENDPOINT={IMDS_STANDIN}",
        ACTION_ON_NODE,
        *action_args(node, cluster),
    ]


def _addresses(node: Node) -> list[str]:
    """The IPv4/IPv6 addresses of the host's own interfaces (its network namespace)."""
    out = subprocess.run(
        ["ip", "netns", "exec", node.netns, "ip", "-o", "addr", "show"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [field.split("/")[0] for line in out.splitlines() for field in line.split()[3:4]]


def boot_path(image: str, work: Path) -> BootResult:
    """(c) and (d) on a fresh host: boot to ready, and what it contacted."""
    lab = labrun.up("nlboot", 2, image=image)
    try:
        node = next(n for n in nodes_of(lab.name) if n.role == "Compute")
        booted = _start_seconds(node.init)
        up = _boottime() - booted
        snmp_boot = _snmp(node)
        prepare([node], with_action=True)
        trace = work / "strace.txt"
        env = [*CLEAN_ENV, f"AWS_EC2_METADATA_SERVICE_ENDPOINT={IMDS_STANDIN}"]
        cluster = _cluster(lab.name)
        strace = ["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=connect,sendto,sendmsg,sendmmsg"]
        strace += ["-e", "signal=none", "-o", str(trace)]
        command = [*strace, *inside(node, *env, ACTION_ON_NODE, *action_args(node, cluster))]
        action_s, out = run_timed(command, check=False, timeout=STEP_TIMEOUT_S)
        health = subprocess.run(inside(node, *CLEAN_ENV, HEALTH), capture_output=True, text=True, timeout=300)
        ready = _boottime() - booted
        snmp_end = _snmp(node)
        connections = nodecost.parse_strace(trace.read_text().splitlines(), own=_addresses(node))
        if out.returncode != 0 or health.returncode != 0:
            print(
                f"[boot] action exit {out.returncode}, health exit {health.returncode}:\n"
                f"{(out.stdout + out.stderr)[-3000:]}\n{health.stdout[-2000:]}",
                file=sys.stderr,
            )
    finally:
        labrun.down(lab.name)
    return BootResult(
        up=up,
        action=action_s,
        ready=ready,
        ok=out.returncode == 0 and health.returncode == 0,
        health=(health.stdout.strip().splitlines() or ["(no output)"])[-1],
        connections=connections,
        boot_counters=nodecost.snmp_since(None, snmp_boot),
        action_counters=nodecost.snmp_since(snmp_boot, snmp_end),
    )


def _cluster(lab_name: str) -> str:
    lab = state.load(lab_name)
    if lab is None:
        raise ExternalError(f"lab {lab_name} is not up")
    return lab.cluster_name


def _boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _start_seconds(pid: str) -> float:
    """When a process started, in seconds since the machine booted (proc(5), /proc/pid/stat field 22)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _snmp(node: Node) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", node.netns, "cat", "/proc/net/snmp"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def forks() -> int:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "ansible.cfg")
    return cfg.getint("defaults", "forks", fallback=5)


def per_node(values: Sequence[float]) -> str:
    return f"{sum(values) / len(values):.2f} (max {max(values):.2f})" if values else "-"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=16, help="hosts per configuration path (default 16)")
    parser.add_argument("--project-to", type=int, default=1000, help="fleet size of the model (default 1000)")
    parser.add_argument(
        "--controller-cores",
        type=int,
        default=os.cpu_count() or 1,
        help="the model's controller (default: this one's)",
    )
    parser.add_argument(
        "--ssm-max-concurrency", type=int, default=100, help="the model's SSM MaxConcurrency (100)"
    )
    parser.add_argument(
        "--image",
        help="an existing golden lab image (baked for the lab's instance types) to boot, not baking one",
    )
    args = parser.parse_args()
    if args.nodes < 2:
        parser.error("--nodes must be at least 2 (a head node and a compute node)")
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout
    print(
        f"gpuforge {rev.strip()}, {args.nodes} golden hosts per path; load before: {load_average()}",
        flush=True,
    )
    image = args.image or f"nlgolden-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="gpuforge-bench-nodelocal-") as tmp_dir:
        tmp = Path(tmp_dir)
        try:
            if not args.image:
                bake = labrun.bake_image(image, tmp, lab_name="nlbake")
                print(f"  golden image {image} baked in {bake:.1f} s (not in the figures)", flush=True)
            ssh = ssh_path(args.nodes, image, tmp)
            print(f"  ssh: {ssh}", flush=True)
            local = nodelocal_path(args.nodes, image)
            print(f"  node-local: {local}", flush=True)
            boot = boot_path(image, tmp)
            print(f"  boot: {boot}", flush=True)
        finally:
            if not args.image:
                labrun.gpuforge_lab("image", "rm", image)
    print(f"\nload after: {load_average()}\n")
    print(report(args, ssh, local, boot))
    return 0 if ssh.ok and local.ok and boot.ok else 1


BOOT_HEADERS = [
    "golden compute host, fresh",
    "init start to up s",
    "custom action s",
    "init start to ready s",
]
BOOT_HEADERS += ["health", "result"]
CONNECTION_HEADERS = ["custom action at boot (strace, whole process tree)", "outbound (routable)"]
CONNECTION_HEADERS += ["link-local (IMDS)", "loopback", "the host's own address", "local sockets"]


def report(args: argparse.Namespace, ssh: PathResult, local: PathResult, boot: BootResult) -> str:
    """The side-by-side tables and the model, as Markdown."""
    n = args.nodes
    paths = (
        ("SSH fan-out: `ansible-playbook site.yml --tags configure`", ssh),
        ("node-local: `gpuforge-node apply` on every host at once", local),
    )
    rows = [
        [
            name,
            n,
            r.wall,
            f"{r.cpu:.2f}",
            f"{r.cpu / n:.3f}",
            per_node(r.node_cpus),
            per_node(r.unit_cpus),
            r.changed,
            "ok" if r.ok else "FAILED",
        ]
        for name, r in paths
    ]
    headers = ["path", "hosts", "wall s", "controller CPU s", "controller CPU s / node"]
    headers += [
        "node CPU s / node (host cgroup)",
        "node CPU s / node (the action's unit)",
        "changed",
        "result",
    ]
    out = [table(headers, rows), ""]
    result = "ok" if boot.ok else "FAILED"
    out.append(
        table(
            BOOT_HEADERS,
            [["boot to ready", boot.up, boot.action, boot.ready, boot.health, result]],
        )
    )
    c = boot.connections
    out += [
        "",
        table(
            CONNECTION_HEADERS,
            [
                [
                    "connect/sendto/sendmsg calls",
                    len(c.outbound),
                    len(c.link_local),
                    len(c.loopback),
                    len(c.own_address),
                    c.local_sockets,
                ]
            ],
        ),
        f"outbound: {', '.join(c.outbound) or 'none'}; "
        f"loopback: {', '.join(sorted(set(c.loopback))) or 'none'}; "
        f"own address: {', '.join(sorted(set(c.own_address))) or 'none'}",
        f"host's netns counters, loopback included: {_counters('boot until up', boot.boot_counters)}; "
        f"{_counters('during the action', boot.action_counters)}",
        "",
    ]
    node_wall = boot.action
    target = args.project_to
    models = [
        nodecost.ssh_projection(target, ssh.cpu / n, ssh.wall, forks(), args.controller_cores),
        nodecost.nodelocal_projection(target, local.cpu / n, node_wall, "node-local, lab trigger (nsenter)"),
        nodecost.nodelocal_projection(target, 0.0, node_wall, "node-local, OnNodeConfigured"),
        nodecost.ssm_projection(target, node_wall, args.ssm_max_concurrency),
    ]
    out.append(
        table(
            ["path", "nodes", "controller CPU s", "wall s", "formula"],
            [[m.path, m.nodes, f"{m.controller_cpu_s:.1f}", f"{m.wall_s:.0f}", m.formula] for m in models],
        )
    )
    return "\n".join(out)


def _counters(when: str, delta: nodecost.SnmpDelta) -> str:
    return (
        f"{when}: TCP ActiveOpens {delta.tcp_active_opens} (AttemptFails {delta.tcp_attempt_fails}), "
        f"UDP OutDatagrams {delta.udp_out_datagrams}"
    )


if __name__ == "__main__":
    sys.exit(main())
