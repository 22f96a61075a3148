"""The pure parts of bench/nodelocal.py (gpuforge_lab.bench.nodecost): parsing and the 1,000-node model.

The inputs are what the real tools print: systemd-run's summary lines as systemd src/run/run.c
writes them, /proc/net/snmp's paired header/value lines, cgroup v2 cpu.stat, strace 6.1's decoding
of connect()/sendto() (recorded on this machine with `strace -f -e trace=connect,sendto`).
"""

from __future__ import annotations

import math

import pytest

from gpuforge_lab.bench import nodecost

SYSTEMD_RUN_OK = """\
Running as unit: gpuforge-bench-apply.service
Finished with result: success
Main processes terminated with: code=exited/status=0
Service runtime: 1min 2.345s
CPU time consumed: 48.120s
"""

SNMP_BEFORE = """\
Ip: Forwarding DefaultTTL InReceives
Ip: 1 64 10
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab
Tcp: 1 200 120000 -1 2 5 1 0 1
Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors
Udp: 0 0 0 3 0
"""

SNMP_AFTER = SNMP_BEFORE.replace("Tcp: 1 200 120000 -1 2 5 1 0 1", "Tcp: 1 200 120000 -1 7 9 4 0 1").replace(
    "Udp: 0 0 0 3 0", "Udp: 0 0 0 11 0"
)

STRACE = [
    '9760  connect(3, {sa_family=AF_INET, sin_port=htons(9), sin_addr=inet_addr("127.0.0.1")}, 16)'
    " = -1 ECONNREFUSED (Connection refused)",
    "9760  connect(4, {sa_family=AF_INET6, sin6_port=htons(9), sin6_flowinfo=htonl(0), "
    'inet_pton(AF_INET6, "::1", &sin6_addr), sin6_scope_id=0}, 28) = -1 EINPROGRESS',
    '9761  connect(5, {sa_family=AF_UNIX, sun_path="/run/systemd/private"}, 23) = 0',
    '9762  sendto(4, "inet_addr(\\"8.8.8.8\\")", 1, 0, {sa_family=AF_INET, sin_port=htons(53), '
    'sin_addr=inet_addr("169.254.169.254")}, 16) = 1',
    '9763  connect(3, {sa_family=AF_INET, sin_port=htons(443), sin_addr=inet_addr("52.216.1.2")}, 16'
    " <unfinished ...>",
    "9763  <... connect resumed>) = -1 ENETUNREACH (Network is unreachable)",
    '9764  sendto(6, "x", 1, MSG_NOSIGNAL, NULL, 0) = 1',
    "9765  connect(7, {sa_family=AF_INET6, sin6_port=htons(443), sin6_flowinfo=htonl(0), "
    'inet_pton(AF_INET6, "::ffff:10.1.2.3", &sin6_addr), sin6_scope_id=0}, 28) = -1 EINPROGRESS',
]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("870ms", 0.87),
        ("48.120s", 48.12),
        ("1min 2.345s", 62.345),
        ("1h 2min 3s", 3723.0),
        ("250us", 0.00025),
    ],
)
def test_parse_timespan_reads_systemd_format_timespan(text: str, seconds: float) -> None:
    """Each suffix of systemd's format_timespan() table, alone and combined."""
    assert nodecost.parse_timespan(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "12", "1.5 seconds", "3m", "infinity"])
def test_parse_timespan_refuses_what_it_cannot_read(text: str) -> None:
    """Anything but format_timespan()'s tokens is an error, never a silent 0."""
    with pytest.raises(ValueError, match="not a systemd timespan"):
        nodecost.parse_timespan(text)


def test_parse_unit_run_reads_result_status_runtime_and_cpu() -> None:
    run = nodecost.parse_unit_run(SYSTEMD_RUN_OK)
    assert (run.result, run.exit_status, run.ok) == ("success", 0, True)
    assert run.runtime_s == pytest.approx(62.345)
    assert run.cpu_s == pytest.approx(48.12)


def test_parse_unit_run_failed_unit_and_missing_cpu_accounting() -> None:
    """A failed custom action is not ok; a unit without CPU accounting has no CPU figure (None, not 0)."""
    text = (
        "Running as unit: x.service\nFinished with result: exit-code\n"
        "Main processes terminated with: code=exited/status=3\nService runtime: 4.2s\n"
    )
    run = nodecost.parse_unit_run(text)
    assert (run.result, run.exit_status, run.cpu_s, run.ok) == ("exit-code", 3, None, False)


def test_parse_unit_run_without_an_end_is_an_error() -> None:
    with pytest.raises(ValueError, match="did not see its unit end"):
        nodecost.parse_unit_run("Running as unit: x.service\n")


def test_cgroup_cpu_seconds_reads_usage_usec() -> None:
    stat = "usage_usec 12345678\nuser_usec 10000000\nsystem_usec 2345678\n"
    assert nodecost.cgroup_cpu_seconds(stat) == pytest.approx(12.345678)
    with pytest.raises(ValueError):
        nodecost.cgroup_cpu_seconds("user_usec 1\n")


def test_snmp_delta_between_two_reads_and_since_boot() -> None:
    """Counters of the after-read minus the before-read; a namespace made at boot starts at 0."""
    delta = nodecost.snmp_since(SNMP_BEFORE, SNMP_AFTER)
    assert delta == nodecost.SnmpDelta(tcp_active_opens=5, tcp_attempt_fails=3, udp_out_datagrams=8)
    assert nodecost.snmp_since(None, SNMP_AFTER) == nodecost.SnmpDelta(7, 4, 11)


def test_parse_snmp_refuses_unpaired_lines() -> None:
    with pytest.raises(ValueError, match="unpaired"):
        nodecost.parse_snmp("Tcp: ActiveOpens\nUdp: 3\n")


def test_parse_strace_sorts_calls_by_destination() -> None:
    """Loopback (v4, v6), link-local (IMDS), routable (S3, a v4-mapped v6 address) and local sockets;
    a resumed line and a send on a connected socket are not counted twice; the destination is the
    address after sendto()'s payload, not an address-like string inside it."""
    found = nodecost.parse_strace(STRACE)
    assert found.loopback == ["127.0.0.1:9", "::1:9"]
    assert found.link_local == ["169.254.169.254:53"]
    assert found.outbound == ["52.216.1.2:443", "::ffff:10.1.2.3:443"]
    assert found.local_sockets == 1


def test_parse_strace_of_an_offline_run_is_zero_outbound() -> None:
    assert nodecost.parse_strace(STRACE[:3]).outbound == []


def test_node_ok_reads_the_last_ok_line() -> None:
    log = (
        "gpuforge-node: ok: revision c0123, changed=9, 40.5 s\n"
        "gpuforge-node: configure phase failed\n"
        "gpuforge-node: ok: revision c0123abcd, changed=0, 12.0 s\n"
    )
    assert nodecost.node_ok(log) == ("c0123abcd", 0, 12.0)
    assert nodecost.node_ok("gpuforge-node: configure phase failed\n") is None


def test_ssh_projection_is_bound_by_batches_or_controller_cores() -> None:
    """1,000 nodes at forks 25: 40 batches of the measured wall, unless the controller's cores
    cannot do 1,000 nodes' CPU in that time."""
    latency_bound = nodecost.ssh_projection(1000, cpu_per_node=2.0, batch_wall=60.0, forks=25, cores=64)
    assert latency_bound.controller_cpu_s == 2000.0
    assert latency_bound.wall_s == 40 * 60.0
    cpu_bound = nodecost.ssh_projection(1000, cpu_per_node=8.0, batch_wall=60.0, forks=25, cores=2)
    assert cpu_bound.wall_s == 8.0 * 1000 / 2
    assert "ceil(1000/25)" in cpu_bound.formula and "/ 2 cores" in cpu_bound.formula


def test_nodelocal_projection_does_not_grow_with_the_fleet() -> None:
    """The fleet's wall is one node's at any size; the controller's CPU is the trigger's only."""
    small = nodecost.nodelocal_projection(16, trigger_cpu_per_node=0.0, node_wall=30.0)
    large = nodecost.nodelocal_projection(1000, trigger_cpu_per_node=0.0, node_wall=30.0)
    assert small.wall_s == large.wall_s == 30.0
    assert large.controller_cpu_s == 0.0
    assert nodecost.nodelocal_projection(1000, 0.01, 30.0).controller_cpu_s == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("nodes", "cap", "waves"),
    [(1, 50, 1), (2, 50, 2), (3, 50, 2), (4, 50, 3), (16, 50, 5), (1000, 50, 25), (1000, 1000, 10)],
)
def test_ssm_waves_ramp_up_then_run_at_max_concurrency(nodes: int, cap: int, waves: int) -> None:
    """1, 2, 4, ... nodes per wave until MaxConcurrency, then MaxConcurrency per wave."""
    assert nodecost.ssm_waves(nodes, cap) == waves


def test_ssm_projection_wall_is_waves_of_one_node() -> None:
    projection = nodecost.ssm_projection(1000, node_wall=30.0, max_concurrency=50)
    assert projection.wall_s == 25 * 30.0
    assert projection.controller_cpu_s == 0.0


@pytest.mark.parametrize(
    "call",
    [
        lambda: nodecost.ssh_projection(0, 1.0, 1.0, 25, 2),
        lambda: nodecost.ssh_projection(10, -1.0, 1.0, 25, 2),
        lambda: nodecost.nodelocal_projection(10, -0.1, 1.0),
        lambda: nodecost.ssm_waves(10, 0),
    ],
)
def test_models_refuse_impossible_inputs(call: object) -> None:
    with pytest.raises(ValueError):
        call()  # type: ignore[operator]


def test_classify_ip_addresses() -> None:
    assert [nodecost.classify(a) for a in ("127.0.0.53", "fe80::1", "169.254.169.254", "10.0.0.2")] == [
        "loopback",
        "link_local",
        "link_local",
        "outbound",
    ]
    assert math.isclose(nodecost.parse_timespan("1d"), 86400.0)


def test_parse_strace_counts_the_hosts_own_address_apart_from_outbound() -> None:
    """Recorded on a lab host at boot: a TCP connect to the host's own address (10.213.1.11, port 0)
    never leaves it; counted as outbound, it made the offline boot look like it called out."""
    line = (
        '1234  connect(7, {sa_family=AF_INET, sin_port=htons(0), sin_addr=inet_addr("10.213.1.11")}, 16)'
        " = -1 ECONNREFUSED (Connection refused)"
    )
    assert nodecost.parse_strace([line]).outbound == ["10.213.1.11:0"]
    found = nodecost.parse_strace([line], own=["10.213.1.11", "fe80::1"])
    assert (found.outbound, found.own_address) == ([], ["10.213.1.11:0"])
