"""gpuforge-node: configure this node from its image, offline (docs/node-side.md).

Installed by roles/gpuforge_node: /usr/local/sbin/gpuforge-node runs this file with the image's
pinned Ansible runtime. `gpuforge-node apply` runs the configure phase (playbooks/fleet.yml, tag
configure) with `connection: local` on this node only, with the host variables and groups the
fleet inventory (plugins/inventory/ec2_fleet.py) would give it, logs to a file and the journal,
and exits 0, or non-zero with one line saying why.

It needs no network: the collection of the image's revision is on the image. A newer revision,
when the custom action names one (--revision with --sha256 and --bucket), comes from S3 only, as
the object published by `gpuforge node-revision publish`, checked against its sha256, with retries
and full jitter.

The node's part in the cluster comes from the custom action's arguments (ParallelCluster runs the
head node's and each queue's own CustomActions, and recommends telling the node types apart that
way rather than through the unsupported /etc/parallelcluster/cfnconfig:
https://docs.aws.amazon.com/parallelcluster/latest/ug/custom-bootstrap-actions-v3.html and
https://docs.aws.amazon.com/parallelcluster/latest/ug/moving-from-v2-to-v3.html), else from the
instance's ParallelCluster tags in IMDS where instance tags in metadata are enabled; the instance
type and region from IMDSv2.

Standard library only at import time (boto3 is imported for a fetch alone). It runs under the image's
python3 (the runtime's venv): 3.10 on Ubuntu 22.04, 3.11 on Debian 12, 3.12 on Ubuntu 24.04.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

PROG = "gpuforge-node"
# Exit codes: 0 converged; 1 the configure phase failed; 2 bad arguments or facts; 3 no revision.
EXIT_FAILED, EXIT_USAGE, EXIT_REVISION = 1, 2, 3
NODE_TYPES = ("HeadNode", "Compute")
# plugins/inventory/ec2_fleet.py's group of each node type.
NODE_GROUPS = {"HeadNode": "head_node", "Compute": "compute"}
# inventory/aws_ec2.yml's `gpu` group: instance types matching this (same pattern as the plugin).
GPU_TYPE = re.compile(r"^(p[3-6]|g[4-6])")
REVISION_RE = re.compile(r"^[0-9a-f]{40}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
# S3 bucket names: 3-63 lowercase letters, digits, dots and hyphens
# (https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html).
BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
DEFAULT_PREFIX = "gpuforge/revisions/"
# IMDS (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html):
# IMDSv2 takes a session token from PUT /latest/api/token (X-aws-ec2-metadata-token-ttl-seconds) and
# the token in X-aws-ec2-metadata-token on each GET. AWS_EC2_METADATA_SERVICE_ENDPOINT is the SDKs'
# setting for another endpoint (botocore reads the same name).
IMDS_DEFAULT = "http://169.254.169.254"
# Instance tags in metadata (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/work-with-tags-in-IMDS.html):
# /latest/meta-data/tags/instance/<key>, 404 unless the instance allows tags in its metadata.
TAG_FIELDS = {
    "parallelcluster:cluster-name": "cluster",
    "parallelcluster:node-type": "node_type",
    "parallelcluster:queue-name": "queue",
    "parallelcluster:compute-resource-name": "compute_resource",
    "gpuforge:lab": "lab",
}
# ParallelCluster 3.16.1 gives its launch templates MetadataOptions with HttpTokens only
# (pcluster/templates/queues_stack.py and cluster_stack.py, the LaunchTemplate's MetadataOptionsProperty),
# so InstanceMetadataTags keeps EC2's default, disabled: on a real cluster node the tags above are 404.
# The node's part therefore comes from the custom action's Args at boot, and is recorded here so a later
# run with no Args (the SSM document's `gpuforge-node apply`) knows it too.
RECORD = "node-facts.json"
RECORDED_FIELDS = ("node_type", "queue", "cluster")


class NodeError(Exception):
    """A reason to stop, with its exit code; the message is the one line the operator reads."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


# Arguments.


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Configure this node from its image, offline.")
    p.add_argument("--root", type=Path, default=Path("/opt/gpuforge/node"), help=argparse.SUPPRESS)
    p.add_argument("--log-dir", type=Path, default=Path("/var/log/gpuforge"), help=argparse.SUPPRESS)
    p.add_argument("--state-dir", type=Path, default=Path("/var/lib/gpuforge/node"), help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    apply = sub.add_parser("apply", help="run the configure phase on this node (connection local)")
    apply.add_argument("--node-type", choices=NODE_TYPES, help="this node's part (else its IMDS tag)")
    apply.add_argument("--queue", help="the compute node's Slurm queue (else its IMDS tag)")
    apply.add_argument("--cluster", help="the cluster's name (else its IMDS tag)")
    apply.add_argument("--instance-type", help="this node's instance type (else IMDS)")
    apply.add_argument("--revision", help="a newer gpuforge revision (git commit, 40 hex) to fetch from S3")
    apply.add_argument("--sha256", help="the sha256 of that revision's tarball")
    apply.add_argument("--bucket", help="the S3 bucket that holds the revision")
    apply.add_argument(
        "--prefix", default=DEFAULT_PREFIX, help=f"key prefix in the bucket ({DEFAULT_PREFIX})"
    )
    apply.add_argument("--region", help="the bucket's region (else this node's, from IMDS)")
    apply.add_argument("--attempts", type=int, default=5, help="tries of the S3 fetch (5)")
    apply.add_argument("--tags", default="configure", help="Ansible tags to run (configure)")
    apply.add_argument("--check", action="store_true", help="check mode: report, change nothing")
    apply.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more ansible-playbook arguments")
    sub.add_parser("revision", help="print the revision the image carries")
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The arguments, checked together; NodeError (exit 2) names what is wrong."""
    p = parser()
    try:
        args = p.parse_args(list(argv))
    except SystemExit as exc:
        raise NodeError("bad arguments (see gpuforge-node --help)", int(exc.code or 0) or EXIT_USAGE) from exc
    if args.command != "apply":
        return args
    if args.extra and args.extra[0] == "--":
        args.extra = args.extra[1:]
    fetch = [args.revision, args.sha256, args.bucket]
    if any(fetch) and not all(fetch):
        raise NodeError(
            "--revision, --sha256 and --bucket go together: name the revision, its sha256 and bucket"
        )
    if args.revision and not REVISION_RE.match(args.revision):
        raise NodeError(f"--revision {args.revision!r} is not an exact git commit (40 lowercase hex digits)")
    if args.sha256 and not SHA256_RE.match(args.sha256):
        raise NodeError("--sha256 must be 64 lowercase hex digits")
    if args.bucket and not BUCKET_RE.match(args.bucket):
        raise NodeError(f"--bucket {args.bucket!r} is not an S3 bucket name")
    if args.prefix and not args.prefix.endswith("/"):
        raise NodeError(f"--prefix {args.prefix!r} must end with /")
    if not 1 <= args.attempts <= 20:
        raise NodeError("--attempts must be between 1 and 20")
    if args.queue and args.node_type == "HeadNode":
        raise NodeError("--queue names a compute node's queue; the head node has none")
    return args


# Revisions and their tarballs (the same names `gpuforge node-revision publish` writes).


def object_key(prefix: str, revision: str) -> str:
    """The S3 key of a revision's tarball: named by the exact revision, nothing floating."""
    if not REVISION_RE.match(revision):
        raise NodeError(f"{revision!r} is not an exact git commit (40 lowercase hex digits)")
    return f"{prefix}gpuforge-{revision}.tar.gz"


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def backoff_delays(
    attempts: int, base: float = 1.0, cap: float = 20.0, rand: Callable[[], float] = random.random
) -> list[float]:
    """Seconds to wait before each retry: "full jitter", uniform in [0, min(cap, base * 2**n)), so a
    thousand nodes that fail together do not retry together
    (https://aws.amazon.com/blogs/architecture/exponential-backoff-and-jitter/)."""
    return [rand() * min(cap, base * 2**n) for n in range(attempts - 1)]


def retrying(
    action: Callable[[], bytes],
    attempts: int,
    log: Callable[[str], None],
    sleep: Callable[[float], None] = time.sleep,
    rand: Callable[[], float] = random.random,
) -> bytes:
    """action's result, trying up to `attempts` times with full-jitter waits; the last failure raised."""
    delays = backoff_delays(attempts, rand=rand)
    for n in range(attempts):
        try:
            return action()
        except NodeError as exc:
            if n == attempts - 1:
                raise NodeError(f"{exc} (after {attempts} attempts)", exc.code) from exc
            log(f"attempt {n + 1} of {attempts} failed: {exc}; retrying in {delays[n]:.1f} s")
            sleep(delays[n])
    raise AssertionError("unreachable")


def verified(data: bytes, sha256: str, what: str) -> bytes:
    got = sha256_of(data)
    if got != sha256:
        raise NodeError(f"{what} has sha256 {got}, not the {sha256} the custom action names", EXIT_REVISION)
    return data


def s3_getter(bucket: str, key: str, region: str | None) -> Callable[[], bytes]:
    """One GET of the object through boto3 (the S3 gateway endpoint is the region's ordinary S3
    endpoint, so no endpoint is set here; AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL move it)."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    # One try per call: retrying() counts and spaces the attempts.
    client = boto3.client(
        "s3", region_name=region, config=Config(retries={"max_attempts": 1, "mode": "standard"})
    )

    def get() -> bytes:
        try:
            body: bytes = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as exc:
            raise NodeError(
                f"s3://{bucket}/{key}: {exc.response.get('Error', {}).get('Code', exc)}", EXIT_REVISION
            ) from exc
        except BotoCoreError as exc:
            raise NodeError(f"s3://{bucket}/{key}: {exc}", EXIT_REVISION) from exc
        return body

    return get


def extract_safely(tar: tarfile.TarFile, target: Path) -> None:
    """Extract a revision's tarball into `target`, refusing what could reach outside it.

    Where tarfile has extraction filters (PEP 706: Python 3.12, and the 3.10.12 / 3.11.4 backports,
    https://peps.python.org/pep-0706/) its "data" filter does this. Debian 12's python3.11 is 3.11.2
    (no filters), so there the same rules are checked here first: no absolute or escaping name, no
    link pointing out of the tree, only files, directories and links; then a plain extraction."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(target, filter="data")
        return
    root = target.resolve()
    for member in tar.getmembers():
        where = (root / member.name).resolve()
        if member.name.startswith("/") or not where.is_relative_to(root):
            raise NodeError(f"the revision's tarball names {member.name!r}, outside its tree", EXIT_REVISION)
        if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
            raise NodeError(f"the revision's tarball holds a special file {member.name!r}", EXIT_REVISION)
        if member.issym() or member.islnk():
            base = where.parent if member.issym() else root
            if not (base / member.linkname).resolve().is_relative_to(root):
                raise NodeError(
                    f"the revision's tarball links {member.name!r} outside its tree", EXIT_REVISION
                )
        # No set-id bits or world-writable files from a tarball, as the data filter does.
        member.mode &= 0o755
    tar.extractall(target)  # noqa: S202 (every member was checked above)


def unpack_revision(data: bytes, root: Path, revision: str) -> Path:
    """Unpack a verified tarball beside the baked revision; the directory (complete once marked)."""
    tree = root / "revisions" / revision
    if (tree / ".gpuforge-revision").is_file():
        return tree
    partial = root / "revisions" / f".{revision}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    target = partial / "ansible_collections" / "gpuforge" / "gpu"
    target.mkdir(parents=True)
    archive = partial / "revision.tar.gz"
    archive.write_bytes(data)
    with tarfile.open(archive) as tar:
        extract_safely(tar, target)
    archive.unlink()
    (partial / ".gpuforge-revision").write_text(f"{revision}\n")
    shutil.rmtree(tree, ignore_errors=True)
    partial.rename(tree)
    return tree


def baked_revision(root: Path) -> str:
    current = root / "current"
    if not (current / ".gpuforge-revision").is_file():
        raise NodeError(
            f"{current} holds no gpuforge revision: this image was not baked with roles/gpuforge_node",
            EXIT_REVISION,
        )
    return (current / ".gpuforge-revision").read_text().strip()


def choose_tree(
    args: argparse.Namespace,
    facts: Facts,
    log: Callable[[str], None],
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[str, Path]:
    """The revision to run and its directory: the baked one, or the named one (on disk or from S3)."""
    root: Path = args.root
    if not args.revision:
        revision = baked_revision(root)
        return revision, root / "revisions" / revision
    tree = root / "revisions" / args.revision
    if (tree / ".gpuforge-revision").is_file():
        log(f"revision {args.revision} is already on this node")
        return args.revision, tree
    key = object_key(args.prefix, args.revision)
    log(f"fetching s3://{args.bucket}/{key}")
    get = s3_getter(args.bucket, key, args.region or facts.region)
    data = retrying(
        lambda: verified(get(), args.sha256, f"s3://{args.bucket}/{key}"), args.attempts, log, sleep=sleep
    )
    return args.revision, unpack_revision(data, root, args.revision)


# Facts: what the fleet inventory would say about this node.


@dataclass
class Facts:
    node_type: str = ""
    instance_type: str = ""
    region: str | None = None
    cluster: str | None = None
    queue: str | None = None
    compute_resource: str | None = None
    az: str | None = None
    lab: bool = False
    hostname: str = field(default_factory=lambda: os.uname().nodename)


class Imds:
    """IMDSv2 reads, each short; None where the endpoint is unreachable or the path is absent."""

    def __init__(self, endpoint: str | None = None, timeout: float = 2.0) -> None:
        self.endpoint = (
            endpoint or os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT") or IMDS_DEFAULT
        ).rstrip("/")
        self.timeout = timeout
        self._token: str | None = None
        self.reachable = True

    def _open(self, request: urllib.request.Request) -> str | None:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310
                return str(response.read().decode())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise NodeError(f"IMDS {request.full_url}: HTTP {exc.code}") from exc
        except (urllib.error.URLError, OSError):
            self.reachable = False
            return None

    def get(self, path: str) -> str | None:
        if not self.reachable:
            return None
        if self._token is None:
            put = urllib.request.Request(  # noqa: S310 (IMDS is plain http by design)
                f"{self.endpoint}/latest/api/token",
                method="PUT",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"},
            )
            self._token = self._open(put)
            if self._token is None:
                return None
        got = urllib.request.Request(  # noqa: S310 (IMDS is plain http by design)
            f"{self.endpoint}/latest/{path}", headers={"X-aws-ec2-metadata-token": self._token}
        )
        return self._open(got)


def recorded_facts(state: Path) -> dict[str, str]:
    """The node's part as an earlier run's custom action Args gave it ({} when none was recorded)."""
    try:
        data = json.loads((state / RECORD).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise NodeError(f"{state / RECORD} cannot be read ({exc}): remove it and pass --node-type") from exc
    if not isinstance(data, dict):
        raise NodeError(f"{state / RECORD} is not a JSON object: remove it and pass --node-type")
    return {k: str(v) for k, v in data.items() if k in RECORDED_FIELDS and isinstance(v, str) and v}


def record_facts(state: Path, facts: Facts) -> None:
    """Keep the node's part for later runs without Args; rewritten only when it changed."""
    values = {k: getattr(facts, k) for k in RECORDED_FIELDS}
    wanted = {k: v for k, v in values.items() if v}
    if recorded_facts(state) == wanted:
        return
    state.mkdir(parents=True, exist_ok=True)
    partial = state / f".{RECORD}.partial"
    partial.write_text(json.dumps(wanted, indent=1, sort_keys=True) + "\n")
    partial.rename(state / RECORD)


def gather(args: argparse.Namespace, imds: Imds, recorded: dict[str, str] | None = None) -> Facts:
    """This node's facts: the arguments first, then IMDS, then what an earlier run's Args recorded;
    NodeError where one the roles need is unknown."""
    facts = Facts()
    recorded = recorded or {}
    tags = {field_: imds.get(f"meta-data/tags/instance/{key}") for key, field_ in TAG_FIELDS.items()}
    facts.instance_type = args.instance_type or imds.get("meta-data/instance-type") or ""
    facts.region = imds.get("meta-data/placement/region")
    facts.az = imds.get("meta-data/placement/availability-zone")
    facts.node_type = args.node_type or tags["node_type"] or recorded.get("node_type") or ""
    facts.cluster = args.cluster or tags["cluster"] or recorded.get("cluster")
    facts.queue = (
        args.queue or tags["queue"] or (recorded.get("queue") if facts.node_type == "Compute" else None)
    )
    facts.compute_resource = tags["compute_resource"]
    facts.lab = tags["lab"] is not None
    if facts.node_type not in NODE_TYPES:
        raise NodeError(
            "this node's type is unknown: pass --node-type HeadNode or Compute in the custom action's Args "
            "(a run with them records it for later runs) or allow instance tags in metadata"
        )
    if not facts.instance_type:
        where = "IMDS gave none" if imds.reachable else f"IMDS ({imds.endpoint}) is unreachable"
        raise NodeError(f"this node's instance type is unknown ({where}): pass --instance-type")
    return facts


def inventory(facts: Facts, python: str = "/usr/bin/python3") -> dict[str, Any]:
    """A one-host inventory: localhost with plugins/inventory/ec2_fleet.py's host variables and groups."""
    host: dict[str, Any] = {
        "ansible_connection": "local",
        # The system Python, as on the SSH path: the apt module needs its python3-apt.
        "ansible_python_interpreter": python,
        "gpuforge_instance_type": facts.instance_type,
        "gpuforge_node_name": facts.hostname,
        "gpuforge_node_type": facts.node_type,
    }
    for name, value in (
        ("gpuforge_cluster_name", facts.cluster),
        ("gpuforge_queue", facts.queue),
        ("gpuforge_compute_resource", facts.compute_resource),
        ("aws_region", facts.region),
    ):
        if value:
            host[name] = value
    groups = ["aws_ec2", NODE_GROUPS[facts.node_type], f"node_type_{facts.node_type}"]
    groups += [f"instance_type_{facts.instance_type}"]
    keyed = (
        ("cluster", facts.cluster),
        ("queue", facts.queue),
        ("compute_resource", facts.compute_resource),
        ("az", facts.az),
    )
    groups += [f"{prefix}_{value}" for prefix, value in keyed if value]
    if GPU_TYPE.match(facts.instance_type):
        groups.append("gpu")
    if facts.lab:
        groups.append("gpuforge_lab")
    # Ansible group names: letters, digits and underscores (what the inventory plugins sanitize to).
    clean = [re.sub(r"[^A-Za-z0-9_]", "_", g) for g in groups]
    return {
        "all": {"hosts": {"localhost": host}, "children": {g: {"hosts": {"localhost": None}} for g in clean}}
    }


def playbook_command(args: argparse.Namespace, tree: Path, inventory_file: Path) -> list[str]:
    play = tree / "ansible_collections" / "gpuforge" / "gpu" / "playbooks" / "fleet.yml"
    command = [
        str(args.root / "venv" / "bin" / "ansible-playbook"),
        "-i",
        str(inventory_file),
        "--limit",
        "localhost",
    ]
    command += ["--tags", args.tags]
    if args.check:
        command.append("--check")
    return [*command, *args.extra, str(play)]


def playbook_env(tree: Path, state: Path) -> dict[str, str]:
    """Ansible's settings for a node-local run: the revision's collection, state under /var/lib."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(
        {
            "ANSIBLE_COLLECTIONS_PATH": str(tree),
            "ANSIBLE_HOME": str(state / "ansible"),
            "ANSIBLE_LOCAL_TEMP": str(state / "tmp"),
            "ANSIBLE_RETRY_FILES_ENABLED": "0",
            "ANSIBLE_FORCE_COLOR": "0",
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_GATHERING": "implicit",
            "ANSIBLE_DISPLAY_SKIPPED_HOSTS": "0",
            "ANSIBLE_CALLBACK_RESULT_FORMAT": "yaml",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


RECAP = re.compile(
    r"^localhost\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.MULTILINE
)


def summary(output: str) -> dict[str, int] | None:
    found = RECAP.findall(output)
    if not found:
        return None
    ok, changed, unreachable, failed = (int(n) for n in found[-1])
    return {"ok": ok, "changed": changed, "unreachable": unreachable, "failed": failed}


# Logging: the terminal, /var/log/gpuforge/node.log and the journal.


class Log:
    def __init__(self, log_dir: Path, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        log_dir.mkdir(parents=True, exist_ok=True)
        self.file = (log_dir / "node.log").open("a", encoding="utf-8")
        self.journal: subprocess.Popen[str] | None = None
        if shutil.which("systemd-cat") and Path("/run/systemd/journal/socket").exists():
            self.journal = subprocess.Popen(["systemd-cat", "-t", PROG], stdin=subprocess.PIPE, text=True)

    def line(self, text: str, *, to_stream: bool = True) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.file.write(f"{stamp} {text}\n")
        self.file.flush()
        if self.journal and self.journal.stdin:
            self.journal.stdin.write(f"{text}\n")
            self.journal.stdin.flush()
        if to_stream:
            print(text, file=self.stream, flush=True)

    def note(self, text: str) -> None:
        self.line(f"{PROG}: {text}")

    def close(self) -> None:
        self.file.close()
        if self.journal and self.journal.stdin:
            self.journal.stdin.close()
            self.journal.wait(timeout=10)


@dataclass
class Lock:
    path: Path

    def __enter__(self) -> Lock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(self._fd)
            raise NodeError(f"another gpuforge-node run holds {self.path}") from exc
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)


def run_playbook(command: list[str], env: dict[str, str], cwd: Path, log: Log) -> tuple[int, str]:
    lines: list[str] = []
    with subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            text = raw.rstrip("\n")
            lines.append(text)
            log.line(text, to_stream=False)
            print(text, flush=True)
    return proc.returncode, "\n".join(lines)


def apply(args: argparse.Namespace, log: Log) -> int:
    started = time.monotonic()
    state: Path = args.state_dir
    facts = gather(args, Imds(), recorded_facts(state))
    record_facts(state, facts)
    revision, tree = choose_tree(args, facts, log.note)
    (state / "tmp").mkdir(parents=True, exist_ok=True)
    inventory_file = state / "inventory.json"
    inventory_file.write_text(json.dumps(inventory(facts), indent=1, sort_keys=True) + "\n")
    where = "".join(f" {k} {v}" for k, v in (("queue", facts.queue), ("cluster", facts.cluster)) if v)
    log.note(f"revision {revision}: {facts.node_type} {facts.instance_type}{where}")
    command = playbook_command(args, tree, inventory_file)
    rc, output = run_playbook(command, playbook_env(tree, state), tree, log)
    stats = summary(output)
    took = time.monotonic() - started
    if rc != 0 or stats is None or stats["failed"] or stats["unreachable"]:
        raise NodeError(
            f"configure phase failed (ansible-playbook exit {rc}) after {took:.0f} s; "
            f"see {args.log_dir}/node.log",
            EXIT_FAILED,
        )
    log.note(f"ok: revision {revision}, changed={stats['changed']}, {took:.1f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except NodeError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.code
    if args.command == "revision":
        try:
            print(baked_revision(args.root))
        except NodeError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return exc.code
        return 0
    if os.geteuid() != 0:
        print(f"{PROG}: run as root (ParallelCluster runs custom actions as root)", file=sys.stderr)
        return EXIT_USAGE
    log = Log(args.log_dir)
    try:
        with Lock(Path("/run/gpuforge-node.lock")):
            return apply(args, log)
    except NodeError as exc:
        log.line(f"{PROG}: {exc}")
        return exc.code
    finally:
        log.close()


if __name__ == "__main__":
    sys.exit(main())
