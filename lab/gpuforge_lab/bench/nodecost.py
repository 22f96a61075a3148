"""The pure parts of bench/nodelocal.py: reading what the lab reports, and the 1,000-node model.

Everything here parses text or does arithmetic, so tests/test_bench_nodecost.py checks it without a
lab: systemd-run's end-of-run summary, cgroup v2 cpu.stat, the kernel's /proc/net/snmp counters,
strace's connect()/send*() lines, gpuforge-node's "ok" log line, and the projection of each
configuration path to a larger fleet from costs measured per node.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

# systemd's format_timespan() suffixes and their lengths (systemd src/basic/time-util.c, the
# `table[]` of format_timespan: y, month, w, d, h, min, s, ms, us; USEC_PER_MONTH and
# USEC_PER_YEAR are 30.44 and 365.25 days in src/basic/time-util.h).
_TIMESPAN_UNITS = {
    "y": 31_557_600.0,
    "month": 2_629_800.0,
    "w": 604_800.0,
    "d": 86_400.0,
    "h": 3_600.0,
    "min": 60.0,
    "s": 1.0,
    "ms": 1e-3,
    "us": 1e-6,
}
# Longest suffix first, so "ms" is not read as "m" + "s" and "min" not as "m".
_TIMESPAN_TOKEN = re.compile(r"(\d+(?:\.\d+)?)(month|min|ms|us|y|w|d|h|s)(?![a-z])")


def parse_timespan(text: str) -> float:
    """Seconds in a systemd timespan as format_timespan() prints it ('1min 2.345s', '870ms')."""
    text = text.strip()
    tokens = _TIMESPAN_TOKEN.findall(text)
    if not tokens or _TIMESPAN_TOKEN.sub("", text).strip():
        raise ValueError(f"not a systemd timespan: {text!r}")
    return sum(float(number) * _TIMESPAN_UNITS[unit] for number, unit in tokens)


@dataclass(frozen=True)
class UnitRun:
    """What `systemd-run --wait` says when its unit ends (systemd src/run/run.c, run_context_show)."""

    result: str
    exit_status: int | None
    runtime_s: float | None
    cpu_s: float | None

    @property
    def ok(self) -> bool:
        return self.result == "success" and self.exit_status == 0


_RESULT = re.compile(r"^Finished with result: (\S+)$", re.MULTILINE)
_STATUS = re.compile(r"^Main processes terminated with: code=(\w+)/status=(\S+)$", re.MULTILINE)
_RUNTIME = re.compile(r"^Service runtime: (.+)$", re.MULTILINE)
_CPU = re.compile(r"^CPU time consumed: (.+)$", re.MULTILINE)


def parse_unit_run(stderr: str) -> UnitRun:
    """The summary `systemd-run --wait` (without --quiet) writes to stderr after its unit ended.

    The CPU line is printed only where the unit had CPU accounting (run with -p CPUAccounting=yes);
    a missing line is None, never 0.
    """
    result = _RESULT.search(stderr)
    if result is None:
        raise ValueError("no 'Finished with result:' line: systemd-run did not see its unit end")
    status = _STATUS.search(stderr)
    exit_status = int(status[2]) if status and status[1] == "exited" and status[2].isdigit() else None
    runtime = _RUNTIME.search(stderr)
    cpu = _CPU.search(stderr)
    return UnitRun(
        result=result[1],
        exit_status=exit_status,
        runtime_s=parse_timespan(runtime[1]) if runtime else None,
        cpu_s=parse_timespan(cpu[1]) if cpu else None,
    )


def cgroup_cpu_seconds(cpu_stat: str) -> float:
    """usage_usec of a cgroup v2 cpu.stat (the kernel's admin-guide cgroup-v2, "cpu.stat"), in seconds.

    It sums user and system time of every process that was ever in the cgroup, children included,
    whether or not their parent waited for them (a daemonized ssh ControlPersist master too).
    """
    for line in cpu_stat.splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value) / 1e6
    raise ValueError("cpu.stat has no usage_usec line")


def parse_snmp(text: str) -> dict[str, dict[str, int]]:
    """/proc/net/snmp as {protocol: {counter: value}} (pairs of header and value lines per protocol)."""
    lines = [line.split() for line in text.splitlines() if line.strip()]
    found: dict[str, dict[str, int]] = {}
    for header, values in zip(lines[::2], lines[1::2], strict=False):
        if not header or header[0] != values[0]:
            raise ValueError(f"unpaired /proc/net/snmp lines: {header[:1]} {values[:1]}")
        found[header[0].rstrip(":")] = {k: int(v) for k, v in zip(header[1:], values[1:], strict=True)}
    return found


@dataclass(frozen=True)
class SnmpDelta:
    """Connection attempts a network namespace made: every one, loopback included (the kernel's
    counters do not say where to)."""

    tcp_active_opens: int
    tcp_attempt_fails: int
    udp_out_datagrams: int


def snmp_since(before: str | None, after: str) -> SnmpDelta:
    """Counters of `after` minus `before` (None: a namespace made at boot, whose counters start at 0)."""
    end = parse_snmp(after)
    start = parse_snmp(before) if before is not None else {}

    def delta(proto: str, key: str) -> int:
        return end[proto][key] - start.get(proto, {}).get(key, 0)

    return SnmpDelta(
        tcp_active_opens=delta("Tcp", "ActiveOpens"),
        tcp_attempt_fails=delta("Tcp", "AttemptFails"),
        udp_out_datagrams=delta("Udp", "OutDatagrams"),
    )


# strace's decoding of a socket address (strace 6.1, the sockaddr printers in src/sockaddr.c):
# sin_addr=inet_addr("10.0.0.1"), inet_pton(AF_INET6, "::1", &sin6_addr), sun_path="/run/...".
_SYSCALL = re.compile(r"\b(connect|sendto|sendmsg|sendmmsg)\(")
_INET4 = re.compile(r'inet_addr\("([0-9.]+)"\)')
_INET6 = re.compile(r'inet_pton\(AF_INET6, "([0-9a-fA-F:.]+)"')
_PORT = re.compile(r"sin6?_port=htons\((\d+)\)")


@dataclass
class Connections:
    """The network calls a traced process tree made, by where they went."""

    outbound: list[str] = field(default_factory=list)  # routable: another host, the internet
    link_local: list[str] = field(default_factory=list)  # 169.254/16, fe80::/10: IMDS, the VPC's DNS
    loopback: list[str] = field(default_factory=list)
    own_address: list[str] = field(default_factory=list)  # the host's own interface addresses
    local_sockets: int = 0  # AF_UNIX, AF_NETLINK: never leave the host


def classify(address: str) -> str:
    """'loopback', 'link_local' or 'outbound' for an IP address."""
    ip = ipaddress.ip_address(address)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    ip = mapped or ip
    if ip.is_loopback or ip.is_unspecified:
        return "loopback"
    if ip.is_link_local:
        return "link_local"
    return "outbound"


def parse_strace(lines: Iterable[str], own: Iterable[str] = ()) -> Connections:
    """Count connect()/sendto()/sendmsg()/sendmmsg() calls in `strace -f` output by destination.

    A call counts whether or not it succeeded (an attempt is what a private subnet refuses). A
    send on an already connected socket names no address and is not counted again: its connect()
    was. Resumed lines ('<... connect resumed>') carry no address and are skipped.
    """
    found = Connections()
    # A call to one of the host's own addresses (e.g. a probe of its primary address) stays on it.
    own_ips = {ipaddress.ip_address(a) for a in own}
    for line in lines:
        if "resumed>" in line or not _SYSCALL.search(line):
            continue
        # The last address on the line: sendto()'s payload comes before its destination.
        addresses = _INET4.findall(line) or _INET6.findall(line)
        if not addresses:
            if "sa_family=AF_UNIX" in line or "sa_family=AF_NETLINK" in line:
                found.local_sockets += 1
            continue
        ports = _PORT.findall(line)
        where = f"{addresses[-1]}:{ports[-1]}" if ports else addresses[-1]
        if ipaddress.ip_address(addresses[-1]) in own_ips:
            found.own_address.append(where)
        else:
            getattr(found, classify(addresses[-1])).append(where)
    return found


_NODE_OK = re.compile(r"gpuforge-node: ok: revision (\S+), changed=(\d+), ([0-9.]+) s")


def node_ok(log: str) -> tuple[str, int, float] | None:
    """The last 'ok' line of gpuforge-node's log: (revision, changed tasks, its own wall seconds)."""
    found = _NODE_OK.findall(log)
    if not found:
        return None
    revision, changed, seconds = found[-1]
    return revision, int(changed), float(seconds)


# The model.


@dataclass(frozen=True)
class Projection:
    """One path projected to `nodes` nodes: the controller's CPU and the fleet's wall time."""

    path: str
    nodes: int
    controller_cpu_s: float
    wall_s: float
    formula: str


def ssh_projection(nodes: int, cpu_per_node: float, batch_wall: float, forks: int, cores: int) -> Projection:
    """`ansible-playbook` over SSH from one controller.

    Ansible's linear strategy runs each task on at most `forks` hosts at a time, so the fleet goes
    through in ceil(nodes / forks) batches, none faster than one batch of the measured fleet
    (`batch_wall`, measured with every host in one batch); and the controller cannot do its
    per-node work (`cpu_per_node`, measured) faster than its `cores` allow. The wall time is the
    larger of the two bounds: an estimate, not a measurement.
    """
    if min(nodes, forks, cores) < 1 or cpu_per_node < 0 or batch_wall < 0:
        raise ValueError("nodes, forks and cores must be >= 1; costs must be >= 0")
    batches = math.ceil(nodes / forks)
    cpu = cpu_per_node * nodes
    wall = max(batches * batch_wall, cpu / cores)
    formula = (
        f"CPU = {cpu_per_node:.2f} s/node x {nodes} = {cpu:.0f} s; wall = max(ceil({nodes}/{forks}) x "
        f"{batch_wall:.1f} s, {cpu:.0f} s / {cores} cores) = {wall:.0f} s"
    )
    return Projection("SSH fan-out", nodes, cpu, wall, formula)


def nodelocal_projection(
    nodes: int, trigger_cpu_per_node: float, node_wall: float, path: str = "node-local"
) -> Projection:
    """Every node configures itself on its own CPUs, all at once (ParallelCluster runs each node's
    OnNodeConfigured; nothing waits on a controller): the fleet's wall time is one node's
    (`node_wall`, measured on a node alone), whatever the fleet's size, and the controller's CPU is
    only what triggering costs per node (0 where ParallelCluster triggers)."""
    if nodes < 1 or trigger_cpu_per_node < 0 or node_wall < 0:
        raise ValueError("nodes must be >= 1; costs must be >= 0")
    cpu = trigger_cpu_per_node * nodes
    formula = (
        f"CPU = {trigger_cpu_per_node:.3f} s/node x {nodes} = {cpu:.1f} s; "
        f"wall = one node's {node_wall:.1f} s (independent of the fleet's size)"
    )
    return Projection(path, nodes, cpu, node_wall, formula)


def ssm_waves(nodes: int, max_concurrency: int) -> int:
    """Invocation rounds Run Command needs when every invocation takes as long: one node first,
    then twice as many at once each time invocations end, up to MaxConcurrency (the rate control as
    AWS's "Run commands at scale" describes it; tests/ssmdouble.py does the same)."""
    if nodes < 1 or max_concurrency < 1:
        raise ValueError("nodes and MaxConcurrency must be >= 1")
    done, window, waves = 0, 1, 0
    while done < nodes:
        done += min(window, max_concurrency, nodes - done)
        window *= 2
        waves += 1
    return waves


def ssm_projection(nodes: int, node_wall: float, max_concurrency: int) -> Projection:
    """SSM Run Command (one SendCommand for the fleet's tag targets, so O(1) controller work): the
    fleet's wall is its waves of invocations, each one node's wall."""
    waves = ssm_waves(nodes, max_concurrency)
    wall = waves * node_wall
    formula = (
        f"CPU = one SendCommand (O(1)); wall = {waves} waves (1, 2, 4, ... up to MaxConcurrency "
        f"{max_concurrency}) x {node_wall:.1f} s = {wall:.0f} s"
    )
    return Projection(f"SSM Run Command, MaxConcurrency {max_concurrency}", nodes, 0.0, wall, formula)
