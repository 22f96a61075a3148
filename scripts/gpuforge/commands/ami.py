"""`gpuforge bake | rebuild | publish | prune`: the golden AMI pipeline's commands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpuforge import aws, targets
from gpuforge.ami import bake, canary, iam, images, pipeline, promote, prune, publish, references
from gpuforge.cliargs import existing_file, nonempty, positive_int
from gpuforge.commands.base import Command
from gpuforge.commands.options import add_config_change, config_change
from gpuforge.errors import UserError
from gpuforge.pcluster.rollout import ConfigChange

LOCAL_MOVED = (
    "--local: lab hosts are baked with `gpuforge-lab bake`, the lab of a gpuforge checkout "
    "(pip install -e ./lab); `gpuforge bake` bakes AMIs on AWS"
)
_DEFAULT_TARGETS_HELP = "; ".join(
    f"{flavor}: {','.join(names)}" for flavor, names in targets.DEFAULT_TARGETS.items()
)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--flavor", choices=images.FLAVORS, default="dlami", help="base image flavor")
    parser.add_argument("--region", type=nonempty, help="AWS region (default: AWS_REGION or us-east-1)")


def _add_cluster_config(parser: argparse.ArgumentParser, help_text: str, must_exist: bool = True) -> None:
    # must_exist False: prune's --allow-missing goes on without a config that is gone
    # (pipeline.check_config_files).
    parser.add_argument(
        "--cluster-config",
        type=existing_file if must_exist else Path,
        action="append",
        default=[],
        metavar="PATH",
        help=help_text,
    )


def _add_publish(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--parameter",
        type=nonempty,
        help="SSM parameter to point at the image (default /gpuforge/ami/FLAVOR/OS/latest, OS from the "
        "image's tag: ubuntu2204 or ubuntu2404)",
    )
    _add_cluster_config(
        parser,
        "ParallelCluster config to give the image (its Slurm queues' Image.CustomAmi), validate and check "
        "with pcluster's update policies; repeatable",
    )
    add_config_change(
        parser,
        queue_metavar="NAME",
        queue_help="give the image to this Slurm queue only (default: every queue); repeatable",
        strategy_help="Scheduling.SlurmSettings.QueueUpdateStrategy to write (default: the config's, else "
        "DRAIN: "
        "nodes are replaced as their jobs end)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="publish even an image that is not available, lacks gpuforge's or ParallelCluster's tags, "
        "or is of another flavor (each finding is logged as a warning)",
    )


def _volume_gib(text: str) -> int:
    """--root-volume-size: a whole number of GiB, 0 meaning the base AMI's root snapshot size."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 (the base AMI's root snapshot size) or more")
    return value


def _region_key(text: str) -> tuple[str, str]:
    """--copy-region-kms-key REGION=KEY."""
    region, sep, key = text.partition("=")
    if not sep or not region.strip() or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not REGION=KEY")
    return region.strip(), key.strip()


def add_host_bake_arguments(parser: argparse.ArgumentParser) -> None:
    """What every bake takes, of an EC2 builder here or of a running host (`gpuforge-lab bake`)."""
    _add_common(parser)
    parser.add_argument(
        "--target-instance-types",
        type=targets.parse,
        metavar="TYPE[,TYPE...]",
        help="instance types the image is for; they decide the hardware-specific installs "
        f"(default per flavor: {_DEFAULT_TARGETS_HELP})",
    )
    parser.add_argument(
        "--base-os",
        choices=images.BASE_OSES,
        default="ubuntu22.04",
        help="Ubuntu release of the base image (the Deep Learning Base OSS Nvidia Driver GPU AMI, "
        "or the ParallelCluster AMI for --flavor pcluster)",
    )
    parser.add_argument(
        "--pcluster-version", help="ParallelCluster release (default: the installed aws-parallelcluster)"
    )
    parser.add_argument(
        "--extra-vars",
        type=existing_file,
        metavar="FILE",
        help="YAML/JSON vars for ansible-playbook -e @FILE",
    )
    parser.add_argument(
        "--work-dir", type=Path, help="where bakes keep templates, logs, manifests (default build/ami)"
    )


def host_bake_options(args: argparse.Namespace) -> bake.BakeOptions:
    """The options add_host_bake_arguments parsed, for bake.bake_host."""
    return bake.BakeOptions(
        flavor=args.flavor,
        region=args.region,
        base_os=args.base_os,
        pcluster_version=args.pcluster_version,
        target_instance_types=args.target_instance_types,
        extra_vars_file=args.extra_vars,
        work_dir=args.work_dir,
    )


def _add_bake(parser: argparse.ArgumentParser) -> None:
    add_host_bake_arguments(parser)
    _add_publish(parser)
    parser.add_argument(
        "--instance-type",
        default="g5.2xlarge",
        help="builder instance type (only decides what the bake can check, never what it installs)",
    )
    parser.add_argument("--base-ami", help="bake on this AMI instead of resolving the newest base")
    parser.add_argument(
        "--base-parameter",
        help="SSM parameter naming the DLAMI base (default: the public Deep Learning Base OSS Nvidia Driver "
        "GPU AMI parameter of --base-os)",
    )
    parser.add_argument(
        "--base-owner", default=images.AMAZON_OWNER, help="owner of the ParallelCluster base AMI"
    )
    parser.add_argument("--subnet-id", default="", help="subnet for the builder (default VPC when empty)")
    parser.add_argument(
        "--iam-instance-profile",
        help="instance profile for the builder (default gpuforge-builder-REGION, which `gpuforge "
        "pipeline-role` creates and Session Manager access needs; '' for none)",
    )
    parser.add_argument(
        "--kms-key-id", default="", help="KMS key for the encrypted volumes (default: aws/ebs)"
    )
    parser.add_argument(
        "--root-volume-size",
        type=_volume_gib,
        default=0,
        metavar="GIB",
        help="root volume of the bake, and so every node's minimum root volume (default 0: the base AMI's "
        "root snapshot size; a smaller size than that is refused before launching)",
    )
    parser.add_argument(
        "--copy-region",
        type=nonempty,
        action="append",
        default=[],
        metavar="REGION",
        help="also copy the finished image to REGION, the copy and its snapshots tagged like the original "
        "at creation; repeatable",
    )
    parser.add_argument(
        "--copy-region-kms-key",
        type=_region_key,
        action="append",
        default=[],
        metavar="REGION=KEY",
        help="with --kms-key-id: the customer key (of REGION) for the copy in REGION; every --copy-region "
        "needs one; repeatable",
    )
    parser.add_argument("--no-publish", action="store_true", help="register the image but do not publish it")
    parser.add_argument(
        "--candidate",
        action="store_true",
        help="publish only to /gpuforge/ami/FLAVOR/OS/candidate (the default without --parameter and "
        "--cluster-config); latest moves through `gpuforge canary` and `gpuforge promote`",
    )


def _options(args: argparse.Namespace) -> bake.BakeOptions:
    return bake.BakeOptions(
        flavor=args.flavor,
        region=args.region,
        instance_type=args.instance_type,
        base_ami=args.base_ami,
        base_parameter=args.base_parameter,
        base_os=args.base_os,
        base_owner=args.base_owner,
        pcluster_version=args.pcluster_version,
        subnet_id=args.subnet_id,
        iam_instance_profile=args.iam_instance_profile,
        kms_key_id=args.kms_key_id,
        root_volume_size_gib=args.root_volume_size,
        extra_vars_file=args.extra_vars,
        work_dir=args.work_dir,
        target_instance_types=args.target_instance_types,
        ami_regions=tuple(args.copy_region),
        copy_region_kms_keys=dict(args.copy_region_kms_key),
    )


def _destination(args: argparse.Namespace) -> pipeline.Destination:
    """Where `_add_publish`'s options send a new image."""
    return pipeline.Destination(
        parameter=args.parameter,
        cluster_configs=tuple(args.cluster_config),
        change=config_change(args),
        force=args.force,
        candidate=args.candidate,
        no_publish=args.no_publish,
    )


def _print_patched(patched: list[publish.PatchedConfig]) -> None:
    """Per config, what `pcluster update-cluster` will do with the image."""
    for item in patched:
        print(f"{item.path}:", *item.plan.lines(), sep="\n", file=sys.stderr)


def _print_baked(baked: pipeline.Baked) -> int:
    _print_patched(baked.patched)
    if baked.candidate_parameter is not None:
        print(f"candidate: {baked.candidate_parameter}", file=sys.stderr)
    print(baked.image_id)
    return 0


class Bake(Command):
    name = "bake"
    help = "bake a golden AMI with Packer on AWS"

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        _add_bake(parser)
        parser.add_argument(
            "--local",
            action="store_true",
            help="moved: a lab host is baked with `gpuforge-lab bake`, a checkout's lab (this exits 2 saying "
            "so)",
        )

    def execute(self, args: argparse.Namespace) -> int:
        pipeline.check_config_files(args.cluster_config)
        if args.local:
            # The lab is a checkout's test double (lab/ in the repository), not part of this package.
            raise UserError(LOCAL_MOVED)
        return _print_baked(pipeline.bake_and_publish(_options(args), _destination(args)))


class Rebuild(Command):
    name = "rebuild"
    help = "bake a new AMI, with --if-stale only when the published one is out of date"

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        _add_bake(parser)
        parser.add_argument(
            "--if-stale",
            action="store_true",
            help="rebuild only if nothing is published for the flavor and OS, or the published image's base "
            "AMI, versions.yml hash or bake inputs hash (roles, playbooks, plugins, packer, data) differ",
        )

    def execute(self, args: argparse.Namespace) -> int:
        pipeline.check_config_files(args.cluster_config)
        options = _options(args)
        if args.if_stale:
            lines = pipeline.no_rebuild(options, args.parameter)
            if lines is not None:
                print(*lines, sep="\n")
                return 0
        return _print_baked(pipeline.bake_and_publish(options, _destination(args)))


class Publish(Command):
    name = "publish"
    help = "point the SSM parameter and cluster configs at an AMI"

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        _add_common(parser)
        _add_publish(parser)
        parser.add_argument("--ami", required=True, help="AMI id to publish")

    def execute(self, args: argparse.Namespace) -> int:
        pipeline.check_config_files(args.cluster_config)
        to = pipeline.Destination(
            parameter=args.parameter,
            cluster_configs=tuple(args.cluster_config),
            change=config_change(args),
            force=args.force,
        )
        _print_patched(pipeline.publish_to(args.ami, to, args.region, args.flavor))
        print(args.ami)
        return 0


class Prune(Command):
    name = "prune"
    help = "deregister old gpuforge AMIs and their snapshots"

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        _add_common(parser)
        parser.add_argument(
            "--keep", type=positive_int, default=3, help="how many of the newest images to keep"
        )
        parser.add_argument(
            "--parameter",
            type=nonempty,
            action="append",
            default=[],
            metavar="NAME",
            help="another SSM parameter whose AMI must stay, besides every parameter under "
            "--parameter-prefix "
            "and the flavor's /gpuforge/ami/FLAVOR/ubuntu2204/latest; repeatable",
        )
        parser.add_argument(
            "--parameter-prefix",
            default=references.PROJECT_PREFIX,
            metavar="PATH",
            help=f"every SSM parameter under this path protects its AMI (default "
            f"{references.PROJECT_PREFIX})",
        )
        _add_cluster_config(
            parser,
            "cluster config whose AMIs must stay, besides every ParallelCluster cluster found; repeatable",
            must_exist=False,
        )
        parser.add_argument(
            "--allow-missing",
            action="store_true",
            help="go on (with a warning) when a named parameter or a cluster's config does not exist",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="show what would be removed, remove nothing"
        )

    def execute(self, args: argparse.Namespace) -> int:
        pipeline.check_config_files(args.cluster_config, args.allow_missing)
        sources = references.Sources(
            parameters=[publish.default_parameter(args.flavor), *args.parameter],
            parameter_prefix=args.parameter_prefix,
            configs=args.cluster_config,
            allow_missing=args.allow_missing,
        )
        result = prune.plan(args.flavor, args.keep, sources, args.region)
        region = args.region or aws.region()
        for image in result.keep:
            print(f"keep     {image.id}  {image.name}  (one of the newest {args.keep})")
        for ami, why in sorted(result.protected.items()):
            print(f"protect  {ami}  (used by {why})")
        verb = "would delete" if args.dry_run else "delete"
        for image in result.delete:
            print(f"{verb:8} {image.id}  {image.name}  snapshots: {', '.join(image.snapshot_ids) or 'none'}")
        for copy_region, copy in result.delete_copies:
            snapshots = ", ".join(copy.snapshot_ids) or "none"
            print(f"{verb:8} {copy.id}  {copy.name}  (copy in {copy_region})  snapshots: {snapshots}")
        if not args.dry_run:
            prune.execute(result, region)
        return 0


class PipelineRole(Command):
    name = "pipeline-role"
    help = "print the pipeline's least-privilege IAM policy, or a CloudFormation template with its roles"

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--format", choices=("policy", "cloudformation"), default="cloudformation", help="what to print"
        )
        parser.add_argument(
            "--github-repository",
            metavar="OWNER/NAME",
            help="also create the role GitHub Actions of this repository assume through OIDC",
        )
        parser.add_argument(
            "--github-environment",
            default=iam.DEFAULT_ENVIRONMENT,
            help="the workflow environment the OIDC trust requires (default %(default)s)",
        )

    def execute(self, args: argparse.Namespace) -> int:
        if args.format == "policy":
            document = iam.policy_document()
        else:
            document = iam.cloudformation_template(args.github_repository, args.github_environment)
        print(json.dumps(document, indent=2))
        return 0


# --- promotion: canary, promote, rollback (gpuforge.ami.canary, gpuforge.ami.promote) ------------------


def _add_flavor_os(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument(
        "--os",
        choices=sorted(images.IMAGE_OSES.values()),
        default=images.DEFAULT_IMAGE_OS,
        help="the image's OS (its parameters live under /gpuforge/ami/FLAVOR/OS/)",
    )


class Canary(Command):
    name = "canary"
    help = (
        "boot an image on a target instance type, run its health, smoke and NCCL checks there, "
        "record the verdict on the image, and terminate what was launched"
    )

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        _add_flavor_os(parser)
        parser.add_argument("--ami", help="image to check (default: the candidate parameter's image)")
        parser.add_argument("--instance-type", required=True, help="one of the image's target instance types")
        parser.add_argument("--count", type=int, default=1, help="1, or 2 to add an nccl-tests all_reduce")
        parser.add_argument(
            "--subnet-id", type=nonempty, help="subnet to launch in (default: the default VPC)"
        )
        parser.add_argument(
            "--security-group-id",
            action="append",
            default=[],
            metavar="ID",
            help="security group (EFA needs one allowing all traffic within itself; default: the VPC's "
            "default)",
        )
        parser.add_argument("--placement-group", type=nonempty, help="cluster placement group to launch in")
        parser.add_argument(
            "--capacity-reservation-id",
            type=nonempty,
            help="On-Demand Capacity Reservation or Capacity Block id",
        )
        parser.add_argument(
            "--capacity-block",
            action="store_true",
            help="the reservation is a Capacity Block (launch with market type capacity-block)",
        )
        parser.add_argument(
            "--instance-profile",
            required=True,
            type=nonempty,
            help="instance profile for the nodes: SSM core permissions and s3:PutObject on the results "
            "prefix",
        )
        parser.add_argument(
            "--results-bucket", required=True, type=nonempty, help="S3 bucket SSM writes the nodes' output to"
        )
        parser.add_argument("--results-prefix", default="gpuforge-canary", type=nonempty, help="key prefix")
        parser.add_argument(
            "--boot-timeout",
            type=positive_int,
            default=1800,
            metavar="S",
            help="seconds to run and reach SSM",
        )
        parser.add_argument(
            "--command-timeout", type=positive_int, default=7200, metavar="S", help="seconds per node command"
        )
        parser.add_argument(
            "--baseline", type=existing_file, metavar="FILE", help="nccl baseline file (nccl-report)"
        )
        parser.add_argument("--out", type=Path, metavar="DIR", help="for canary.json and the NCCL report")

    def execute(self, args: argparse.Namespace) -> int:
        ami = args.ami
        if ami is None:
            ami = pipeline.candidate_image(args.flavor, args.os, args.region)
        request = canary.Request(
            ami=ami,
            instance_type=args.instance_type,
            count=args.count,
            results_bucket=args.results_bucket,
            instance_profile=args.instance_profile,
            subnet_id=args.subnet_id,
            security_group_ids=tuple(args.security_group_id),
            placement_group=args.placement_group,
            capacity_reservation_id=args.capacity_reservation_id,
            capacity_block=args.capacity_block,
            results_prefix=args.results_prefix,
            region=args.region,
            boot_timeout_s=args.boot_timeout,
            command_timeout_s=args.command_timeout,
            baseline_file=args.baseline,
            out_dir=args.out,
        )
        outcome = canary.run(request)
        verdict = canary.PASSED if outcome.passed else canary.FAILED
        print(f"{ami}: canary {verdict} on {args.count} x {args.instance_type} (run {outcome.run_id})")
        for reason in outcome.reasons:
            print(f"  {reason}", file=sys.stderr)
        return 0 if outcome.passed else 1


class Promote(Command):
    name = "promote"
    help = "point latest at an image whose canary passed (the old one stays at .../previous)"

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        _add_flavor_os(parser)
        parser.add_argument("--ami", help="image to promote (default: the candidate parameter's image)")
        _add_cluster_config(parser, "ParallelCluster config to give the promoted image; repeatable")
        parser.add_argument(
            "--force",
            action="store_true",
            help="promote an image without a recorded canary pass (warns loudly)",
        )

    def execute(self, args: argparse.Namespace) -> int:
        pipeline.check_config_files(args.cluster_config)
        move = promote.promote(
            args.flavor, args.os, args.ami, args.region, args.cluster_config, ConfigChange(), args.force
        )
        print(*move.lines(), sep="\n")
        return 0


class Rollback(Command):
    name = "rollback"
    help = "point latest back at the image .../previous names"

    def register_arguments(self, parser: argparse.ArgumentParser) -> None:
        _add_flavor_os(parser)
        _add_cluster_config(parser, "ParallelCluster config to give the restored image; repeatable")

    def execute(self, args: argparse.Namespace) -> int:
        pipeline.check_config_files(args.cluster_config)
        move = promote.rollback(args.flavor, args.os, args.region, args.cluster_config, ConfigChange())
        print(*move.lines(), sep="\n")
        return 0


COMMANDS = (Bake, Rebuild, Publish, Prune, PipelineRole, Canary, Promote, Rollback)
