"""What `gpuforge roll` changes: a running ParallelCluster cluster's config moved to a new gpuforge
revision or image, judged by ParallelCluster's own update policies before anything happens.

ParallelCluster does the moving (docs/cluster-spec.md, "Rolling a change"). With a revision, the queues'
OnNodeConfigured gpuforge-node action gets `--revision --sha256 --bucket`; the head node's OnNodeConfigured
cannot change on a running cluster (aws-parallelcluster 3.16.1, pcluster/schemas/cluster_schema.py
HeadNodeCustomActionsSchema: OnNodeConfigured UpdatePolicy.UNSUPPORTED, OnNodeUpdated
UpdatePolicy.SUPPORTED), so the head node's OnNodeUpdated action takes it. With an image, the queues'
Image.CustomAmi (gpuforge.pcluster.rollout.patch, as `set-ami` does).

This module plans the change and publishes the revision; gpuforge.pcluster.backup keeps the config
written over, gpuforge.pcluster.update_cluster runs pcluster, and gpuforge.commands.roll takes the
options and prints.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuforge import aws, noderev
from gpuforge.errors import ExternalError, UserError
from gpuforge.pcluster import config as pcluster_config
from gpuforge.pcluster import rollout, update
from gpuforge.pcluster.validate import named_region, validate

LOG = logging.getLogger(__name__)

# What roll may write; COMPUTE_FLEET_STOP is left out on purpose: it needs the fleet stopped first.
STRATEGIES = ("DRAIN", "TERMINATE")
DEFAULT_STRATEGY = "DRAIN"
# gpuforge-node's options that name a revision (roles/gpuforge_node/files/gpuforge_node.py, apply).
_REVISION_OPTIONS = ("--revision", "--sha256", "--bucket", "--prefix")
# How `cluster-config generate` marks the action that runs gpuforge-node: its Args start with the
# node's part, --node-type (generate.py _node_side_args; docs/node-side.md).
_NODE_MARK = "--node-type"


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


@dataclass(frozen=True)
class Rolled:
    document: dict[str, Any]
    plan: update.Plan
    what: str  # for people: "revision C (sha256 S)" or "image AMI"
    publish: dict[str, str] | None  # the revision still to publish once the change is accepted


@dataclass(frozen=True)
class Request:
    """What to roll, and where: `gpuforge roll`'s options as typed values."""

    config: Path
    ami: str | None  # the image route, or
    revision: str | None  # the revision route
    repo: Path
    bucket: str | None = None
    prefix: str | None = None
    queues: Sequence[str] | None = None  # None: every queue
    head_node: bool = False
    strategy: str = DEFAULT_STRATEGY
    deployed_config: Path | None = None
    force: bool = False
    cluster_name: str | None = None
    apply: bool = False
    output: Path | None = None


@dataclass(frozen=True)
class Planned:
    """A roll ParallelCluster accepts, nothing published or written yet."""

    rolled: Rolled
    region: str | None


def check(request: Request) -> None:
    """The request's own contradictions, before any file is read."""
    if request.apply and not request.cluster_name:
        raise UserError("--apply needs --cluster-name")
    if request.ami is not None and (request.head_node or request.bucket or request.prefix):
        raise UserError("--bucket, --prefix and --head-node go with --revision")


def plan(request: Request) -> Planned:
    """The patched config and ParallelCluster's verdict on it; a UserError, with nothing published,
    written or run, when ParallelCluster would refuse the change."""
    check(request)
    document = pcluster_config.load_document(request.config)
    deployed = pcluster_config.load_config(request.deployed_config) if request.deployed_config else None
    if request.ami is not None:
        rolled = _roll_ami(request, request.ami, document, deployed)
    else:
        old = deployed if deployed is not None else pcluster_config.plain(document)
        rolled = _roll_revision(request, document, old)
    source = f"cluster config {request.config}"
    if deployed is not None:
        source += f" against the deployed {request.deployed_config}"
    refuse_unless_accepted(rolled.plan, source)
    return Planned(rolled, named_region(document))


def _roll_revision(request: Request, document: dict[str, Any], deployed: dict[str, Any]) -> Rolled:
    node = noderev.node_module()
    actions = targets(document, request.queues, request.head_node)
    bucket = request.bucket or current_bucket(actions)
    prefix = request.prefix or node.DEFAULT_PREFIX
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
    commit = noderev.resolve(request.repo, str(request.revision))
    digest = hashlib.sha256(noderev.archive(request.repo, commit)).hexdigest()
    revision_args = noderev.custom_action_args(node, commit, digest, bucket, prefix)
    patched = set_revision(document, request.queues, request.head_node, revision_args, request.strategy)
    new = pcluster_config.plain(patched)
    validate(new)
    verdict = update.plan(deployed, new)
    publish = {"revision": commit, "sha256": digest, "bucket": bucket, "prefix": prefix}
    return Rolled(patched, verdict, f"revision {commit} (sha256 {digest})", publish)


def _roll_ami(
    request: Request, ami: str, document: dict[str, Any], deployed: dict[str, Any] | None
) -> Rolled:
    change = rollout.ConfigChange(queues=request.queues, queue_update_strategy=request.strategy)
    # The config's own mistakes (a bad id, an unknown queue) first, before any AWS call.
    pcluster_config.set_custom_ami(document, ami, change.queues)
    facts = rollout.image_for(ami, named_region(document), request.force, "a gpuforge roll")
    result = rollout.patch(document, ami, facts, change, f"cluster config {request.config}")
    verdict = (
        result.plan if deployed is None else update.plan(deployed, pcluster_config.plain(result.document))
    )
    return Rolled(result.document, verdict, f"image {ami}", None)


def publish_revision(repo: Path, region: str | None, wanted: dict[str, str]) -> dict[str, Any]:
    """Upload the judged revision (noderev.publish); an ExternalError when its bytes are not the judged."""
    result = noderev.publish(
        aws.client("s3", region), repo, wanted["revision"], wanted["bucket"], wanted["prefix"]
    )
    if result["sha256"] != wanted["sha256"]:
        raise ExternalError(
            f"s3://{result['bucket']}/{result['key']} has sha256 {result['sha256']}, not the judged "
            f"{wanted['sha256']}: git archive gave other bytes; nothing written"
        )
    return result


def published_line(result: dict[str, Any]) -> str:
    state = "uploaded" if result["uploaded"] else "already there"
    return f"revision {result['revision']}: s3://{result['bucket']}/{result['key']} ({state})"


def summary(rolled: Rolled, strategy: str) -> Iterator[str]:
    """What the roll does to the cluster, for people."""
    yield f"new nodes of the changed queues boot with {rolled.what}"
    yield f"nodes running now ({strategy}): {update.STRATEGY_EFFECTS[strategy]}"
    if any(c.path.startswith("HeadNode.") for c in rolled.plan.changes):
        yield "the head node runs its OnNodeUpdated action (the new revision) after the update"
    yield "how long a queue takes to turn over: docs/cluster-spec.md, 'Rolling a change'"
