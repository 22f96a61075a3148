"""`gpuforge cluster-config`: generate, validate and re-point ParallelCluster 3 cluster configs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gpuforge.pcluster.config import (
    document_text,
    dump_config,
    dump_document,
    load_config,
    load_document,
    load_yaml_mapping,
    plain,
    set_custom_ami,
    to_yaml,
)
from gpuforge.pcluster.generate import generate
from gpuforge.pcluster.validate import validate


def _emit(config: dict[str, Any], out: Path | None) -> None:
    if out is None:
        sys.stdout.write(to_yaml(config))
    else:
        dump_config(config, out)
        print(f"wrote {out}", file=sys.stderr)


def _generate(args: argparse.Namespace) -> int:
    spec = load_yaml_mapping(args.spec, "cluster spec")
    _emit(generate(spec), args.output)
    return 0


def _validate(args: argparse.Namespace) -> int:
    validate(load_config(args.config))
    print(f"{args.config}: valid against the aws-parallelcluster schema (offline; no AWS checks)")
    return 0


def _set_ami(args: argparse.Namespace) -> int:
    document = load_document(args.config)
    patched = set_custom_ami(document, args.ami, args.queue)
    validate(plain(patched))
    # Imported here: the image check needs boto3 and the AMI pipeline, which the other actions do not.
    from gpuforge.ami import fitness

    region = patched.get("Region")
    fitness.require(
        args.ami,
        region if isinstance(region, str) else None,
        flavor=None,
        for_pcluster=True,
        force=args.force,
        target=f"ParallelCluster config {args.config}",
    )
    if args.output is None:
        sys.stdout.write(document_text(patched))
    else:
        dump_document(patched, args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "cluster-config",
        help="ParallelCluster 3 cluster configs: generate from a spec, validate, set the AMI",
        description=__doc__,
    )
    sub = parser.add_subparsers(dest="cluster_config_command", required=True, metavar="ACTION")

    gen = sub.add_parser("generate", help="build a cluster config from a spec (docs/cluster-spec.md)")
    gen.add_argument("spec", type=Path, metavar="SPEC", help="cluster spec YAML")
    gen.add_argument("-o", "--output", type=Path, metavar="OUT", help="write here instead of stdout")
    gen.set_defaults(handler=_generate)

    val = sub.add_parser("validate", help="check a cluster config with aws-parallelcluster's schema, offline")
    val.add_argument("config", type=Path, metavar="CONFIG", help="cluster config YAML")
    val.set_defaults(handler=_validate)

    ami = sub.add_parser("set-ami", help="point a cluster config (or some of its queues) at an AMI")
    ami.add_argument("config", type=Path, metavar="CONFIG", help="cluster config YAML")
    ami.add_argument("--ami", required=True, help="AMI id (ami-...)")
    ami.add_argument(
        "--queue",
        action="append",
        metavar="Q",
        help="set SlurmQueues[Q].Image.CustomAmi (repeatable); default: the cluster-wide Image.CustomAmi",
    )
    ami.add_argument(
        "--force",
        action="store_true",
        help="set even an image that is not an available gpuforge pcluster-flavor image with "
        "ParallelCluster's tags (each finding is logged as a warning)",
    )
    ami.add_argument("-o", "--output", type=Path, metavar="OUT", help="write here instead of stdout")
    ami.set_defaults(handler=_set_ami)
