"""`gpuforge cluster-config`: generate, validate and re-point ParallelCluster 3 cluster configs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gpuforge.amiid import check_ami_id
from gpuforge.cliargs import existing_file
from gpuforge.errors import UserError
from gpuforge.pcluster import rollout
from gpuforge.pcluster.config import (
    QUEUE_UPDATE_STRATEGIES,
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


def _emit(config: dict[str, Any], out: Path | None) -> None:
    if out is None:
        sys.stdout.write(to_yaml(config))
    else:
        dump_config(config, out)
        print(f"wrote {out}", file=sys.stderr)


def _generate(args: argparse.Namespace) -> int:
    spec = load_yaml_mapping(args.spec, "cluster spec")
    image = None
    if args.check_image:
        ami, region = spec.get("ami"), spec.get("region")
        image = image_facts(check_ami_id(str(ami)), region if isinstance(region, str) else None)
    _emit(generate(spec, image), args.output)
    return 0


def _validate(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    validate(config)
    if not args.check_images:
        print(f"{args.config}: valid against the aws-parallelcluster schema (offline; no AWS checks)")
        return 0
    facts = {ami: image_facts(ami, named_region(config)) for ami in sorted(custom_amis(config))}
    problems = image_errors(config, {ami: fact for ami, fact in facts.items() if fact is not None})
    if problems:
        raise UserError(f"{args.config}: its images do not suit it:\n  " + "\n  ".join(problems))
    print(f"{args.config}: valid against the aws-parallelcluster schema and its images' OS and root volumes")
    return 0


def _set_ami(args: argparse.Namespace) -> int:
    document = load_document(args.config)
    change = rollout.ConfigChange(
        queues=args.queue,
        cluster_wide=args.cluster_wide,
        queue_update_strategy=args.queue_update_strategy,
        fleet_stopped=args.fleet_stopped,
    )
    # The config's own mistakes (a bad id, an unknown queue) first, before any AWS call.
    set_custom_ami(document, args.ami, change.queues, cluster_wide=change.cluster_wide)
    # Imported here: the image check needs boto3, which the other actions do not.
    from gpuforge import fitness

    region = named_region(document)
    fitness.require(
        args.ami,
        region,
        flavor=None,
        for_pcluster=True,
        force=args.force,
        target=f"ParallelCluster config {args.config}",
    )
    facts = image_facts(args.ami, region, args.force)
    result = rollout.patch(document, args.ami, facts, change, f"cluster config {args.config}")
    if args.output is None:
        sys.stdout.write(document_text(result.document))
    else:
        dump_document(result.document, args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    print(*result.plan.lines(), sep="\n", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "cluster-config",
        help="ParallelCluster 3 cluster configs: generate from a spec, validate, set the AMI",
        description=__doc__,
    )
    sub = parser.add_subparsers(dest="cluster_config_command", required=True, metavar="ACTION")

    gen = sub.add_parser("generate", help="build a cluster config from a spec (docs/cluster-spec.md)")
    gen.add_argument("spec", type=existing_file, metavar="SPEC", help="cluster spec YAML")
    gen.add_argument("-o", "--output", type=Path, metavar="OUT", help="write here instead of stdout")
    gen.add_argument(
        "--check-image",
        action="store_true",
        help="read the spec's AMI from EC2: Image.Os from its parallelcluster:os tag, root volumes checked "
        "against its snapshot size",
    )
    gen.set_defaults(handler=_generate)

    val = sub.add_parser("validate", help="check a cluster config with aws-parallelcluster's schema, offline")
    val.add_argument("config", type=existing_file, metavar="CONFIG", help="cluster config YAML")
    val.add_argument(
        "--check-images",
        action="store_true",
        help="also read each AMI from EC2 and check its OS against Image.Os and its snapshot size against "
        "every RootVolume.Size that launches from it",
    )
    val.set_defaults(handler=_validate)

    ami = sub.add_parser(
        "set-ami", help="give a cluster config's Slurm queues an AMI; say what pcluster update-cluster does"
    )
    ami.add_argument("config", type=existing_file, metavar="CONFIG", help="cluster config YAML")
    ami.add_argument("--ami", required=True, help="AMI id (ami-...)")
    ami.add_argument(
        "--queue",
        action="append",
        metavar="Q",
        help="set SlurmQueues[Q].Image.CustomAmi (repeatable); default: every queue",
    )
    ami.add_argument(
        "--cluster-wide",
        action="store_true",
        help="set the cluster-wide Image.CustomAmi and Image.Os instead, for a cluster not created yet "
        "(pcluster update-cluster refuses that change on an existing cluster)",
    )
    ami.add_argument(
        "--queue-update-strategy",
        choices=QUEUE_UPDATE_STRATEGIES,
        help="Scheduling.SlurmSettings.QueueUpdateStrategy to write (default: the config's, else DRAIN)",
    )
    ami.add_argument(
        "--fleet-stopped",
        action="store_true",
        help="judge the update as pcluster does with the compute fleet stopped (default: running)",
    )
    ami.add_argument(
        "--force",
        action="store_true",
        help="set even an image that is not an available gpuforge pcluster-flavor image with "
        "ParallelCluster's tags (each finding is logged as a warning)",
    )
    ami.add_argument("-o", "--output", type=Path, metavar="OUT", help="write here instead of stdout")
    ami.set_defaults(handler=_set_ami)
