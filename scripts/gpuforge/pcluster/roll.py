"""`gpuforge roll`: move a running ParallelCluster cluster to a new gpuforge revision or image.

ParallelCluster does the moving (docs/cluster-spec.md, "Rolling a change"): the queues' new settings go
into the cluster config with a QueueUpdateStrategy, ParallelCluster's own ConfigPatch (gpuforge.pcluster.
update) judges the change as `pcluster update-cluster` will, and `pcluster update-cluster` applies it.

- `--revision REV`: the revision is published to S3 (gpuforge.noderev.publish) and the queues'
  OnNodeConfigured gpuforge-node action gets `--revision --sha256 --bucket`. The head node's
  OnNodeConfigured cannot change on a running cluster: aws-parallelcluster 3.16.1,
  pcluster/schemas/cluster_schema.py HeadNodeCustomActionsSchema gives it UpdatePolicy.UNSUPPORTED and
  OnNodeUpdated UpdatePolicy.SUPPORTED, so `--head-node` moves the head node's OnNodeUpdated action,
  which ParallelCluster runs on the head node after an update (custom-bootstrap-actions-v3).
- `--ami AMI`: the queues' Image.CustomAmi (gpuforge.pcluster.rollout.patch, as `set-ami` does).

Nothing is published, written or run when ParallelCluster would refuse the change.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuforge import aws, noderev
from gpuforge.cliargs import existing_file
from gpuforge.errors import ExternalError, UserError
from gpuforge.pcluster import config as pcluster_config
from gpuforge.pcluster import rollout, update
from gpuforge.pcluster.validate import AmiFacts, image_facts, named_region, validate

LOG = logging.getLogger(__name__)

# What roll may write; COMPUTE_FLEET_STOP is left out on purpose: it needs the fleet stopped first.
STRATEGIES = ("DRAIN", "TERMINATE")
DEFAULT_STRATEGY = "DRAIN"
# gpuforge-node's options that name a revision (roles/gpuforge_node/files/gpuforge_node.py, apply).
_REVISION_OPTIONS = ("--revision", "--sha256", "--bucket", "--prefix")
# How `cluster-config generate` marks the action that runs gpuforge-node: its Args start with the
# node's part, --node-type (generate.py _node_side_args; docs/node-side.md).
_NODE_MARK = "--node-type"
_PCLUSTER_TIMEOUT_S = 900


@dataclass(frozen=True)
class NodeAction:
    """One gpuforge-node custom action in a config: where it is and its Args (the document's own list)."""

    path: str
    args: list[Any]
    queue: str | None  # None: the head node


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _options(args: Sequence[Any]) -> list[str]:
    """gpuforge-node's own options: the Args before `--` (what follows goes to ansible-playbook)."""
    items = [str(a) for a in args]
    return items[: items.index("--")] if "--" in items else items


def _scripts(action: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """The scripts of a custom action: {Script, Args} or {Sequence: [{Script, Args}, ...]}."""
    # Both forms: https://docs.aws.amazon.com/parallelcluster/latest/ug/custom-bootstrap-actions-config-v3.html
    # (Sequence since 3.6.0); aws-parallelcluster 3.16.1 cluster_schema.py OneOrManyCustomActionField.
    action = _mapping(action)
    if "Sequence" in action:
        for i, item in enumerate(action["Sequence"] or []):
            if isinstance(item, dict):
                yield f".Sequence[{i}]", item
    elif action:
        yield "", action


def node_actions(holder: dict[str, Any], key: str, where: str, queue: str | None) -> list[NodeAction]:
    """The gpuforge-node scripts of holder's CustomActions[key] (OnNodeConfigured or OnNodeUpdated)."""
    found = []
    for suffix, script in _scripts(_mapping(holder.get("CustomActions")).get(key)):
        args = script.get("Args")
        if isinstance(args, list) and _NODE_MARK in _options(args):
            found.append(NodeAction(f"{where}.CustomActions.{key}{suffix}", args, queue))
    return found


def with_revision(args: Sequence[Any], revision_args: Sequence[str]) -> list[str]:
    """args with the revision options replaced by revision_args; the node's part and `-- ...` kept."""
    items = [str(a) for a in args]
    end = items.index("--") if "--" in items else len(items)
    kept: list[str] = []
    skip = False
    for item in items[:end]:
        if skip:
            skip = False
        elif item in _REVISION_OPTIONS:
            skip = True
        elif not item.startswith(tuple(f"{o}=" for o in _REVISION_OPTIONS)):
            kept.append(item)
    return [*kept, *revision_args, *items[end:]]


def _queues(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    queues = _mapping(config.get("Scheduling")).get("SlurmQueues")
    return {str(q.get("Name")): q for q in queues or [] if isinstance(q, dict)}


def targets(config: dict[str, Any], queues: Sequence[str] | None, head_node: bool) -> list[NodeAction]:
    """The gpuforge-node actions a revision roll rewrites, or a UserError saying why one is missing."""
    by_name = _queues(config)
    if queues is not None:
        unknown = [q for q in queues if q not in by_name]
        if unknown:
            known = ", ".join(by_name) or "none"
            raise UserError(f"unknown queue(s) {', '.join(unknown)}; the config's Slurm queues are: {known}")
    found: list[NodeAction] = []
    for name in queues if queues is not None else list(by_name):
        actions = node_actions(by_name[name], "OnNodeConfigured", f"Scheduling.SlurmQueues[{name}]", name)
        if actions:
            found += actions
        elif queues is not None:
            raise UserError(
                f"queue {name}: its OnNodeConfigured does not run gpuforge-node (no {_NODE_MARK} in its "
                "Args); give it `gpuforge_node` in the cluster spec (docs/node-side.md)"
            )
    if head_node:
        actions = node_actions(_mapping(config.get("HeadNode")), "OnNodeUpdated", "HeadNode", None)
        if not actions:
            raise UserError(
                "--head-node: the head node has no OnNodeUpdated action running gpuforge-node. Its "
                "OnNodeConfigured cannot change on a running cluster (ParallelCluster's update policy "
                "UNSUPPORTED); add `on_node_updated: {script, gpuforge_node: true}` to the spec's head node"
            )
        found += actions
    if not found:
        raise UserError("no queue runs gpuforge-node at OnNodeConfigured: nothing takes a revision")
    return found


def current_bucket(actions: Sequence[NodeAction]) -> str:
    """The one bucket the actions already name (--bucket), or a UserError asking for --bucket."""
    buckets = set()
    for action in actions:
        options = _options(action.args)
        buckets |= {options[i + 1] for i in range(len(options) - 1) if options[i] == "--bucket"}
    if len(buckets) != 1:
        if not buckets:
            raise UserError(
                "give --bucket BUCKET: an S3 bucket the cluster's nodes can read, where roll uploads the "
                "revision; the queues' gpuforge-node actions name none (they run the revision in the image)"
            )
        raise UserError(
            f"give --bucket BUCKET: the queues' gpuforge-node actions name {', '.join(sorted(buckets))}, "
            "and roll picks one only when they all name the same"
        )
    return buckets.pop()


def bucket_errors(config: dict[str, Any], queues: Sequence[str], bucket: str) -> list[str]:
    """Queues whose instance role cannot be shown to read the bucket (Iam.S3Access lists it)."""
    errors = []
    by_name = _queues(config)
    for name in queues:
        iam = _mapping(by_name[name].get("Iam"))
        listed = {str(_mapping(e).get("BucketName")) for e in iam.get("S3Access") or []}
        if bucket in listed:
            continue
        if iam.get("AdditionalIamPolicies"):
            LOG.warning(
                "queue %s: Iam.S3Access does not list %s; its AdditionalIamPolicies must grant it",
                name,
                bucket,
            )
            continue
        errors.append(
            f"queue {name}: Iam.S3Access does not list bucket {bucket}, so its nodes cannot fetch it"
        )
    return errors


def set_revision(
    document: dict[str, Any],
    queues: Sequence[str] | None,
    head_node: bool,
    revision_args: Sequence[str],
    strategy: str,
) -> dict[str, Any]:
    """A copy of document whose gpuforge-node actions fetch the revision, with the queue strategy."""
    patched = copy.deepcopy(document)
    for action in targets(patched, queues, head_node):
        new = with_revision(action.args, revision_args)
        action.args.clear()
        action.args.extend(new)
    pcluster_config.set_queue_update_strategy(patched, strategy)
    return patched


def refuse_unless_accepted(plan: update.Plan, source: str) -> None:
    if not plan.accepted:
        raise UserError(f"{source}: nothing written, published or run.\n" + "\n".join(plan.lines()))


def update_command(cluster_name: str | None, config_path: Path, region: str | None) -> list[str]:
    """The `pcluster update-cluster` argv (pcluster 3.16.1 `pcluster update-cluster --help`)."""
    argv = ["pcluster", "update-cluster", "--cluster-name", cluster_name or "CLUSTER_NAME"]
    argv += ["--cluster-configuration", str(config_path)]
    if region:
        argv += ["--region", region]
    return argv


def _pcluster() -> str:
    """pcluster from PATH, else the one installed beside this Python (gpuforge's virtualenv)."""
    search = os.pathsep.join(filter(None, [os.environ.get("PATH"), str(Path(sys.executable).parent)]))
    found = shutil.which("pcluster", path=search)
    if found is None:
        raise UserError(
            "pcluster not found on PATH or in gpuforge's virtualenv: install aws-parallelcluster "
            "(requirements/constraints.txt pins 3.16.1), or run without --apply and use the printed command"
        )
    return found


def _pcluster_message(output: str) -> str:
    """pcluster's JSON answer reduced to its message (and validation errors), else the raw text."""
    try:
        data = json.loads(output)
    except ValueError:
        return output.strip() or "no output"
    if not isinstance(data, dict):
        return output.strip()
    parts = [str(data.get("message") or "")]
    for key in ("updateValidationErrors", "configurationValidationErrors"):
        parts += [str(e.get("message", e)) for e in data.get(key) or [] if isinstance(e, dict)]
    return "; ".join(p for p in parts if p) or output.strip()


def run_update(argv: Sequence[str]) -> str:
    """Run `pcluster update-cluster`; its stdout, or an ExternalError with pcluster's own message."""
    command = [_pcluster(), *argv[1:]]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_PCLUSTER_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise ExternalError(f"pcluster update-cluster gave no answer in {_PCLUSTER_TIMEOUT_S} s") from None
    except OSError as exc:
        raise ExternalError(f"cannot run {command[0]}: {exc.strerror}") from None
    if done.returncode != 0:
        message = _pcluster_message(done.stdout or done.stderr)
        raise ExternalError(f"pcluster update-cluster failed (exit {done.returncode}): {message}")
    return done.stdout


def _backup(path: Path) -> Path:
    """Copy path beside itself, named by the UTC time, never over an earlier backup."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    data = path.read_bytes()
    for n in range(100):
        backup = path.with_name(f"{path.name}.{stamp}{f'.{n}' if n else ''}.bak")
        try:
            with backup.open("xb") as handle:
                handle.write(data)
        except FileExistsError:
            continue
        return backup
    raise UserError(f"cannot name a backup of {path}: too many backups this second")


def write(document: dict[str, Any], source: Path, out: Path | None) -> Path:
    """Write the patched config to out, or over source after a backup; the path written."""
    if out is None:
        backup = _backup(source)
        print(f"backup of {source}: {backup}", file=sys.stderr)
        out = source
    pcluster_config.dump_document(document, out)
    print(f"wrote {out}", file=sys.stderr)
    return out


def _image_facts(ami: str, region: str | None, force: bool) -> AmiFacts | None:
    """The image checked as `cluster-config set-ami` checks it, and its OS and root volume size."""
    # Imported here: only the image route reads images from EC2.
    from gpuforge import fitness

    fitness.require(ami, region, flavor=None, for_pcluster=True, force=force, target="a gpuforge roll")
    return image_facts(ami, region, force)


@dataclass(frozen=True)
class Rolled:
    document: dict[str, Any]
    plan: update.Plan
    what: str  # for people: "revision C (sha256 S)" or "image AMI"
    publish: dict[str, str] | None  # the revision still to publish once the change is accepted


def _roll_revision(args: argparse.Namespace, document: dict[str, Any], deployed: dict[str, Any]) -> Rolled:
    node = noderev.node_module()
    actions = targets(document, args.queue, args.head_node)
    bucket = args.bucket or current_bucket(actions)
    prefix = args.prefix or node.DEFAULT_PREFIX
    if not node.BUCKET_RE.match(bucket):
        raise UserError(f"--bucket {bucket!r} is not an S3 bucket name")
    if not prefix.endswith("/"):
        raise UserError(f"--prefix {prefix!r} must end with /")
    queues = sorted({a.queue for a in actions if a.queue is not None})
    untouched = sorted(set(_queues(document)) - set(queues))
    if untouched:
        LOG.warning(
            "not rolled (not named, or no gpuforge-node at OnNodeConfigured): %s", ", ".join(untouched)
        )
    problems = bucket_errors(pcluster_config.plain(document), queues, bucket)
    if problems:
        raise UserError("the revision's bucket is not readable:\n  " + "\n  ".join(problems))
    # The archive of an exact commit is the same bytes each time (git archive), so its sha256 can be
    # judged before anything is uploaded; publish() checks the object against it.
    commit = noderev.resolve(args.repo, args.revision)
    digest = hashlib.sha256(noderev.archive(args.repo, commit)).hexdigest()
    revision_args = noderev.custom_action_args(node, commit, digest, bucket, prefix)
    patched = set_revision(document, args.queue, args.head_node, revision_args, args.queue_update_strategy)
    new = pcluster_config.plain(patched)
    validate(new)
    plan = update.plan(deployed, new)
    publish = {"revision": commit, "sha256": digest, "bucket": bucket, "prefix": prefix}
    return Rolled(patched, plan, f"revision {commit} (sha256 {digest})", publish)


def _roll_ami(args: argparse.Namespace, document: dict[str, Any], deployed: dict[str, Any] | None) -> Rolled:
    change = rollout.ConfigChange(queues=args.queue, queue_update_strategy=args.queue_update_strategy)
    # The config's own mistakes (a bad id, an unknown queue) first, before any AWS call.
    pcluster_config.set_custom_ami(document, args.ami, change.queues)
    facts = _image_facts(args.ami, named_region(document), args.force)
    result = rollout.patch(document, args.ami, facts, change, f"cluster config {args.config}")
    plan = result.plan if deployed is None else update.plan(deployed, pcluster_config.plain(result.document))
    return Rolled(result.document, plan, f"image {args.ami}", None)


def _publish(args: argparse.Namespace, region: str | None, wanted: dict[str, str]) -> None:
    result = noderev.publish(
        aws.client("s3", region), args.repo, wanted["revision"], wanted["bucket"], wanted["prefix"]
    )
    if result["sha256"] != wanted["sha256"]:
        raise ExternalError(
            f"s3://{result['bucket']}/{result['key']} has sha256 {result['sha256']}, not the judged "
            f"{wanted['sha256']}: git archive gave other bytes; nothing written"
        )
    state = "uploaded" if result["uploaded"] else "already there"
    print(f"revision {result['revision']}: s3://{result['bucket']}/{result['key']} ({state})")


def _summary(rolled: Rolled, strategy: str) -> Iterator[str]:
    yield f"new nodes of the changed queues boot with {rolled.what}"
    yield f"nodes running now ({strategy}): {update.STRATEGY_EFFECTS[strategy]}"
    if any(c.path.startswith("HeadNode.") for c in rolled.plan.changes):
        yield "the head node runs its OnNodeUpdated action (the new revision) after the update"
    yield "how long a queue takes to turn over: docs/cluster-spec.md, 'Rolling a change'"


def _roll(args: argparse.Namespace) -> int:
    if args.apply and not args.cluster_name:
        raise UserError("--apply needs --cluster-name")
    if args.ami is not None and (args.head_node or args.bucket or args.prefix):
        raise UserError("--bucket, --prefix and --head-node go with --revision")
    document = pcluster_config.load_document(args.config)
    deployed = pcluster_config.load_config(args.deployed_config) if args.deployed_config else None
    if args.ami is not None:
        rolled = _roll_ami(args, document, deployed)
    else:
        old = deployed if deployed is not None else pcluster_config.plain(document)
        rolled = _roll_revision(args, document, old)
    source = f"cluster config {args.config}"
    if deployed is not None:
        source += f" against the deployed {args.deployed_config}"
    refuse_unless_accepted(rolled.plan, source)
    region = named_region(document)
    if rolled.publish is not None:
        _publish(args, region, rolled.publish)
    written = write(rolled.document, args.config, args.output)
    print(*rolled.plan.lines(), sep="\n")
    print(*_summary(rolled, args.queue_update_strategy), sep="\n")
    argv = update_command(args.cluster_name, written, region)
    print("run:" if not args.apply else "running:", " ".join(argv))
    if args.apply:
        sys.stdout.write(run_update(argv))
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "roll",
        help="move a running ParallelCluster cluster to a new gpuforge revision or image "
        "(QueueUpdateStrategy, checked with ParallelCluster's own update policies)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cluster-config", dest="config", required=True, type=existing_file, metavar="FILE")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--ami", help="give the queues this image (Image.CustomAmi)")
    what.add_argument("--revision", help="publish this git revision and give it to the queues' gpuforge-node")
    parser.add_argument("--bucket", help="the revision's bucket (default: the one the actions name now)")
    parser.add_argument("--prefix", help="the revision's key prefix (gpuforge/revisions/)")
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="the gpuforge checkout (.)")
    parser.add_argument(
        "--queue", action="append", metavar="Q", help="roll this queue (repeatable; default: every queue)"
    )
    parser.add_argument(
        "--head-node",
        action="store_true",
        help="with --revision: the head node's OnNodeUpdated action too (its OnNodeConfigured cannot change)",
    )
    parser.add_argument(
        "--queue-update-strategy",
        choices=STRATEGIES,
        default=DEFAULT_STRATEGY,
        help="DRAIN (default): nodes are replaced as their jobs end; TERMINATE: jobs are killed and requeued",
    )
    parser.add_argument(
        "--deployed-config",
        type=existing_file,
        metavar="FILE",
        help="the config the cluster runs now, to judge against (default: FILE as it was before the roll)",
    )
    parser.add_argument(
        "--force", action="store_true", help="with --ami: as `cluster-config set-ami --force`"
    )
    parser.add_argument("--cluster-name", metavar="NAME", help="the cluster, for the printed or run command")
    parser.add_argument(
        "--apply", action="store_true", help="run pcluster update-cluster (needs --cluster-name)"
    )
    parser.add_argument(
        "--out", dest="output", type=Path, metavar="FILE", help="write here (default: FILE, after a backup)"
    )
    parser.set_defaults(handler=_roll)
