"""Lab logic that needs no root: input validation, host plan, the package proxy, EC2 registration.

AWS here is moto_server (a test double); the proxy's upstream is a loopback HTTP server.
"""

from __future__ import annotations

import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import boto3
import pytest

from gpuforge.errors import UserError
from gpuforge_lab import aptproxy, cli, core, ec2, state, system
from gpuforge_lab.moto import MotoServer, free_port, port_in_use
from gpuforge_lab.state import LabState


@pytest.mark.parametrize("name", ["default", "m-nvidia", "a", "lab-12345678"])
def test_valid_lab_names(name: str) -> None:
    assert state.validate_name(name) == name


@pytest.mark.parametrize("name", ["", "Default", "1lab", "with_underscore", "much-too-long-name", "a b"])
def test_invalid_lab_names(name: str) -> None:
    with pytest.raises(UserError, match="lab name"):
        state.validate_name(name)


@pytest.mark.parametrize(
    ("nodes", "compute_type", "message"),
    [
        (0, "p5.48xlarge", "between 1 and 64"),
        (65, "p5.48xlarge", "between 1 and 64"),
        (2, "p9.huge", "unknown instance type 'p9.huge'"),
    ],
)
def test_bad_lab_spec(nodes: int, compute_type: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        core._validate(core.LabSpec(name="t", nodes=nodes, compute_type=compute_type))


def test_host_plan_mirrors_parallelcluster_naming() -> None:
    hosts = core._plan_hosts(core.LabSpec(name="t", nodes=3), "10.213.9")
    assert [(h.name, h.ip, h.role) for h in hosts] == [
        ("ip-10-213-9-10", "10.213.9.10", "HeadNode"),
        ("gpu-st-p5-48xlarge-1", "10.213.9.11", "Compute"),
        ("gpu-st-p5-48xlarge-2", "10.213.9.12", "Compute"),
    ]
    assert {h.queue for h in hosts[1:]} == {"gpu"}
    assert hosts[0].queue is None


def test_lab_indexes_are_not_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFORGE_LAB_DIR", str(tmp_path))
    first = state.allocate_index()
    lab = LabState(
        name="x",
        index=first,
        cluster_name="c",
        subnet_prefix=f"10.213.{first}",
        bridge="b",
        ssh_user="admin",
        ssh_key="k",
    )
    state.save(lab)
    assert state.allocate_index() != first
    assert state.load("x") == lab


@pytest.mark.parametrize("argv", [["up", "--bogus"], ["frobnicate"], ["up", "--nodes", "x"]])
def test_cli_rejects_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "message"), [("0", "0 must be at least 1"), ("-2", "-2 must be at least 1")]
)
def test_cli_reports_bad_node_count(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["up", "--nodes", value])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_moto_refuses_a_busy_port(tmp_path: Path) -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert port_in_use(port)
        with pytest.raises(UserError, match=f"port {port} .* already in use"):
            MotoServer(port=port, log_path=tmp_path / "m.log").start()


# --- the package proxy -------------------------------------------------------------------


class _Upstream(BaseHTTPRequestHandler):
    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        _Upstream.hits.append(self.path)
        body = f"payload for {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[tuple[str, int]]:
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    server = aptproxy.serve("127.0.0.1", 0, tmp_path / "cache", extra_hosts=frozenset({"127.0.0.1"}))
    for srv in (upstream, server):
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    _Upstream.hits = []
    yield f"http://127.0.0.1:{upstream.server_address[1]}", server.server_address[1]
    for srv in (upstream, server):
        srv.shutdown()
        srv.server_close()


def _get(url: str, proxy_port: int) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{proxy_port}"})
    )
    try:
        with opener.open(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, b""


def test_proxy_caches_pool_files(proxy: tuple[str, int]) -> None:
    upstream, port = proxy
    url = f"{upstream}/debian/pool/main/h/hello/hello_2.10-3_amd64.deb"
    assert _get(url, port) == (200, b"payload for /debian/pool/main/h/hello/hello_2.10-3_amd64.deb")
    assert _get(url, port)[1].startswith(b"payload for")
    assert _Upstream.hits == ["/debian/pool/main/h/hello/hello_2.10-3_amd64.deb"]


def test_proxy_does_not_cache_indexes(proxy: tuple[str, int]) -> None:
    upstream, port = proxy
    url = f"{upstream}/debian/dists/bookworm/InRelease"
    _get(url, port)
    _get(url, port)
    assert _Upstream.hits == ["/debian/dists/bookworm/InRelease"] * 2


def test_proxy_refuses_hosts_off_the_allow_list(proxy: tuple[str, int]) -> None:
    _, port = proxy
    status, _ = _get("http://example.invalid/debian/pool/x.deb", port)
    assert status == 403


def test_cache_paths_cannot_escape(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        aptproxy.cache_file(tmp_path, "deb.debian.org", "/debian/../../etc/passwd")


# --- moto extensions and EC2 registration -----------------------------------------------


def test_placement_groups_in_moto(aws: MotoServer) -> None:
    client = boto3.client("ec2")
    client.create_placement_group(GroupName="pg", Strategy="cluster")
    groups = client.describe_placement_groups()["PlacementGroups"]
    assert [(g["GroupName"], g["Strategy"], g["State"]) for g in groups] == [("pg", "cluster", "available")]
    with pytest.raises(client.exceptions.ClientError, match="Duplicate"):
        client.create_placement_group(GroupName="pg", Strategy="cluster")
    with pytest.raises(client.exceptions.ClientError, match="Unknown"):
        client.describe_placement_groups(GroupNames=["missing"])
    client.delete_placement_group(GroupName="pg")
    assert client.describe_placement_groups()["PlacementGroups"] == []


def test_register_tags_hosts_like_parallelcluster(aws: MotoServer) -> None:
    lab = LabState(
        name="t",
        index=5,
        cluster_name="demo",
        subnet_prefix="10.213.5",
        bridge="gf5br",
        ssh_user="admin",
        ssh_key="k",
        hosts=core._plan_hosts(core.LabSpec(name="t", nodes=3), "10.213.5"),
    )
    ec2.register(lab)
    client = boto3.client("ec2")
    pages = client.get_paginator("describe_instances").paginate(
        Filters=[{"Name": "tag:parallelcluster:cluster-name", "Values": ["demo"]}]
    )
    instances = {
        i["PrivateIpAddress"]: i for page in pages for r in page["Reservations"] for i in r["Instances"]
    }
    assert set(instances) == {h.ip for h in lab.hosts}
    head, compute = instances["10.213.5.10"], instances["10.213.5.11"]
    tags = {t["Key"]: t["Value"] for t in compute["Tags"]}
    assert tags["parallelcluster:node-type"] == "Compute"
    assert tags["parallelcluster:queue-name"] == "gpu"
    assert tags["parallelcluster:compute-resource-name"] == "p5-48xlarge"
    assert {t["Key"]: t["Value"] for t in head["Tags"]}["parallelcluster:node-type"] == "HeadNode"
    assert compute["Placement"]["GroupName"] == "demo-pg"
    efa = [n for n in compute["NetworkInterfaces"] if n["InterfaceType"] == "efa"]
    assert len(efa) == 32
    assert sorted(n["Attachment"]["NetworkCardIndex"] for n in efa) == list(range(32))
    assert [n["InterfaceType"] for n in head["NetworkInterfaces"]] == ["interface"]
    assert compute["MetadataOptions"]["HttpTokens"] == "required"
    group_id = compute["NetworkInterfaces"][0]["Groups"][0]["GroupId"]
    group = client.describe_security_groups(GroupIds=[group_id])["SecurityGroups"][0]
    for rules in (group["IpPermissions"], group["IpPermissionsEgress"]):
        assert any(
            r["IpProtocol"] == "-1"
            and {"GroupId": group_id} in [{"GroupId": p["GroupId"]} for p in r["UserIdGroupPairs"]]
            for r in rules
        )


def test_free_port_is_free() -> None:
    assert not port_in_use(free_port())


def test_a_process_inside_execve_counts_as_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Right after Popen returns, /proc/PID/cmdline can read empty for a moment (the child is still
    inside execve: seen with systemd-nspawn); that process is starting, not gone."""
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    real = Path.read_bytes
    empty_reads = {"left": 3}

    def read_bytes(path: Path) -> bytes:
        if path == Path(f"/proc/{proc.pid}/cmdline") and empty_reads["left"]:
            empty_reads["left"] -= 1
            return b""
        return real(path)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    try:
        assert system.pid_alive(proc.pid, "sleep")
        assert empty_reads["left"] == 0
    finally:
        proc.kill()
        proc.wait()
    assert not system.pid_alive(proc.pid, "sleep")
