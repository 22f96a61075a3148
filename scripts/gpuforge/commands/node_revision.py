"""`gpuforge node-revision publish`: a gpuforge revision as one S3 object a node can fetch offline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gpuforge import aws, noderev
from gpuforge.commands.base import Command, Group


class Publish(Command):
    name = "publish"
    help = "upload the tracked tree at a commit, named by commit, with its sha256"

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--bucket", required=True, help="the bucket the custom action reads")
        parser.add_argument("--revision", default="HEAD", help="git revision to publish (HEAD)")
        parser.add_argument("--prefix", help="key prefix (gpuforge/revisions/)")
        parser.add_argument("--repo", type=Path, default=Path.cwd(), help="the gpuforge checkout (.)")

    def execute(self, args: argparse.Namespace) -> int:
        prefix = noderev.revision_prefix(args.bucket, args.prefix)
        result = noderev.publish(aws.client("s3"), args.repo, args.revision, args.bucket, prefix)
        print(json.dumps(result, indent=2))
        return 0


class NodeRevision(Group):
    name = "node-revision"
    help = "gpuforge revisions that nodes fetch from S3 (docs/node-side.md)"
    dest = "verb"
    metavar = "VERB"
    commands = (Publish,)


COMMANDS = (NodeRevision,)
