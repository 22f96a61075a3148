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
import sys
from pathlib import Path

from gpuforge.cliargs import existing_file
from gpuforge.commands.base import Command
from gpuforge.pcluster import backup, roll, update_cluster
from gpuforge.pcluster import config as pcluster_config


class Roll(Command):
    name = "roll"
    help = (
        "move a running ParallelCluster cluster to a new gpuforge revision or image "
        "(QueueUpdateStrategy, checked with ParallelCluster's own update policies)"
    )
    description = __doc__
    formatter_class = argparse.RawDescriptionHelpFormatter

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--cluster-config", dest="config", required=True, type=existing_file, metavar="FILE"
        )
        what = parser.add_mutually_exclusive_group(required=True)
        what.add_argument("--ami", help="give the queues this image (Image.CustomAmi)")
        what.add_argument(
            "--revision", help="publish this git revision and give it to the queues' gpuforge-node"
        )
        parser.add_argument("--bucket", help="the revision's bucket (default: the one the actions name now)")
        parser.add_argument("--prefix", help="the revision's key prefix (gpuforge/revisions/)")
        parser.add_argument("--repo", type=Path, default=Path.cwd(), help="the gpuforge checkout (.)")
        parser.add_argument(
            "--queue", action="append", metavar="Q", help="roll this queue (repeatable; default: every queue)"
        )
        parser.add_argument(
            "--head-node",
            action="store_true",
            help="with --revision: the head node's OnNodeUpdated action too (its OnNodeConfigured cannot "
            "change)",
        )
        parser.add_argument(
            "--queue-update-strategy",
            choices=roll.STRATEGIES,
            default=roll.DEFAULT_STRATEGY,
            help="DRAIN (default): nodes are replaced as their jobs end; TERMINATE: jobs are killed and "
            "requeued",
        )
        parser.add_argument(
            "--deployed-config",
            type=existing_file,
            metavar="FILE",
            help="the config the cluster runs now, to judge against (default: FILE as it was before the "
            "roll)",
        )
        parser.add_argument(
            "--force", action="store_true", help="with --ami: as `cluster-config set-ami --force`"
        )
        parser.add_argument(
            "--cluster-name", metavar="NAME", help="the cluster, for the printed or run command"
        )
        parser.add_argument(
            "--apply", action="store_true", help="run pcluster update-cluster (needs --cluster-name)"
        )
        parser.add_argument(
            "--out",
            dest="output",
            type=Path,
            metavar="FILE",
            help="write here (default: FILE, after a backup)",
        )

    def execute(self, args: argparse.Namespace) -> int:
        request = roll.Request(
            config=args.config,
            ami=args.ami,
            revision=args.revision,
            repo=args.repo,
            bucket=args.bucket,
            prefix=args.prefix,
            queues=args.queue,
            head_node=args.head_node,
            strategy=args.queue_update_strategy,
            deployed_config=args.deployed_config,
            force=args.force,
            cluster_name=args.cluster_name,
            apply=args.apply,
            output=args.output,
        )
        planned = roll.plan(request)
        rolled = planned.rolled
        if rolled.publish is not None:
            print(roll.published_line(roll.publish_revision(request.repo, planned.region, rolled.publish)))
        written = _write(rolled.document, request.config, request.output)
        print(*rolled.plan.lines(), sep="\n")
        print(*roll.summary(rolled, request.strategy), sep="\n")
        argv = update_cluster.command(request.cluster_name, written, planned.region)
        print("run:" if not request.apply else "running:", " ".join(argv))
        if request.apply:
            sys.stdout.write(update_cluster.run(argv))
        return 0


def _write(document: dict[str, object], source: Path, out: Path | None) -> Path:
    """Write the patched config to out, or over source after a backup; the path written."""
    if out is None:
        print(f"backup of {source}: {backup.backup(source)}", file=sys.stderr)
        out = source
    pcluster_config.dump_document(document, out)
    print(f"wrote {out}", file=sys.stderr)
    return out


COMMANDS = (Roll,)
