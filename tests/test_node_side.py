"""The node side (issue 29, items 1-2): gpuforge-node, the offline OnNodeConfigured action, revisions in S3.

Unit tests of roles/gpuforge_node/files/gpuforge_node.py (arguments, retries with jitter on an injected
clock, object names, IMDS through a stand-in server, the one-host inventory against the fleet inventory
plugin), of `gpuforge node-revision publish` against moto_server (the S3 test double), of
scripts/pcluster/on_node_configured.sh and of the CustomActions `cluster-config generate` writes.
The run on a lab host with no route but to S3 is in tests/test_fleet_lab.py.
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import boto3
import pytest
import yaml

from gpuforge import noderev
from gpuforge.errors import UserError
from gpuforge.pcluster.generate import generate

REPO = Path(__file__).resolve().parents[1]
ROLE = REPO / "roles" / "gpuforge_node"
SCRIPT = REPO / "scripts" / "pcluster" / "on_node_configured.sh"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SHA = "ab" * 32


@pytest.fixture(scope="module")
def node() -> ModuleType:
    return noderev.node_module()


def apply_args(node: ModuleType, *argv: str) -> argparse.Namespace:
    args: argparse.Namespace = node.parse_args(["apply", *argv])
    return args


# Arguments.


def test_apply_takes_the_node_part_and_passes_the_rest_to_ansible(node: ModuleType) -> None:
    args = apply_args(node, "--node-type", "Compute", "--queue", "gpu", "--", "-e", "x=1")
    assert (args.node_type, args.queue, args.tags, args.extra) == (
        "Compute",
        "gpu",
        "configure",
        ["-e", "x=1"],
    )


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--revision", COMMIT], "--revision, --sha256 and --bucket go together"),
        (["--revision", "main", "--sha256", SHA, "--bucket", "b-1"], "not an exact git commit"),
        (["--revision", COMMIT[:12], "--sha256", SHA, "--bucket", "b-1"], "not an exact git commit"),
        (["--revision", COMMIT, "--sha256", "ABC", "--bucket", "b-1"], "64 lowercase hex"),
        (["--revision", COMMIT, "--sha256", SHA, "--bucket", "Bad_Bucket"], "not an S3 bucket name"),
        (["--prefix", "no-slash"], "must end with /"),
        (["--attempts", "0"], "between 1 and 20"),
        (["--node-type", "HeadNode", "--queue", "gpu"], "the head node has none"),
        (["--node-type", "LoginNode"], "bad arguments"),
    ],
)
def test_bad_arguments_are_refused_with_a_reason(node: ModuleType, argv: list[str], reason: str) -> None:
    with pytest.raises(node.NodeError, match=re.escape(reason)) as caught:
        apply_args(node, *argv)
    assert caught.value.code == node.EXIT_USAGE


def test_main_prints_one_line_and_exits_2_on_bad_arguments(
    node: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert node.main(["apply", "--revision", COMMIT]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("gpuforge-node: --revision, --sha256 and --bucket go together")


# Revisions: names, retries with jitter, verification, unpacking.


def test_object_key_names_the_exact_revision(node: ModuleType) -> None:
    assert node.object_key("gpuforge/revisions/", COMMIT) == f"gpuforge/revisions/gpuforge-{COMMIT}.tar.gz"
    with pytest.raises(node.NodeError, match="not an exact git commit"):
        node.object_key("p/", "HEAD")


def test_backoff_is_full_jitter_capped_exponential(node: ModuleType) -> None:
    """With the random draw at its top the waits are the caps (1, 2, 4, 8, 16, 20 ...); at 0 they are 0."""
    assert node.backoff_delays(7, rand=lambda: 1.0) == [1.0, 2.0, 4.0, 8.0, 16.0, 20.0]
    assert node.backoff_delays(4, rand=lambda: 0.0) == [0.0, 0.0, 0.0]
    assert node.backoff_delays(1) == []


def test_retrying_sleeps_the_jittered_delays_then_succeeds(node: ModuleType) -> None:
    calls: list[int] = []
    slept: list[float] = []

    def flaky() -> bytes:
        calls.append(1)
        if len(calls) < 3:
            raise node.NodeError("SlowDown", node.EXIT_REVISION)
        return b"ok"

    logged: list[str] = []
    got = node.retrying(flaky, 5, logged.append, sleep=slept.append, rand=lambda: 0.5)
    assert (got, len(calls), slept) == (b"ok", 3, [0.5, 1.0])
    assert logged[0] == "attempt 1 of 5 failed: SlowDown; retrying in 0.5 s"


def test_retrying_gives_up_after_the_attempts_with_the_last_reason(node: ModuleType) -> None:
    slept: list[float] = []

    def broken() -> bytes:
        raise node.NodeError("AccessDenied", node.EXIT_REVISION)

    with pytest.raises(node.NodeError, match=r"^AccessDenied \(after 3 attempts\)$") as caught:
        node.retrying(broken, 3, lambda _: None, sleep=slept.append, rand=lambda: 1.0)
    assert caught.value.code == node.EXIT_REVISION and slept == [1.0, 2.0]


def test_verified_refuses_other_bytes(node: ModuleType) -> None:
    data = b"tarball"
    assert node.verified(data, hashlib.sha256(data).hexdigest(), "x") == data
    with pytest.raises(node.NodeError, match=f"not the {SHA} the custom action names"):
        node.verified(data, SHA, "s3://b/k")


def _tarball(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def test_unpack_revision_places_the_collection_beside_the_baked_one(node: ModuleType, tmp_path: Path) -> None:
    tree = node.unpack_revision(_tarball({"playbooks/fleet.yml": b"---\n"}), tmp_path, COMMIT)
    assert tree == tmp_path / "revisions" / COMMIT
    assert (tree / "ansible_collections/gpuforge/gpu/playbooks/fleet.yml").read_text() == "---\n"
    assert (tree / ".gpuforge-revision").read_text() == f"{COMMIT}\n"


def test_unpack_revision_refuses_paths_out_of_the_tree(node: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(tarfile.OutsideDestinationError):
        node.unpack_revision(_tarball({"../../escape": b"x"}), tmp_path / "root", COMMIT)
    assert not (tmp_path / "root" / "revisions" / COMMIT).exists()


# Publish (CLI) and fetch (node) against the S3 test double.


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, str]:
    """A small git repository with one commit."""
    root = tmp_path / "repo"
    (root / "playbooks").mkdir(parents=True)
    (root / "playbooks/fleet.yml").write_text("---\n- hosts: all\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@e"
    for command in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "one"]):
        subprocess.run(["git", "-C", str(root), *command], check=True, env=env)
    head = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    )
    return root, head.stdout.strip()


def _fetch_args(node: ModuleType, root: Path, commit: str, sha: str, attempts: int = 3) -> argparse.Namespace:
    args = apply_args(
        node, "--revision", commit, "--sha256", sha, "--bucket", "revs", "--attempts", str(attempts)
    )
    args.root = root
    return args


def test_published_revision_is_fetched_verified_and_unpacked(
    aws: Any, node: ModuleType, repo: tuple[Path, str], tmp_path: Path
) -> None:
    root, commit = repo
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="revs")
    result = noderev.publish(s3, root, "HEAD", "revs", "gpuforge/revisions/")
    body = s3.get_object(Bucket="revs", Key=result["key"])
    data = body["Body"].read()
    assert result["key"] == f"gpuforge/revisions/gpuforge-{commit}.tar.gz"
    assert result["sha256"] == hashlib.sha256(data).hexdigest() == body["Metadata"]["sha256"]
    assert result["args"] == ["--revision", commit, "--sha256", result["sha256"], "--bucket", "revs"]
    # Publishing again is a no-op; the same name with other bytes is refused.
    assert noderev.publish(s3, root, commit, "revs", "gpuforge/revisions/")["uploaded"] is False
    s3.put_object(Bucket="revs", Key=result["key"], Body=b"x", Metadata={"sha256": "0" * 64})
    with pytest.raises(UserError, match="revisions are immutable"):
        noderev.publish(s3, root, commit, "revs", "gpuforge/revisions/")
    s3.put_object(Bucket="revs", Key=result["key"], Body=data, Metadata={"sha256": result["sha256"]})

    logged: list[str] = []
    args = _fetch_args(node, tmp_path / "node", commit, result["sha256"])
    got, tree = node.choose_tree(args, node.Facts(region="us-east-1"), logged.append, sleep=lambda _: None)
    assert got == commit and (tree / "ansible_collections/gpuforge/gpu/playbooks/fleet.yml").is_file()
    # A second run finds it on the node and asks S3 nothing.
    assert node.choose_tree(args, node.Facts(), logged.append, sleep=None)[1] == tree
    assert logged[-1] == f"revision {commit} is already on this node"


def test_a_wrong_sha256_fails_after_every_attempt(
    aws: Any, node: ModuleType, repo: tuple[Path, str], tmp_path: Path
) -> None:
    root, commit = repo
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="revs")
    noderev.publish(s3, root, commit, "revs", "gpuforge/revisions/")
    slept: list[float] = []
    args = _fetch_args(node, tmp_path / "node", commit, SHA, attempts=3)
    with pytest.raises(node.NodeError, match=rf"not the {SHA} the custom action names \(after 3 attempts\)"):
        node.choose_tree(args, node.Facts(region="us-east-1"), lambda _: None, sleep=slept.append)
    assert len(slept) == 2
    assert not (tmp_path / "node" / "revisions" / commit).exists()


def test_a_missing_revision_names_the_object(aws: Any, node: ModuleType, tmp_path: Path) -> None:
    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="revs")
    args = _fetch_args(node, tmp_path, COMMIT, SHA, attempts=2)
    with pytest.raises(
        node.NodeError, match=rf"s3://revs/gpuforge/revisions/gpuforge-{COMMIT}.tar.gz: NoSuchKey"
    ):
        node.choose_tree(args, node.Facts(region="us-east-1"), lambda _: None, sleep=lambda _: None)


def test_without_a_revision_the_baked_one_runs(node: ModuleType, tmp_path: Path) -> None:
    args = apply_args(node)
    args.root = tmp_path
    with pytest.raises(node.NodeError, match="was not baked with roles/gpuforge_node") as caught:
        node.choose_tree(args, node.Facts(), lambda _: None)
    assert caught.value.code == node.EXIT_REVISION
    (tmp_path / "revisions" / "cabc").mkdir(parents=True)
    (tmp_path / "revisions" / "cabc" / ".gpuforge-revision").write_text("cabc\n")
    (tmp_path / "current").symlink_to("revisions/cabc")
    assert node.choose_tree(args, node.Facts(), lambda _: None) == ("cabc", tmp_path / "revisions" / "cabc")


# Facts from IMDS (a stand-in server speaking IMDSv2) and the one-host inventory.


class _Imds(http.server.BaseHTTPRequestHandler):
    data: ClassVar[dict[str, str]] = {}

    def do_PUT(self) -> None:
        ok = self.path == "/latest/api/token" and "X-aws-ec2-metadata-token-ttl-seconds" in self.headers
        self._send(200 if ok else 400, "TOKEN" if ok else "")

    def do_GET(self) -> None:
        if self.headers.get("X-aws-ec2-metadata-token") != "TOKEN":
            self._send(401, "")
            return
        value = self.data.get(self.path.removeprefix("/latest/"))
        self._send(200 if value is not None else 404, value or "")

    def _send(self, code: int, body: str) -> None:
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def imds() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Imds)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_facts_come_from_imdsv2_and_the_instance_tags(node: ModuleType, imds: str) -> None:
    _Imds.data = {
        "meta-data/instance-type": "p5.48xlarge",
        "meta-data/placement/region": "us-east-2",
        "meta-data/tags/instance/parallelcluster:cluster-name": "train",
        "meta-data/tags/instance/parallelcluster:node-type": "Compute",
        "meta-data/tags/instance/parallelcluster:queue-name": "gpu",
    }
    facts = node.gather(apply_args(node), node.Imds(imds))
    assert (facts.instance_type, facts.region, facts.cluster, facts.node_type, facts.queue, facts.lab) == (
        "p5.48xlarge",
        "us-east-2",
        "train",
        "Compute",
        "gpu",
        False,
    )


def test_the_custom_action_args_win_and_tags_may_be_absent(node: ModuleType, imds: str) -> None:
    """Instance tags in metadata are off by default (404): the Args generate writes name the part."""
    _Imds.data = {"meta-data/instance-type": "p4d.24xlarge"}
    facts = node.gather(apply_args(node, "--node-type", "HeadNode", "--cluster", "c1"), node.Imds(imds))
    assert (facts.node_type, facts.cluster, facts.queue, facts.instance_type) == (
        "HeadNode",
        "c1",
        None,
        "p4d.24xlarge",
    )
    with pytest.raises(node.NodeError, match="pass --node-type HeadNode or Compute"):
        node.gather(apply_args(node), node.Imds(imds))


def test_a_run_without_args_uses_the_part_the_custom_action_recorded(
    node: ModuleType, imds: str, tmp_path: Path
) -> None:
    """ParallelCluster leaves instance tags out of metadata (its launch templates set HttpTokens only), so
    the SSM document's `gpuforge-node apply`, which has no Args, finds the part the boot run recorded."""
    _Imds.data = {"meta-data/instance-type": "p5.48xlarge"}
    boot = node.gather(
        apply_args(node, "--node-type", "Compute", "--queue", "gpu", "--cluster", "train"), node.Imds(imds)
    )
    node.record_facts(tmp_path, boot)
    later = node.gather(apply_args(node), node.Imds(imds), node.recorded_facts(tmp_path))
    assert (later.node_type, later.queue, later.cluster) == ("Compute", "gpu", "train")
    # What the inventory gives the node is the same as at boot.
    assert node.inventory(later) == node.inventory(boot)
    # Args still win over the record; a head node never takes a recorded queue.
    head = node.gather(
        apply_args(node, "--node-type", "HeadNode"), node.Imds(imds), node.recorded_facts(tmp_path)
    )
    assert (head.node_type, head.queue) == ("HeadNode", None)
    (tmp_path / node.RECORD).write_text("[1]")
    with pytest.raises(node.NodeError, match="is not a JSON object"):
        node.recorded_facts(tmp_path)


def test_no_imds_and_no_instance_type_is_refused(node: ModuleType) -> None:
    unreachable = node.Imds("http://127.0.0.1:9", timeout=0.5)
    with pytest.raises(
        node.NodeError, match=r"IMDS \(http://127.0.0.1:9\) is unreachable\): pass --instance-type"
    ):
        node.gather(apply_args(node, "--node-type", "Compute"), unreachable)


def test_inventory_matches_what_the_fleet_inventory_plugin_gives_the_node(node: ModuleType) -> None:
    """Same host variables and groups as plugins/inventory/ec2_fleet.py for the same instance."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ec2_fleet", REPO / "plugins/inventory/ec2_fleet.py")
    assert spec and spec.loader
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    rec = {
        "host": "ip-10-0-0-5.ec2.internal",
        "ip": "10.0.0.5",
        "dns": "ip-10-0-0-5.ec2.internal",
        "instance_type": "p5.48xlarge",
        "image_id": "ami-1",
        "instance_id": "i-1",
        "region": "us-east-1",
        "az": "us-east-1a",
        "lab": True,
        "cluster": "train",
        "node_type": "Compute",
        "queue": "gpu",
        "compute_resource": "p5",
        "name_tag": "Compute",
    }
    facts = node.Facts(
        node_type="Compute",
        instance_type="p5.48xlarge",
        region="us-east-1",
        cluster="train",
        queue="gpu",
        compute_resource="p5",
        az="us-east-1a",
        lab=True,
        hostname="Compute",
    )
    inv = node.inventory(facts)["all"]
    wanted = plugin.host_vars(rec)
    host = inv["hosts"]["localhost"]
    # What EC2 alone knows (image, instance id) and the SSH address are not read by the configure phase.
    for key in ("ansible_host", "aws_image_id", "aws_instance_id"):
        wanted.pop(key)
    assert {k: v for k, v in host.items() if not k.startswith("ansible_")} == wanted
    assert host["ansible_connection"] == "local"
    # Ansible keeps letters, digits and underscores in group names (the plugin's names, sanitized).
    expected_groups = {re.sub(r"[^A-Za-z0-9_]", "_", g) for g in plugin.group_names(rec)}
    assert set(inv["children"]) == expected_groups


# The pinned runtime the role installs: the node's own set (files/constraints.txt), for every base's python3.

ROLE_PINS = ROLE / "files/constraints.txt"
# Ubuntu 22.04's python3 (DLAMI, ParallelCluster), Ubuntu 24.04's, Debian 12's (the lab).
BASE_PYTHONS = ("3.10", "3.12", "3.11")


def _pins(path: Path) -> dict[str, str]:
    lines = (
        line.split("==")
        for line in path.read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    return {_norm(name): version.strip() for name, version in lines}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def _role_vars() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROLE / "vars/main.yml").read_text())
    return loaded


def _pypi_reachable() -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen("https://pypi.org/simple/ansible-core/", timeout=15):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def resolved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """What pip resolves for the role's top-level requirements under the role's constraints, per base
    Python (pip --dry-run --report, manylinux x86_64 wheels, PyPI only: no config file, no local wheels)."""
    if not _pypi_reachable():
        pytest.skip("PyPI unreachable: the node runtime's pins cannot be resolved here")
    pip = Path(sys.executable).with_name("pip")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env["PIP_CONFIG_FILE"] = os.devnull
    out: dict[str, dict[str, Any]] = {}
    for python in BASE_PYTHONS:
        work = tmp_path_factory.mktemp(f"pip-{python}")
        report = work / "report.json"
        command = [str(pip), "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report)]
        command += ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
        for platform in ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64"):
            command += ["--platform", platform]
        command += ["--target", str(work / "t"), "--constraint", str(ROLE_PINS)]
        command += _role_vars()["_gpuforge_node_requirements"]
        run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
        assert run.returncode == 0, f"Python {python}: the pins do not install:\n{run.stderr[-3000:]}"
        out[python] = {
            _norm(item["metadata"]["name"]): item["metadata"]
            for item in json.loads(report.read_text())["install"]
        }
    return out


@pytest.mark.parametrize("python", BASE_PYTHONS)
def test_node_pins_are_exactly_what_pip_resolves_on_each_base_python(
    resolved: dict[str, dict[str, Any]], python: str
) -> None:
    """Every pin installs on that Python, every requirement is pinned, and nothing is pinned that nothing
    needs: pip's resolution of ansible-core + boto3 under the constraints is the constraints."""
    got = {name: meta["version"] for name, meta in resolved[python].items()}
    assert got == _pins(ROLE_PINS)


def test_node_python_range_is_the_pinned_ansible_core_s() -> None:
    """The role's floor is the pinned ansible-core's Requires-Python (read from its wheel by the resolution
    above in test_node_pins_...); here from the pin itself: 2.17.x, whose controller runs on 3.10 to 3.12
    (https://gist.github.com/sivel/3fc22827e48e60c077a6db058ed6bee2). Every supported base's python3 is
    inside the range, so no base needs an extra Python."""
    role = _role_vars()
    floor, ceiling = tuple(role["_gpuforge_node_min_python"]), tuple(role["_gpuforge_node_max_python"])
    assert _pins(ROLE_PINS)["ansible-core"].startswith("2.17.")
    assert (floor, ceiling) == ((3, 10), (3, 12))
    for python in BASE_PYTHONS:
        assert floor <= tuple(int(n) for n in python.split(".")) <= ceiling, python


def test_node_floor_is_the_requires_python_of_the_pinned_wheel(resolved: dict[str, dict[str, Any]]) -> None:
    floor = _role_vars()["_gpuforge_node_min_python"]
    requires = resolved["3.12"]["ansible-core"]["requires_python"]
    assert requires.replace(" ", "") == ">=" + ".".join(str(n) for n in floor)


def test_node_runtime_is_not_the_controller_s_where_that_needs_a_newer_python() -> None:
    """The role's pins differ from requirements/constraints.txt only in what Python 3.10 forces (the
    controller's ansible-core 2.19 and pycparser 3.12 need 3.11); the rest stays the tested set."""
    role, repo = _pins(ROLE_PINS), _pins(REPO / "requirements/constraints.txt")
    differ = {name for name in role if repo.get(name) != role[name]}
    assert differ == {"ansible-core", "resolvelib", "pycparser"}


@pytest.mark.parametrize("version", ["3.10", "3.11", "3.12"])
def test_entry_point_runs_on_every_base_python(version: str, tmp_path: Path) -> None:
    """gpuforge-node runs under the venv's Python, 3.10 on Ubuntu 22.04: its arguments, the tarball's
    safe unpacking (tarfile's data filter) and the inventory work there (pyenv's interpreters here)."""
    found = [p for p in (Path(f"/usr/bin/python{version}"),) if p.exists()]
    # CI images carry the other versions under pyenv.
    pyenv = Path(os.environ.get("PYENV_ROOT", "/root/.pyenv"))
    found += sorted(pyenv.glob(f"versions/{version}.*/bin/python"))
    if not found:
        pytest.skip(f"no Python {version} on this host")
    code = (
        "import sys, io, tarfile, pathlib; sys.path.insert(0, sys.argv[1]); import gpuforge_node as g\n"
        "a = g.parse_args(['apply', '--node-type', 'Compute', '--queue', 'gpu'])\n"
        "b = io.BytesIO(); t = tarfile.open(fileobj=b, mode='w:gz')\n"
        "i = tarfile.TarInfo('playbooks/fleet.yml')\n"
        "i.size = 4; t.addfile(i, io.BytesIO(b'---\\n')); t.close()\n"
        "tree = g.unpack_revision(b.getvalue(), pathlib.Path(sys.argv[2]), 'a' * 40)\n"
        "inv = g.inventory(g.Facts(node_type=a.node_type, instance_type='p5.48xlarge', queue=a.queue))\n"
        "print(tree.name, sorted(inv['all']['children']))\n"
        # Refused there too: a name out of the tree, a link out of it.
        "for kind, name, link in ((tarfile.REGTYPE, '../../escape', ''), (tarfile.SYMTYPE, 'up', '/etc')):\n"
        "    b = io.BytesIO(); t = tarfile.open(fileobj=b, mode='w:gz'); i = tarfile.TarInfo(name)\n"
        "    i.type, i.linkname = kind, link; t.addfile(i, io.BytesIO(b'')); t.close()\n"
        "    try: g.unpack_revision(b.getvalue(), pathlib.Path(sys.argv[2]), 'b' * 40)\n"
        "    except (g.NodeError, tarfile.TarError) as exc: print('refused', type(exc).__name__)\n"
    )
    run = subprocess.run(
        [str(found[0]), "-c", code, str(ROLE / "files"), str(tmp_path)],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.split(" ", 1)[0] == "a" * 40
    assert "'queue_gpu'" in run.stdout
    assert run.stdout.count("refused") == 2, run.stdout
    assert not (tmp_path / "revisions" / ("b" * 40)).exists()
    assert not (tmp_path.parent / "escape").exists()


# The configure phase under the node runtime's ansible-core 2.17 (the lab test runs it whole).


def test_a_filter_in_a_skipped_loop_raises_an_undefined_error_ansible_defers() -> None:
    """ansible-core templates a task's loop before its `when`; 2.17 defers only an undefined-variable
    error to after the `when`. The slurm role's services loop (units_to_start over a skipped
    `systemctl show`) on a ParallelCluster node must therefore raise that, not a filter error, or
    gpuforge-node fails where the SSH path (2.19) skips."""
    import importlib.util

    from ansible.errors import AnsibleFilterError, AnsibleUndefinedVariable  # type: ignore[import-untyped]
    from jinja2 import Undefined

    spec = importlib.util.spec_from_file_location("systemd_units", REPO / "plugins/filter/systemd_units.py")
    assert spec and spec.loader
    units = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(units)
    with pytest.raises(AnsibleUndefinedVariable, match="systemctl show result is undefined"):
        units.units_to_start(Undefined(name="stdout"))
    with pytest.raises(AnsibleFilterError, match="a string"):
        units.units_to_start(["not", "a", "string"])


def test_json_rendered_by_the_configure_phase_stays_text_under_ansible_core_2_17() -> None:
    """ansible-core 2.17 turns a rendered value that reads as a Python literal (JSON without true, false
    or null) into a dict, and gpuforge_common's managed files then refuse it ("a file needs its content as
    a string": the health role's fallback health.json, found by the lab test); 2.19 keeps text. Every JSON
    template the configure phase's roles render into a value is piped through `string`."""
    roles = ("nccl_tuning", "slurm", "health", "gpuforge_common")
    expression = re.compile(r"\{\{\s*lookup\('ansible\.builtin\.template',\s*'[^']+\.json\.j2'.*?\}\}", re.S)
    found = {
        f"{path.relative_to(REPO)}: {' '.join(m.group(0).split())}"
        for role in roles
        for path in (REPO / "roles" / role / "tasks").glob("*.yml")
        for m in expression.finditer(path.read_text())
        if path.name != "manifest.yml"  # install phase: the controller's 2.19 alone renders it
    }
    assert found, "no JSON template found: the pattern is stale"
    assert [f for f in sorted(found) if not re.search(r"\|\s*string\s*\}\}$", f)] == []


# The collection of the bake's revision (tasks/collection.yml), run against this host in a temporary root.


def _collection_play(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """A copy of the collection (galaxy.yml, README, this role) under tmp_path, a play running the role's
    collection.yml against localhost into tmp_path/root, and ansible-playbook's environment (a PATH
    without this venv: the controller's ansible-galaxy is found beside its Python)."""
    tree = tmp_path / "src"
    shutil.copytree(ROLE, tree / "roles/gpuforge_node")
    for name in ("galaxy.yml", "README.md"):
        shutil.copy(REPO / name, tree / name)
    (tmp_path / "collections/ansible_collections/gpuforge").mkdir(parents=True)
    (tmp_path / "collections/ansible_collections/gpuforge/gpu").symlink_to(tree)
    play = tmp_path / "play.yml"
    play.write_text(
        yaml.safe_dump(
            [
                {
                    "hosts": "localhost",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "ansible.builtin.import_role": {
                                "name": "gpuforge.gpu.gpuforge_node",
                                "tasks_from": "collection.yml",
                            },
                            "vars": {
                                "gpuforge_node_root": str(tmp_path / "root"),
                                "gpuforge_node_build_dir": str(tmp_path / "build"),
                            },
                        }
                    ],
                }
            ]
        )
    )
    (tmp_path / "ansible.cfg").write_text("[defaults]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(
        {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "ANSIBLE_CONFIG": str(tmp_path / "ansible.cfg"),
            "ANSIBLE_COLLECTIONS_PATH": str(tmp_path / "collections"),
            "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
        }
    )
    return tree, play, env


def _run_collection(play: Path, env: dict[str, str]) -> tuple[str, dict[str, int]]:
    run = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "localhost,", "-c", "local",
         "-e", f"ansible_python_interpreter={sys.executable}", str(play)],
        capture_output=True, text=True, env=env, check=False, timeout=300, cwd=play.parent,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    counts = re.search(r"localhost\s*:\s*ok=(\d+)\s+changed=(\d+)", run.stdout)
    assert counts
    current = (play.parent / "root/current").readlink().name
    return current, {"ok": int(counts[1]), "changed": int(counts[2])}


def test_a_run_leaves_other_runs_builds_alone_and_removes_its_own(tmp_path: Path) -> None:
    """Bakes side by side on one controller (Packer's parallel builds) share gpuforge_node_build_dir:
    a run must never delete another run's tarball before that run unpacked it (three twin bakes
    failed so: 'Could not find or access .../gpuforge-gpu-0.1.0.tar.gz'), and leaves nothing behind."""
    _, play, env = _collection_play(tmp_path)
    other = tmp_path / "build/run.other/gpuforge-gpu-0.1.0.tar.gz"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"another run's tarball")
    legacy = tmp_path / "build/gpuforge-gpu-0.1.0.tar.gz"  # where a run before this fix built
    legacy.write_bytes(b"another run's tarball")
    _run_collection(play, env)
    assert other.read_bytes() == legacy.read_bytes() == b"another run's tarball"
    left = sorted(p.name for p in (tmp_path / "build").iterdir())
    assert left == ["gpuforge-gpu-0.1.0.tar.gz", "run.other"]


def test_the_revision_names_what_a_node_runs_and_a_rerun_changes_nothing(tmp_path: Path) -> None:
    """The baked revision is unpacked once; a rerun of the same tree changes nothing; an edit to a
    Markdown file alone (CHANGELOG, a README: nothing a node runs) keeps the revision, so a golden image
    stays current across them; an edit to a role makes a new revision beside the old one."""
    tree, play, env = _collection_play(tmp_path)
    first, counts = _run_collection(play, env)
    assert re.fullmatch(r"c[0-9a-f]{16}", first) and counts["changed"] > 0
    unpacked = tmp_path / "root/revisions" / first / "ansible_collections/gpuforge/gpu"
    assert (unpacked / "roles/gpuforge_node/tasks/collection.yml").is_file()
    assert _run_collection(play, env) == (first, {"ok": counts["ok"] - 3, "changed": 0})
    (tree / "README.md").write_text("edited\n")
    assert _run_collection(play, env)[1]["changed"] == 0
    with (tree / "roles/gpuforge_node/defaults/main.yml").open("a") as defaults:
        defaults.write("# edited\n")
    second, counts = _run_collection(play, env)
    assert second != first and counts["changed"] > 0
    assert sorted(p.name for p in (tmp_path / "root/revisions").iterdir()) == sorted([first, second])


# scripts/pcluster/on_node_configured.sh


def _script(*args: str, entry: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "GPUFORGE_NODE": entry},
        timeout=30,
    )


def test_custom_action_runs_only_the_image_entry_point() -> None:
    """No git, pip, apt, package index or cfnconfig: only gpuforge-node from the image."""
    code = "\n".join(line for line in SCRIPT.read_text().splitlines() if not line.lstrip().startswith("#"))
    for word in ("git", "pip", "apt-get", "apt", "curl", "wget", "cfnconfig", "ansible-pull"):
        assert not re.search(rf"\b{re.escape(word)}\b", code), word


def test_custom_action_without_gpuforge_on_the_image_says_so(tmp_path: Path) -> None:
    out = _script("--node-type", "Compute", entry=str(tmp_path / "absent"))
    assert out.returncode == 3
    assert "was not baked with gpuforge (roles/gpuforge_node)" in out.stderr


def test_custom_action_passes_its_args_to_apply(tmp_path: Path) -> None:
    stub = tmp_path / "gpuforge-node"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\nexit 7\n')
    stub.chmod(0o755)
    out = _script("--node-type", "Compute", "--queue", "gpu", entry=str(stub))
    assert (out.returncode, out.stdout.split()) == (7, ["apply", "--node-type", "Compute", "--queue", "gpu"])


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_custom_action_is_shellcheck_clean() -> None:
    out = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout


# CustomActions from `cluster-config generate` and the examples.


def _spec(head_action: dict[str, Any], queue_action: dict[str, Any]) -> dict[str, Any]:
    return {
        "region": "us-east-1",
        "ami": "ami-0123456789abcdef0",
        "os": "ubuntu2204",
        "head_node": {
            "instance_type": "c5.2xlarge",
            "subnet_id": "subnet-0a1b2c3d4e5f60718",
            "ssh_key": "k",
            "on_node_configured": head_action,
        },
        "queues": [
            {
                "name": "gpu",
                "subnet_ids": ["subnet-0f1e2d3c4b5a69788"],
                "on_node_configured": queue_action,
                "compute_resources": [{"instance_type": "p5.48xlarge", "max_count": 2}],
            }
        ],
    }


def test_generate_gives_head_node_and_queue_their_part() -> None:
    script = "s3://scripts-bucket/on_node_configured.sh"
    revision = {"revision": COMMIT, "sha256": SHA, "bucket": "revs-bucket"}
    config = generate(
        _spec(
            {"script": script, "gpuforge_node": True},
            {"script": script, "gpuforge_node": revision, "args": ["-e", "x=1"]},
        )
    )
    head = config["HeadNode"]["CustomActions"]["OnNodeConfigured"]
    queue = config["Scheduling"]["SlurmQueues"][0]
    assert head == {"Script": script, "Args": ["--node-type", "HeadNode"]}
    assert queue["CustomActions"]["OnNodeConfigured"]["Args"] == [
        "--node-type", "Compute", "--queue", "gpu",
        "--revision", COMMIT, "--sha256", SHA, "--bucket", "revs-bucket",
        "--", "-e", "x=1",
    ]  # fmt: skip
    # The nodes read the revision's bucket with their own role.
    assert {a["BucketName"] for a in queue["Iam"]["S3Access"]} == {"scripts-bucket", "revs-bucket"}


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("gpuforge_node", {"revision": "main", "sha256": SHA, "bucket": "b-1"}, "not an exact git commit"),
        ("gpuforge_node", {"revision": COMMIT, "sha256": "x", "bucket": "b-1"}, "not a sha256"),
        ("gpuforge_node", {"revision": COMMIT, "bucket": "b-1"}, "missing"),
        ("gpuforge_node", "yes", "must be true or a mapping"),
    ],
)
def test_generate_refuses_a_bad_revision(field: str, value: Any, reason: str) -> None:
    action = {"script": "s3://b-1/a.sh", field: value}
    with pytest.raises(UserError, match=reason):
        generate(_spec(action, {"script": "s3://b-1/a.sh"}))


def test_generate_refuses_gpuforge_node_before_the_node_is_configured() -> None:
    spec = _spec({"script": "s3://b-1/a.sh"}, {"script": "s3://b-1/a.sh"})
    spec["queues"][0]["on_node_start"] = {"script": "s3://b-1/a.sh", "gpuforge_node": True}
    with pytest.raises(UserError, match="only on_node_configured and on_node_updated run gpuforge-node"):
        generate(spec)


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yml")), ids=lambda p: p.name)
def test_examples_configure_every_node_with_gpuforge_node(example: Path) -> None:
    config = generate(yaml.safe_load(example.read_text()))
    head = config["HeadNode"]["CustomActions"]["OnNodeConfigured"]
    assert head["Script"].endswith("/on_node_configured.sh") and head["Args"][:2] == [
        "--node-type",
        "HeadNode",
    ]
    for queue in config["Scheduling"]["SlurmQueues"]:
        args = queue["CustomActions"]["OnNodeConfigured"]["Args"]
        assert args[:4] == ["--node-type", "Compute", "--queue", queue["Name"]], queue["Name"]
