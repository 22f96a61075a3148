"""`gpuforge fleet apply --via ssm` and `gpuforge fleet ssm-document install`, and the shipped document.

- The API side against moto (the test double for SSM and EC2): the document created with the shipped
  content, SendCommand's targets, rate controls and output location read back with ListCommands.
- The document's node-side script run here with stand-ins for hostname, scontrol, squeue and the entry
  point (a fake Slurm node in a JSON file): drain, wait for the jobs, apply, resume, and each failure.
- The Run Command stand-in's rate controls (tests/ssmdouble.py, a TEST DOUBLE), with a fake runner.
The same script on real Slurm lab hosts: tests/test_fleet_lab.py::test_ssm_apply_waits_for_the_running_job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from botocore.stub import Stubber

import ssmdouble
from gpuforge import cli as gpuforge_cli
from gpuforge import noderev
from gpuforge.commands import fleet as fleet_cli
from gpuforge.errors import UserError
from gpuforge.fleet import document, ssm
from gpuforge_lab.moto import MotoServer, free_port

REPO = Path(__file__).resolve().parents[1]
SHA = "ab" * 32
COMMIT = "0123456789abcdef0123456789abcdef01234567"
CID = "0c7f5f4e-1d0e-4d8e-9a53-0123456789ab"


def _doc() -> document.Document:
    return document.load()


# --- the shipped document ---------------------------------------------------------------------------------


def test_the_shipped_document_is_a_command_document_calling_the_node_entry_point() -> None:
    doc = _doc()
    assert doc.path == REPO / "ssm" / "gpuforge-apply.yml"
    (step,) = doc.content["mainSteps"]
    assert step["action"] == "aws:runShellScript"
    assert doc.parameters["EntryPoint"]["default"] == "/usr/local/sbin/gpuforge-node"
    assert {"Revision", "Sha256", "DrainTimeoutSeconds", "Reason"} <= set(doc.parameters)
    assert doc.parameters["Revision"]["default"] == doc.parameters["Sha256"]["default"] == ""


@pytest.mark.parametrize("bad", ["x' ; reboot; '", "a$(id)", "a\\b", 'a"b', "a`id`"])
def test_no_parameter_admits_a_quote_dollar_or_backslash(bad: str) -> None:
    """Systems Manager pastes values into the script as text: every rule must refuse shell syntax."""
    doc = _doc()
    for name, spec in doc.parameters.items():
        assert "allowedPattern" in spec or "allowedValues" in spec, name
        with pytest.raises(UserError):
            document.check_parameters(doc, {name: bad})


def test_rendering_replaces_every_placeholder_with_a_declared_parameter() -> None:
    script = document.render(
        _doc(), {"Reason": "test reason", "Revision": COMMIT, "Sha256": SHA, "RevisionBucket": "revs"}
    )
    assert "{{" not in script and "}}" not in script
    assert "REASON='test reason'" in script and f"SHA256='{SHA}'" in script
    assert "ENTRY='/usr/local/sbin/gpuforge-node'" in script


# --- the node-side script, with a fake Slurm node -----------------------------------------------------------

STUB = """#!{python}
import json, os, sys, time
path = os.environ["FAKE_STATE"]
state = json.load(open(path))
name = os.path.basename(sys.argv[0])
args = sys.argv[1:]
state["calls"].append(" ".join([name, *args]))
code = 0

def line(node):
    return " ".join(f"{{k}}={{v}}" for k, v in node.items())

if name == "hostname":
    flag = args[0] if args else "-s"
    print({{"-s": state["short"], "-f": state["short"] + ".ec2.internal", "-I": state["ip"] + " "}}[flag])
elif name == "scontrol" and args[:3] == ["-o", "show", "node"]:
    node = state["nodes"].get(args[3])
    if node is None:
        print(f"Node {{args[3]}} not found", file=sys.stderr)
        code = 1
    else:
        print(line(node))
elif name == "scontrol" and args[:3] == ["-o", "show", "nodes"]:
    for node in state["nodes"].values():
        print(line(node))
elif name == "scontrol" and args[:2] == ["show", "config"]:
    for key, value in state["config"].items():
        print(f"{{key:<24}}= {{value}}")
elif name == "scontrol" and args[:2] == ["show", "hostnames"]:
    for part in args[2].split(","):
        stem, _, span = part.partition("[")
        if span:
            low, high = span.rstrip("]").split("-")
            print("\\n".join(f"{{stem}}{{n}}" for n in range(int(low), int(high) + 1)))
        else:
            print(part)
elif name == "scontrol" and args[0] == "update" and args[1].startswith("SuspendExcNodes"):
    # Slurm 23.02+: += / -= edit slurmctld's list, not with the "nodes:count" form (scontrol(1));
    # Slurm 22.05's scontrol has no such update and fails.
    listed = state["config"]["SuspendExcNodes"]
    names = [] if listed == "(null)" else listed.split(",")
    if not state["runtime_suspend_exc"] or ":" in listed:
        print(f"Invalid input: {{args[1]}}", file=sys.stderr)
        code = 1
    elif args[1].startswith("SuspendExcNodes+="):
        names.append(args[1].split("=", 1)[1])
    else:
        names.remove(args[1].split("=", 1)[1])
    state["config"]["SuspendExcNodes"] = ",".join(names) or "(null)"
elif name == "scontrol" and args[0] == "update":
    fields = dict(a.split("=", 1) for a in args[1:])
    node = state["nodes"][fields["NodeName"]]
    node["State"] = "IDLE+DRAIN" if fields["State"] == "DRAIN" else "IDLE"
    node["Reason"] = fields.get("Reason", "none").replace(" ", "_")
elif name == "scontrol" and args[:2] == ["create", "reservation"]:
    fields = dict(a.split("=", 1) for a in args[2:])
    if fields["ReservationName"] in state["reservations"]:
        print("Error creating the reservation: Duplicate reservation name", file=sys.stderr)
        code = 1
    else:
        state["reservations"][fields["ReservationName"]] = fields
elif name == "scontrol" and args[0] == "delete":
    state["reservations"].pop(args[1].split("=", 1)[1])
elif name == "squeue":
    node = [a.split("=", 1)[1] for a in args if a.startswith("--nodelist=")][0]
    left = state["jobs"].get(node, 0)
    if left:
        print("4242")
        state["jobs"][node] = left - 1 if left > 0 else left
elif name == "entry":
    state["excluded_during_apply"] = state["config"]["SuspendExcNodes"]
    code = state["entry_rc"]
    if state.get("entry_then") == "killed":
        # Systems Manager stops the step (its timeout, a cancel): the agent kills the step's process group.
        json.dump(state, open(path, "w"))
        os.killpg(os.getpgid(0), 9)
    if state.get("entry_then") == "reconfigure":
        # `scontrol reconfigure` (ParallelCluster's update-cluster) while the change runs: slurmctld takes
        # SuspendExcNodes from slurm.conf again and the runtime addition is gone.
        state["config"]["SuspendExcNodes"] = state["config_suspend_exc"]
        json.dump(state, open(path, "w"))
        time.sleep(3)
        state = json.load(open(path))
        state["excluded_after_reconfigure"] = state["config"]["SuspendExcNodes"]
    print("TASK [configure] ok" if code == 0 else "gpuforge-node: error: nccl_tuning failed: disk full")
json.dump(state, open(path, "w"))
sys.exit(code)
"""


class FakeNode:
    """A fake Slurm world for the script: nodes, jobs left per node, the entry point's exit code."""

    def __init__(self, tmp: Path, *, short: str = "node1", ip: str = "10.0.0.5") -> None:
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.bin.mkdir()
        stub = self.bin / "stub"
        stub.write_text(STUB.format(python=sys.executable))
        stub.chmod(0o755)
        for name in ("hostname", "scontrol", "squeue", "entry"):
            (self.bin / name).symlink_to(stub)
        self.path = tmp / "state.json"
        self.marks = tmp / "marks"  # the node's /var/lib/gpuforge/fleet-apply
        self.state: dict[str, Any] = {
            "short": short,
            "ip": ip,
            "nodes": {},
            "jobs": {},
            "calls": [],
            "reservations": {},
            "entry_rc": 0,
            # Power saving off (no SuspendProgram), as in slurm.conf without it.
            "config": {"SuspendProgram": "(null)", "SuspendExcNodes": "(null)", "SuspendTime": "NONE"},
            "runtime_suspend_exc": True,
        }

    def add(self, name: str, *, addr: str, hostname: str | None = None, state: str = "IDLE") -> None:
        self.state["nodes"][name] = {
            "NodeName": name,
            "NodeAddr": addr,
            "NodeHostName": hostname or name,
            "State": state,
            "Reason": "none",
        }

    def run(self, **params: str) -> subprocess.CompletedProcess[str]:
        self.path.write_text(json.dumps(self.state))
        given = {"EntryPoint": str(self.bin / "entry"), "PollSeconds": "1", **params}
        script = self.tmp / "script.sh"
        script.write_text(document.render(_doc(), given))
        env = {
            **os.environ,
            "PATH": f"{self.bin}:{os.environ['PATH']}",
            "FAKE_STATE": str(self.path),
            "GPUFORGE_APPLY_STATE_DIR": str(self.marks),
        }
        # A process group of its own, as the agent gives a step (a "killed" entry kills that group).
        result = subprocess.run(
            ["sh", str(script)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
            start_new_session=True,
        )
        self.state = json.loads(self.path.read_text())
        return result

    def slurm_calls(self) -> list[str]:
        """scontrol updates, squeue polls and the entry point, in order (reads left out)."""
        keep = ("scontrol update", "scontrol create", "scontrol delete", "squeue", "entry")
        return [
            c.split(" --")[0] if c.startswith("squeue") else c
            for c in self.state["calls"]
            if c.startswith(keep)
        ]


def test_the_script_drains_waits_for_the_job_applies_and_resumes(tmp_path: Path) -> None:
    node = FakeNode(tmp_path)
    node.add("node1", addr="10.0.0.5")
    node.state["jobs"]["node1"] = 2
    run = node.run(Reason="tuning change")
    assert run.returncode == 0, run.stdout + run.stderr
    assert node.slurm_calls() == [
        "scontrol update NodeName=node1 State=DRAIN Reason=tuning change",
        "squeue",
        "squeue",
        "squeue",
        "entry apply",
        "scontrol update NodeName=node1 State=RESUME",
    ]
    assert node.state["nodes"]["node1"]["State"] == "IDLE"
    assert "waiting for jobs 4242 on node1" in run.stdout
    assert "applied and resumed node1" in run.stdout


def test_a_failed_apply_leaves_the_node_drained_with_the_reason(tmp_path: Path) -> None:
    node = FakeNode(tmp_path)
    node.add("node1", addr="10.0.0.5")
    node.state["entry_rc"] = 3
    run = node.run()
    assert run.returncode == 1
    assert not any("State=RESUME" in c for c in node.state["calls"])
    reason = node.state["nodes"]["node1"]["Reason"]
    assert node.state["nodes"]["node1"]["State"] == "IDLE+DRAIN"
    assert reason.startswith("gpuforge_fleet_apply_failed_(exit_3):") and "disk_full" in reason, reason
    assert "FAILED" in run.stdout and "stays drained" in run.stdout


def test_on_parallelcluster_the_node_is_found_by_its_address(tmp_path: Path) -> None:
    """The hostname (ip-10-0-0-5, EC2 hostnames kept) is no Slurm node; NodeAddr names the node."""
    node = FakeNode(tmp_path, short="ip-10-0-0-5", ip="10.0.0.5")
    node.add("queue1-st-p5-1", addr="10.0.0.4", hostname="ip-10-0-0-4")
    node.add("queue1-st-p5-2", addr="10.0.0.5", hostname="ip-10-0-0-5-other")
    run = node.run()
    assert run.returncode == 0, run.stdout + run.stderr
    updates = [c for c in node.state["calls"] if c.startswith("scontrol update")]
    assert updates == [
        "scontrol update NodeName=queue1-st-p5-2 State=DRAIN Reason=gpuforge fleet apply",
        "scontrol update NodeName=queue1-st-p5-2 State=RESUME",
    ]


def test_on_parallelcluster_a_maintenance_reservation_holds_the_node_never_a_drain(tmp_path: Path) -> None:
    """clustermgtd replaces an IDLE+DRAIN node (terminate_drain_nodes): the node is never drained while it
    is being changed; a reservation keeps new jobs off it and ends by itself after the step's timeout."""
    node = FakeNode(tmp_path, short="ip-10-0-0-5", ip="10.0.0.5")
    node.add("gpu-st-p5-1", addr="10.0.0.5", hostname="ip-10-0-0-5")
    node.state["jobs"]["gpu-st-p5-1"] = 1
    run = node.run(HoldWith="reservation", ExecutionTimeout="5400")
    assert run.returncode == 0, run.stdout + run.stderr
    create = (
        "scontrol create reservation ReservationName=gpuforge-apply-gpu-st-p5-1 Nodes=gpu-st-p5-1 "
        "StartTime=now Duration=95 Users=root Flags=MAINT,IGNORE_JOBS"
    )
    assert node.slurm_calls() == [
        create,
        "squeue",
        "squeue",
        "entry apply",
        "scontrol delete ReservationName=gpuforge-apply-gpu-st-p5-1",
    ]
    assert node.state["reservations"] == {} and node.state["nodes"]["gpu-st-p5-1"]["State"] == "IDLE"
    # A failed apply drains the node with the reason (ParallelCluster then replaces it) and ends the hold.
    node.state["entry_rc"] = 1
    failed = node.run(HoldWith="reservation")
    assert failed.returncode == 1
    assert node.state["nodes"]["gpu-st-p5-1"]["State"] == "IDLE+DRAIN" and node.state["reservations"] == {}
    # A reservation left by a stopped step: nothing is changed until it ends.
    node.state["entry_rc"] = 0
    node.state["nodes"]["gpu-st-p5-1"]["State"] = "IDLE"
    node.state["reservations"]["gpuforge-apply-gpu-st-p5-1"] = {}
    node.state["calls"] = []
    stale = node.run(HoldWith="reservation")
    assert stale.returncode == 1 and "could not hold gpu-st-p5-1 (reservation)" in stale.stdout
    assert not any(c.startswith("entry") for c in node.state["calls"])


def test_a_node_drained_by_someone_else_is_applied_but_never_resumed(tmp_path: Path) -> None:
    node = FakeNode(tmp_path)
    node.add("node1", addr="10.0.0.5", state="IDLE+DRAIN")
    node.state["nodes"]["node1"]["Reason"] = "gpuforge-health"
    run = node.run()
    assert run.returncode == 0, run.stdout + run.stderr
    assert not any(c.startswith("scontrol update") for c in node.state["calls"])
    assert node.state["nodes"]["node1"] == {**node.state["nodes"]["node1"], "State": "IDLE+DRAIN"}
    assert any(c.endswith("entry apply") for c in node.state["calls"])
    assert "stays out of service" in run.stdout


def test_jobs_that_outlast_the_drain_timeout_leave_the_node_unchanged_and_in_service(tmp_path: Path) -> None:
    node = FakeNode(tmp_path)
    node.add("node1", addr="10.0.0.5")
    node.state["jobs"]["node1"] = -1  # never ends
    run = node.run(DrainTimeoutSeconds="2")
    assert run.returncode == 1
    assert not any(c.endswith("entry apply") for c in node.state["calls"])
    assert node.state["nodes"]["node1"]["State"] == "IDLE"
    assert "still on node1 after 2s" in run.stdout


def test_no_entry_point_or_no_slurm_node_changes_nothing(tmp_path: Path) -> None:
    node = FakeNode(tmp_path)
    node.add("other", addr="10.9.9.9")
    run = node.run()
    assert run.returncode == 1 and "Slurm knows no node for node1" in run.stdout
    assert not any(c.startswith(("scontrol update", "entry")) for c in node.state["calls"])
    missing = node.run(EntryPoint="/nonexistent/gpuforge-node")
    assert missing.returncode == 1 and "no executable /nonexistent/gpuforge-node" in missing.stdout


def test_the_head_node_and_a_revision_run_the_entry_point_without_draining(tmp_path: Path) -> None:
    node = FakeNode(tmp_path)
    run = node.run(DrainNode="false", Revision=COMMIT, Sha256=SHA, RevisionBucket="gpuforge-revs")
    assert run.returncode == 0, run.stdout + run.stderr
    where = "--bucket gpuforge-revs --prefix gpuforge/revisions/"
    assert node.slurm_calls() == [f"entry apply --revision {COMMIT} --sha256 {SHA} {where}"]


def test_the_entry_point_accepts_the_arguments_the_document_passes(tmp_path: Path) -> None:
    """The real gpuforge-node parses what the document runs: a revision comes with its sha256 and bucket
    (without the bucket it exits 2 on every node, before anything is applied)."""
    node = FakeNode(tmp_path)
    assert node.run(DrainNode="false", Revision=COMMIT, Sha256=SHA, RevisionBucket="revs").returncode == 0
    assert node.run(DrainNode="false").returncode == 0
    entry_node = noderev.node_module()
    calls = [c.split()[1:] for c in node.slurm_calls() if c.startswith("entry ")]
    assert len(calls) == 2
    for argv in calls:
        args = entry_node.parse_args(argv)
        assert args.command == "apply"
    revision = entry_node.parse_args(calls[0])
    assert (revision.revision, revision.sha256, revision.bucket) == (COMMIT, SHA, "revs")


def test_a_revision_without_its_sha256_is_refused_on_the_node(tmp_path: Path) -> None:
    node = FakeNode(tmp_path)
    run = node.run(DrainNode="false", Revision=COMMIT)
    assert run.returncode == 1 and "needs its Sha256 and RevisionBucket" in run.stdout
    no_bucket = node.run(DrainNode="false", Revision=COMMIT, Sha256=SHA)
    assert no_bucket.returncode == 1 and "needs its Sha256 and RevisionBucket" in no_bucket.stdout
    assert node.slurm_calls() == []
    with pytest.raises(UserError, match="Revision="):
        document.check_parameters(_doc(), {"Revision": "0123abc"})


# --- the Run Command stand-in's rate controls (TEST DOUBLE) -------------------------------------------


class Recorder:
    def __init__(self, failing: set[str], delay: float = 0.05) -> None:
        self.failing, self.delay = failing, delay
        self.running = 0
        self.peak = 0
        self.lock = threading.Lock()
        self.order: list[str] = []

    def __call__(self, target: str) -> ssmdouble.Result:
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
            self.order.append(target)
        time.sleep(self.delay)
        with self.lock:
            self.running -= 1
        return ssmdouble.Result(target, "Failed" if target in self.failing else "Success")


@pytest.mark.parametrize(("value", "total", "errors", "expected"), [
    ("10%", 16, False, 2), ("10%", 5, False, 1), ("3", 16, False, 3), ("100%", 7, False, 7),
    ("0", 16, True, 0), ("10%", 50, True, 5), ("10%", 16, True, 1), ("2", 16, True, 2),
])  # fmt: skip
def test_rate_control_values_become_node_counts(value: str, total: int, errors: bool, expected: int) -> None:
    assert ssmdouble.limit(value, total, errors=errors) == expected


def test_the_double_never_runs_more_than_max_concurrency_and_ramps_up_from_one() -> None:
    targets = [f"n{i}" for i in range(12)]
    recorder = Recorder(set())
    outcome = ssmdouble.run(targets, recorder, "4", "0")
    assert outcome.status == "Success" and len(outcome.results) == 12
    assert recorder.peak == 4 and outcome.peak <= 4
    assert outcome.waves[:2] == [1, 2]


def test_the_double_stops_sending_once_errors_exceed_max_errors() -> None:
    targets = [f"n{i}" for i in range(10)]
    recorder = Recorder({"n0", "n1", "n2"})
    outcome = ssmdouble.run(targets, recorder, "1", "1")
    # One at a time: n0 fails (1 error, allowed), n1 fails (2 > 1): nothing after n1 is sent.
    assert recorder.order == ["n0", "n1"]
    assert outcome.not_sent == targets[2:] and outcome.errors == 2 and outcome.status == "Failed"
    zero = ssmdouble.run(targets, Recorder({"n0"}), "1", "0")
    assert [r.target for r in zero.results] == ["n0"] and len(zero.not_sent) == 9


def test_unreachable_nodes_are_not_errors() -> None:
    def execute(target: str, script: str) -> tuple[int, str]:
        return (255, "ssh: connect to host") if target == "ghost" else (0, "ok")

    runner = ssmdouble.document_runner(_doc(), {}, execute)
    outcome = ssmdouble.run(["ghost", "a", "b"], runner, "1", "0")
    assert [r.status for r in outcome.results] == ["Undeliverable", "Success", "Success"]
    assert outcome.errors == 0


# --- the API side against moto -----------------------------------------------------------------------


def _instances(env: dict[str, str]) -> dict[str, str]:
    """A head node and three compute nodes of cluster "train" (queues gpu and cpu), one node of "other"."""
    ec2 = boto3.client("ec2")
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    made: dict[str, str] = {}
    for label, cluster, node_type, queue in (
        ("head", "train", "HeadNode", None),
        ("gpu1", "train", "Compute", "gpu"),
        ("gpu2", "train", "Compute", "gpu"),
        ("cpu1", "train", "Compute", "cpu"),
        ("alien", "other", "Compute", "gpu"),
    ):
        tags = [
            {"Key": "parallelcluster:cluster-name", "Value": cluster},
            {"Key": "parallelcluster:node-type", "Value": node_type},
        ]
        if queue:
            tags.append({"Key": "parallelcluster:queue-name", "Value": queue})
        answer = ec2.run_instances(
            ImageId=ami,
            MinCount=1,
            MaxCount=1,
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
        )
        made[label] = answer["Instances"][0]["InstanceId"]
    return made


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = gpuforge_cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_install_creates_the_document_with_the_shipped_content_then_changes_nothing(
    aws: MotoServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _main(["fleet", "ssm-document", "install"], capsys)
    assert code == 0 and "created gpuforge-apply version 1" in out
    client = boto3.client("ssm")
    stored = client.get_document(Name="gpuforge-apply", DocumentFormat="YAML")
    assert yaml.safe_load(stored["Content"]) == _doc().content
    described = client.describe_document(Name="gpuforge-apply")["Document"]
    assert (described["DocumentType"], described["SchemaVersion"]) == ("Command", "2.2")
    again_code, again, _ = _main(["fleet", "ssm-document", "install"], capsys)
    assert again_code == 0 and "already has" in again
    assert client.describe_document(Name="gpuforge-apply")["Document"]["LatestVersion"] == "1"


def test_install_updates_a_changed_document_and_makes_it_the_default(aws: MotoServer, tmp_path: Path) -> None:
    client = boto3.client("ssm")
    old_path = tmp_path / "old.yml"
    old = yaml.safe_load((REPO / document.SHIPPED).read_text())
    old["description"] = "an older gpuforge's document"
    old_path.write_text(yaml.safe_dump(old))
    assert "created" in ssm.install(client, document.load(old_path), "gpuforge-apply")
    with pytest.raises(UserError, match="differs from this gpuforge's"):
        ssm.installed_version(client, _doc(), "gpuforge-apply")
    assert "updated gpuforge-apply to version 2" in ssm.install(client, _doc(), "gpuforge-apply")
    assert client.describe_document(Name="gpuforge-apply")["Document"]["DefaultVersion"] == "2"
    assert ssm.installed_version(client, _doc(), "gpuforge-apply") == "2"


def test_apply_sends_the_document_to_the_clusters_compute_nodes_with_rate_controls(
    aws: MotoServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    nodes = _instances(aws.env())
    assert _main(["fleet", "ssm-document", "install"], capsys)[0] == 0
    sent: list[dict[str, Any]] = []
    real_client = fleet_cli._client

    def recording_client(region: str | None) -> Any:
        client = real_client(region)
        client.meta.events.register(
            "provide-client-params.ssm.SendCommand", lambda params, **_: sent.append(dict(params))
        )
        return client

    monkeypatch.setattr(fleet_cli, "_client", recording_client)
    argv = ["fleet", "apply", "--via", "ssm", "--cluster-name", "train", "--queue", "gpu"]
    argv += ["--max-concurrency", "25%", "--max-errors", "2", "--output-s3-bucket", "fleet-logs"]
    argv += ["--revision", COMMIT, "--sha256", SHA, "--revision-bucket", "revs", "--drain-timeout", "1800"]
    code, out, err = _main(argv, capsys)
    assert code == 0, err
    command_id = json.loads(out)["CommandId"]
    (command,) = boto3.client("ssm").list_commands(CommandId=command_id)["Commands"]
    assert command["DocumentName"] == "gpuforge-apply"
    assert command["Targets"] == [
        {"Key": "tag:parallelcluster:cluster-name", "Values": ["train"]},
        {"Key": "tag:parallelcluster:node-type", "Values": ["Compute"]},
        {"Key": "tag:parallelcluster:queue-name", "Values": ["gpu"]},
    ]
    assert (command["MaxConcurrency"], command["MaxErrors"]) == ("25%", "2")
    assert command["OutputS3BucketName"] == "fleet-logs"
    assert command["OutputS3KeyPrefix"] == "gpuforge/fleet-apply/train"
    params = command["Parameters"]
    assert params["Revision"] == [COMMIT] and params["Sha256"] == [SHA]
    assert params["RevisionBucket"] == ["revs"] and params["RevisionPrefix"] == ["gpuforge/revisions/"]
    assert params["DrainNode"] == ["true"] and params["DrainTimeoutSeconds"] == ["1800"]
    assert params["HoldWith"] == ["reservation"]
    assert params["ExecutionTimeout"] == ["5400"]
    assert params["EntryPoint"] == ["/usr/local/sbin/gpuforge-node"]
    # moto resolves the tag targets as EC2 would: this cluster's gpu queue only.
    assert sorted(command["InstanceIds"]) == sorted([nodes["gpu1"], nodes["gpu2"]])
    # moto does not keep CloudWatchOutputConfig: read it from the request itself.
    (request,) = sent
    assert request["CloudWatchOutputConfig"] == {"CloudWatchOutputEnabled": False}
    assert request["DocumentVersion"] == "1"


def test_apply_to_the_head_node_does_not_drain(aws: MotoServer, capsys: pytest.CaptureFixture[str]) -> None:
    nodes = _instances(aws.env())
    assert _main(["fleet", "ssm-document", "install"], capsys)[0] == 0
    argv = ["fleet", "apply", "--via", "ssm", "--cluster-name", "train", "--node-type", "head"]
    argv += ["--cloudwatch-log-group", "/gpuforge/fleet"]
    code, out, err = _main(argv, capsys)
    assert code == 0, err
    (command,) = boto3.client("ssm").list_commands(CommandId=json.loads(out)["CommandId"])["Commands"]
    assert command["InstanceIds"] == [nodes["head"]]
    assert command["Parameters"]["DrainNode"] == ["false"]
    assert (command["MaxConcurrency"], command["MaxErrors"]) == ("10%", "1")
    assert command["OutputS3BucketName"] == ""


def test_apply_refuses_a_missing_document(aws: MotoServer, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _main(["fleet", "apply", "--via", "ssm", "--cluster-name", "train"], capsys)
    assert code == 2
    assert "SSM has no document gpuforge-apply; run `gpuforge fleet ssm-document install` first" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-concurrency", "0"], "is not a count or a percentage"),
        (["--max-concurrency", "150%"], "is not a count or a percentage (1-100%)\n"),
        (["--max-concurrency", "200%"], "'200%' is not a count or a percentage (1-100%)"),
        (["--max-errors", "101%"], "is not a count or a percentage (0-100%)\n"),
        (["--max-errors", "some"], "is not a count or a percentage"),
        (["--sha256", "XYZ"], "is not a sha256"),
        (["--revision", "0123abc"], "is not an exact git commit"),
        (["--revision", COMMIT, "--sha256", SHA], "--revision, --sha256 and --revision-bucket go together"),
        (["--queue", "gpu", "--node-type", "head"], "the head node belongs to no queue"),
        (["--reason", "it's broken"], "Reason="),
        (["--entry-point", "relative/path"], "EntryPoint="),
        (["--output-s3-key-prefix", "x"], "needs --output-s3-bucket"),
        (["--via", "ssh"], "invalid choice: 'ssh'"),
        (["--cluster-name", "bad\nname"], "is not a valid EC2 tag value"),
    ],
)
def test_bad_input_exits_2_with_a_message_and_no_aws_call(
    no_aws: list[str], capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    argv = ["fleet", "apply", "--via", "ssm", "--cluster-name", "train", *extra]
    try:
        code = gpuforge_cli.main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err


def test_an_unreachable_endpoint_is_one_clear_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    for argv in (
        ["fleet", "ssm-document", "install"],
        ["fleet", "apply", "--via", "ssm", "--cluster-name", "t"],
    ):
        run = subprocess.run(
            [sys.executable, "-m", "gpuforge.cli", *argv],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
            check=False,
        )
        assert run.returncode == 1, run.stderr
        assert "cannot reach Systems Manager" in run.stderr and env["AWS_ENDPOINT_URL"] in run.stderr
        assert "Traceback" not in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_follow_polls_until_the_command_ends_and_lists_each_node() -> None:
    client = boto3.client("ssm", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    sleeps: list[float] = []
    with Stubber(client) as stub:
        for status in ("Pending", "InProgress", "Failed"):
            counts = {"TargetCount": 3, "CompletedCount": 3, "ErrorCount": 1, "DeliveryTimedOutCount": 0}
            stub.add_response(
                "list_commands",
                {"Commands": [{"CommandId": CID, "Status": status, **counts}]},
                {"CommandId": CID},
            )
        invocations = [
            {"InstanceId": "i-1", "Status": "Success"},
            {"InstanceId": "i-2", "Status": "Failed", "StatusDetails": "Failed"},
        ]
        stub.add_response("list_command_invocations", {"CommandInvocations": invocations}, {"CommandId": CID})
        outcome = ssm.follow(client, CID, poll_s=7, sleep=sleeps.append)
    assert sleeps == [7, 7]
    assert outcome.status == "Failed" and outcome.counts["ErrorCount"] == 1
    assert [i["InstanceId"] for i in outcome.invocations] == ["i-1", "i-2"]


# --- power saving: the node stays up while it is changed ---------------------------------------------------
# Slurm 25.11 (ParallelCluster 3.16.1 ships 25.11.8), src/slurmctld/power_save.c: an IDLE node whose
# last_busy is older than SuspendTime is suspended unless it is in SuspendExcNodes or a SuspendExcStates
# state; a MAINT reservation or a DRAIN alone does not keep it up, and ParallelCluster's slurm.conf sets
# no SuspendExcStates. The fake scontrol above keeps SuspendExcNodes as slurmctld does for +=/-=.

PC_SUSPEND = "/opt/parallelcluster/scripts/slurm/slurm_suspend"


def power_saving(node: FakeNode, excluded: str = "(null)", runtime: bool = True) -> None:
    node.state["config"] = {
        "SuspendProgram": PC_SUSPEND,
        "SuspendExcNodes": excluded,
        "SuspendTime": "600 sec",
    }
    node.state["runtime_suspend_exc"] = runtime
    node.state["config_suspend_exc"] = excluded  # what slurm.conf says: a reconfigure's list


def test_with_power_saving_the_node_is_excluded_while_it_is_changed(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, short="ip-10-0-0-5", ip="10.0.0.5")
    node.add("gpu-dy-p5-1", addr="10.0.0.5", hostname="ip-10-0-0-5")
    power_saving(node)
    run = node.run(HoldWith="reservation", ExecutionTimeout="5400")
    assert run.returncode == 0, run.stdout + run.stderr
    assert node.slurm_calls() == [
        "scontrol update SuspendExcNodes+=gpu-dy-p5-1",
        "scontrol create reservation ReservationName=gpuforge-apply-gpu-dy-p5-1 Nodes=gpu-dy-p5-1 "
        "StartTime=now Duration=95 Users=root Flags=MAINT,IGNORE_JOBS",
        "squeue",
        "entry apply",
        "scontrol update SuspendExcNodes-=gpu-dy-p5-1",
        "scontrol delete ReservationName=gpuforge-apply-gpu-dy-p5-1",
    ]
    assert node.state["excluded_during_apply"] == "gpu-dy-p5-1"
    assert node.state["config"]["SuspendExcNodes"] == "(null)"
    # A failed apply ends the exclusion too: the drained node is replaced, not kept up forever.
    node.state["entry_rc"] = 1
    assert node.run(HoldWith="reservation").returncode == 1
    assert node.state["excluded_during_apply"] == "gpu-dy-p5-1"
    assert node.state["config"]["SuspendExcNodes"] == "(null)"


def test_a_node_the_configuration_excludes_stays_excluded(tmp_path: Path) -> None:
    node = FakeNode(tmp_path)
    node.add("gpu-st-p5-2", addr="10.0.0.5")
    node.state["short"] = "gpu-st-p5-2"
    power_saving(node, excluded="gpu-st-p5-[1-4]")
    run = node.run(HoldWith="reservation")
    assert run.returncode == 0, run.stdout + run.stderr
    assert not any("SuspendExcNodes" in c for c in node.slurm_calls())
    assert node.state["config"]["SuspendExcNodes"] == "gpu-st-p5-[1-4]"


@pytest.mark.parametrize(
    ("excluded", "runtime", "why"),
    [
        (
            "(null)",
            False,
            # scontrol's own message, then the likely cause.
            "scontrol update SuspendExcNodes+=node1 failed: Invalid input: SuspendExcNodes+=node1 "
            "(the += form needs Slurm 23.02 or newer)",
        ),
        (
            "gpu-dy-p5-[1-9]:2",
            True,
            "SuspendExcNodes=gpu-dy-p5-[1-9]:2 uses the nodes:count form, which scontrol cannot add to",
        ),
    ],
    ids=["slurm-22.05", "nodes-count-form"],
)
def test_without_a_way_to_exclude_the_node_nothing_is_changed(
    tmp_path: Path, excluded: str, runtime: bool, why: str
) -> None:
    node = FakeNode(tmp_path)
    node.add("node1", addr="10.0.0.5")
    power_saving(node, excluded=excluded, runtime=runtime)
    run = node.run(HoldWith="reservation")
    assert run.returncode == 1
    assert (
        f"FAILED: cannot keep node1 from power saving during the change ({why}): nothing was changed"
        in run.stdout
    ), run.stdout
    assert not any(c.startswith(("scontrol create", "entry")) for c in node.state["calls"])
    assert node.state["reservations"] == {} and node.state["config"]["SuspendExcNodes"] == excluded


def test_an_exclusion_left_by_a_stopped_step_is_taken_out_by_the_next_apply(tmp_path: Path) -> None:
    """A step Systems Manager stops mid-apply leaves its runtime += behind; the next apply on the node
    must not take it for the configuration's exclusion: it ends it."""
    node = FakeNode(tmp_path, short="ip-10-0-0-5", ip="10.0.0.5")
    node.add("gpu-dy-p5-1", addr="10.0.0.5", hostname="ip-10-0-0-5")
    power_saving(node)
    node.state["entry_then"] = "killed"
    killed = node.run(HoldWith="reservation")
    assert killed.returncode != 0
    assert node.state["config"]["SuspendExcNodes"] == "gpu-dy-p5-1"  # left behind
    node.state["entry_then"] = ""
    node.state["reservations"] = {}  # expired (its Duration), as the document's comment says
    again = node.run(HoldWith="reservation")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "from an earlier step that did not end" in again.stdout
    assert node.state["excluded_during_apply"] == "gpu-dy-p5-1"
    assert node.state["config"]["SuspendExcNodes"] == "(null)"
    assert not list(node.marks.iterdir())


def test_an_exclusion_a_reconfigure_drops_is_made_again_while_the_change_runs(tmp_path: Path) -> None:
    """scontrol reconfigure (ParallelCluster's update-cluster) resets SuspendExcNodes to slurm.conf's
    list; ReconfigFlags=KeepPowerSaveSettings, which ParallelCluster does not set, would keep it."""
    node = FakeNode(tmp_path, short="ip-10-0-0-5", ip="10.0.0.5")
    node.add("gpu-dy-p5-1", addr="10.0.0.5", hostname="ip-10-0-0-5")
    power_saving(node, excluded="gpu-st-p5-[1-2]")
    node.state["entry_then"] = "reconfigure"
    run = node.run(HoldWith="reservation", PollSeconds="1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "added again" in run.stdout
    assert node.state["excluded_after_reconfigure"] == "gpu-st-p5-[1-2],gpu-dy-p5-1"
    assert node.state["config"]["SuspendExcNodes"] == "gpu-st-p5-[1-2]"
