"""`gpuforge cluster-config`: generate, validate and re-point ParallelCluster 3 cluster configs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpuforge.amiid import check_ami_id
from gpuforge.cliargs import existing_file
from gpuforge.commands.base import Command, Group
from gpuforge.commands.options import add_config_change, config_change
from gpuforge.errors import UserError
from gpuforge.pcluster import rollout
from gpuforge.pcluster.config import (
    custom_amis,
    document_text,
    dump_config,
    dump_document,
    load_config,
    load_document,
    load_yaml_mapping,
    set_custom_ami,
    to_yaml,
)
from gpuforge.pcluster.generate import generate
from gpuforge.pcluster.validate import image_errors, image_facts, named_region, validate


class Generate(Command):
    name = "generate"
    help = "build a cluster config from a spec (docs/cluster-spec.md)"

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("spec", type=existing_file, metavar="SPEC", help="cluster spec YAML")
        parser.add_argument("-o", "--output", type=Path, metavar="OUT", help="write here instead of stdout")
        parser.add_argument(
            "--check-image",
            action="store_true",
            help="read the spec's AMI from EC2: Image.Os from its parallelcluster:os tag, root volumes "
            "checked "
            "against its snapshot size",
        )

    def execute(self, args: argparse.Namespace) -> int:
        spec = load_yaml_mapping(args.spec, "cluster spec")
        image = None
        if args.check_image:
            ami, region = spec.get("ami"), spec.get("region")
            image = image_facts(check_ami_id(str(ami)), region if isinstance(region, str) else None)
        config = generate(spec, image)
        if args.output is None:
            sys.stdout.write(to_yaml(config))
        else:
            dump_config(config, args.output)
            print(f"wrote {args.output}", file=sys.stderr)
        return 0


class Validate(Command):
    name = "validate"
    help = "check a cluster config with aws-parallelcluster's schema, offline"

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("config", type=existing_file, metavar="CONFIG", help="cluster config YAML")
        parser.add_argument(
            "--check-images",
            action="store_true",
            help="also read each AMI from EC2 and check its OS against Image.Os and its snapshot size "
            "against "
            "every RootVolume.Size that launches from it",
        )

    def execute(self, args: argparse.Namespace) -> int:
        config = load_config(args.config)
        validate(config)
        if not args.check_images:
            print(f"{args.config}: valid against the aws-parallelcluster schema (offline; no AWS checks)")
            return 0
        facts = {ami: image_facts(ami, named_region(config)) for ami in sorted(custom_amis(config))}
        problems = image_errors(config, {ami: fact for ami, fact in facts.items() if fact is not None})
        if problems:
            raise UserError(f"{args.config}: its images do not suit it:\n  " + "\n  ".join(problems))
        print(
            f"{args.config}: valid against the aws-parallelcluster schema and its images' OS and root volumes"
        )
        return 0


class SetAmi(Command):
    name = "set-ami"
    help = "give a cluster config's Slurm queues an AMI; say what pcluster update-cluster does"

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("config", type=existing_file, metavar="CONFIG", help="cluster config YAML")
        parser.add_argument("--ami", required=True, help="AMI id (ami-...)")
        add_config_change(
            parser,
            queue_metavar="Q",
            queue_help="set SlurmQueues[Q].Image.CustomAmi (repeatable); default: every queue",
            strategy_help="Scheduling.SlurmSettings.QueueUpdateStrategy to write (default: the config's, "
            "else DRAIN)",
        )
        parser.add_argument(
            "--force",
            action="store_true",
            help="set even an image that is not an available gpuforge pcluster-flavor image with "
            "ParallelCluster's tags (each finding is logged as a warning)",
        )
        parser.add_argument("-o", "--output", type=Path, metavar="OUT", help="write here instead of stdout")

    def execute(self, args: argparse.Namespace) -> int:
        # A malformed id is the argument's own mistake: named before the file is read or judged.
        check_ami_id(args.ami)
        document = load_document(args.config)
        change = config_change(args)
        # The config's own mistakes (a bad id, an unknown queue) first, before any AWS call.
        set_custom_ami(document, args.ami, change.queues, cluster_wide=change.cluster_wide)
        target = f"ParallelCluster config {args.config}"
        facts = rollout.image_for(args.ami, named_region(document), args.force, target)
        result = rollout.patch(document, args.ami, facts, change, f"cluster config {args.config}")
        if args.output is None:
            sys.stdout.write(document_text(result.document))
        else:
            dump_document(result.document, args.output)
            print(f"wrote {args.output}", file=sys.stderr)
        print(*result.plan.lines(), sep="\n", file=sys.stderr)
        return 0


class ClusterConfig(Group):
    name = "cluster-config"
    help = "ParallelCluster 3 cluster configs: generate from a spec, validate, set the AMI"
    description = __doc__
    dest = "cluster_config_command"
    commands = (Generate, Validate, SetAmi)


COMMANDS = (ClusterConfig,)
