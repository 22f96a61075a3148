"""Bake a golden AMI (amazon-ebs) or a running host (null source over SSH) with the same Packer build.

A failed bake registers no image and moves no parameter: when Packer fails, or its result does not
check out (no manifest, missing tags, never available), every image tagged with this bake's
gpuforge:build-id is deregistered with its snapshots before the error is raised.

The builder instance is IMDSv2-only from the moment Packer reports it (BuilderImds), as is the image
(images.require_imdsv2): Packer 1.6 can set neither itself.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpuforge import aws, node_manifest, paths, targets, versions
from gpuforge.ami import iam, images, inputs
from gpuforge.ami import manifest as packer_manifest
from gpuforge.ami.packer import (
    MachineLine,
    Packer,
    Progress,
    launched_instance,
    require_for_aws,
    template_dir,
    write_var_file,
)
from gpuforge.errors import ExternalError, UserError

LOG = logging.getLogger(__name__)

AWS_SOURCE = "amazon-ebs.gpu"
# The template's null source: SSH to a host that already runs (packer/gpuforge.pkr.hcl source "null" "lab").
HOST_SOURCE = "null.lab"
# Value of the parallelcluster:os tag, which ParallelCluster compares with the cluster's Image.Os.
PCLUSTER_OSES = images.IMAGE_OSES
PCLUSTER_OS = PCLUSTER_OSES["ubuntu22.04"]
# 0 or these GiB: packer/variables.pkr.hcl's validation of root_volume_size_gib.
ROOT_VOLUME_GIB = (8, 16384)


def installed_pcluster_version() -> str:
    """The ParallelCluster release the images must match: the one this checkout creates clusters with."""
    try:
        return importlib.metadata.version("aws-parallelcluster")
    except importlib.metadata.PackageNotFoundError:
        raise UserError("aws-parallelcluster is not installed; pass --pcluster-version") from None


def git_revision(root: Path | None = None) -> str:
    """Short revision of the checkout, with -dirty when it has uncommitted changes."""
    root = root or paths.share_root()

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        rev = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{rev}-dirty" if dirty else rev


def flavor_tags(
    manifest: versions.Manifest, flavor: str, pcluster_version: str, base_os: str = "ubuntu22.04"
) -> dict[str, str]:
    """Tags gpuforge asks Packer to put on the image (the template adds provenance and the source AMI)."""
    tags = manifest.image_tags()
    # Every image says its OS, so 22.04 and 24.04 images of a flavor never stand in for each other.
    tags[images.OS_TAG] = images.IMAGE_OSES[base_os]
    if flavor == "pcluster":
        tags.update(
            {
                "parallelcluster:version": pcluster_version,
                "parallelcluster:build_status": "available",
                "parallelcluster:os": PCLUSTER_OSES[base_os],
            }
        )
    return tags


@dataclass
class BakeOptions:
    flavor: str = "dlami"
    region: str | None = None
    instance_type: str = "g5.2xlarge"
    base_ami: str | None = None
    # None: the public parameter of base_os's Deep Learning Base OSS Nvidia Driver GPU AMI.
    base_parameter: str | None = None
    base_os: str = "ubuntu22.04"
    base_owner: str = images.AMAZON_OWNER
    pcluster_version: str | None = None
    subnet_id: str = ""
    # None: the builder profile `gpuforge pipeline-role` creates (gpuforge-builder-<region>), which the
    # template's Session Manager access needs; "" launches the builder without one.
    iam_instance_profile: str | None = None
    kms_key_id: str = ""
    # 0: the base AMI's own root snapshot size (the template leaves volume_size unset), which keeps every
    # node's minimum root volume as small as the base allows.
    root_volume_size_gib: int = 0
    # Copy region -> the customer key of that region for its copy (a key belongs to one region): with
    # kms_key_id, every copy region needs one, else its copy would get that region's default EBS key.
    copy_region_kms_keys: dict[str, str] = field(default_factory=dict)
    extra_vars_file: Path | None = None
    work_dir: Path | None = None
    # The instance types the image is for (None: the flavor's default, targets.DEFAULT_TARGETS).
    # Hardware-dependent installs follow them, never the builder's instance_type.
    target_instance_types: tuple[str, ...] | None = None
    # Regions gpuforge copies the image to once Packer has registered it (copy_image): the copies carry
    # the same tags, on their snapshots too.
    ami_regions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.flavor not in images.FLAVORS:
            raise UserError(f"unknown flavor {self.flavor!r}; choose one of {', '.join(images.FLAVORS)}")
        if self.base_os not in images.BASE_OSES:
            raise UserError(f"unknown base OS {self.base_os!r}; choose one of {', '.join(images.BASE_OSES)}")
        if len(set(self.ami_regions)) != len(self.ami_regions) or self.the_region in self.ami_regions:
            raise UserError(
                f"--copy-region must name distinct regions other than the build region {self.the_region}"
            )
        # The template's own bounds (packer/variables.pkr.hcl, root_volume_size_gib's validation).
        if (
            self.root_volume_size_gib != 0
            and not ROOT_VOLUME_GIB[0] <= self.root_volume_size_gib <= ROOT_VOLUME_GIB[1]
        ):
            raise UserError(
                f"--root-volume-size {self.root_volume_size_gib}: use 0 (the base AMI's root snapshot size) "
                f"or {ROOT_VOLUME_GIB[0]} to {ROOT_VOLUME_GIB[1]} GiB"
            )
        stray = sorted(set(self.copy_region_kms_keys) - set(self.ami_regions))
        if stray:
            raise UserError(
                f"--copy-region-kms-key names {', '.join(stray)}, which is not a --copy-region of this bake"
            )
        missing = [r for r in self.ami_regions if not self.copy_region_kms_keys.get(r)]
        if self.kms_key_id and missing:
            raise UserError(
                f"the image is encrypted with the customer key {self.kms_key_id}, but no key is given "
                f"for the copy region(s) {', '.join(missing)}, where the copy would get that region's "
                "default EBS key: give --copy-region-kms-key REGION=KEY (a key of that region) "
                "for every --copy-region"
            )
        if self.extra_vars_file is not None and not self.extra_vars_file.is_file():
            raise UserError(f"extra vars file {self.extra_vars_file} does not exist")

    @property
    def the_region(self) -> str:
        return self.region or aws.region()

    @property
    def the_iam_instance_profile(self) -> str:
        if self.iam_instance_profile is None:
            return iam.builder_profile(self.the_region)
        return self.iam_instance_profile

    @property
    def the_pcluster_version(self) -> str:
        return self.pcluster_version or installed_pcluster_version()

    @property
    def the_target_names(self) -> tuple[str, ...]:
        return self.target_instance_types or targets.DEFAULT_TARGETS[self.flavor]

    def resolve_targets(self, manifest: versions.Manifest) -> targets.Targets:
        """The checked targets; refuses (UserError naming the type) before anything is launched."""
        return targets.resolve(self.the_target_names, manifest)


@dataclass(frozen=True)
class Run:
    """Where one bake keeps its staged templates, variables, log and manifest."""

    build_id: str
    directory: Path

    @classmethod
    def new(cls, work_dir: Path | None) -> Run:
        build_id = uuid.uuid4().hex[:12]
        base = work_dir or paths.build_dir() / "ami"
        directory = base / build_id
        directory.mkdir(parents=True, exist_ok=True)
        return cls(build_id, directory)

    @property
    def manifest(self) -> Path:
        return self.directory / "manifest.json"

    @property
    def node_manifest(self) -> Path:
        """Where Packer downloads the builder's /etc/gpuforge/manifest.json (what it really carries)."""
        return self.directory / "node-manifest.json"

    @property
    def log(self) -> Path:
        return self.directory / "packer.log"


def resolve_base(options: BakeOptions) -> images.Image:
    if options.base_ami:
        return images.describe(options.base_ami, options.the_region)
    return images.resolve_base(
        options.flavor,
        options.the_region,
        pcluster_version=options.the_pcluster_version,
        parameter=options.base_parameter or images.DLAMI_PARAMETERS[options.base_os],
        owner=options.base_owner,
        base_os=options.base_os,
    )


def image_root_volume_gib(options: BakeOptions, base: images.Image | None = None) -> int | None:
    """The root volume the image will have, and so every node's minimum RootVolume.Size: the size given,
    else the base image's root snapshot (None when EC2 does not say)."""
    if options.root_volume_size_gib:
        return options.root_volume_size_gib
    return (base or resolve_base(options)).root_volume_gib


def check_root_volume(options: BakeOptions, base: images.Image) -> None:
    """Refuse, before launching, a bake volume smaller than the base image's root snapshot: EC2 refuses it at
    RunInstances (EbsBlockDevice.VolumeSize "equal to or larger than the snapshot size", Amazon EC2 API
    Reference, https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_EbsBlockDevice.html)."""
    size, snapshot = options.root_volume_size_gib, base.root_volume_gib
    if size and snapshot is not None and size < snapshot:
        raise UserError(
            f"--root-volume-size {size} GiB is smaller than the root snapshot of the base image {base.id} "
            f"({snapshot} GiB), which EC2 refuses at launch: give at least {snapshot}, or 0 (the base's size)"
        )


def _tags(
    options: BakeOptions, manifest: versions.Manifest, image_targets: targets.Targets
) -> dict[str, str]:
    pcluster_version = options.the_pcluster_version if options.flavor == "pcluster" else ""
    tags = flavor_tags(manifest, options.flavor, pcluster_version, options.base_os)
    tags.update(image_targets.tags())
    # What the bake runs, hashed; `rebuild --if-stale` compares the published image's tag with it.
    tags[images.INPUTS_HASH_TAG] = inputs.digest()
    if options.ami_regions:
        # Where the copies are, so that prune retires them with the original (images.COPY_REGIONS_TAG).
        tags[images.COPY_REGIONS_TAG] = ",".join(options.ami_regions)
    return tags


def _common_variables(
    options: BakeOptions, run: Run, tags: dict[str, str], image_targets: targets.Targets
) -> dict[str, Any]:
    return {
        "target_instance_types": list(image_targets.names),
        "base_os": options.base_os,
        "repo_root": str(paths.share_root()),
        "flavor": options.flavor,
        "git_revision": git_revision(),
        "build_id": run.build_id,
        "image_tags": tags,
        "manifest_path": str(run.manifest),
        "node_manifest_path": str(run.node_manifest),
        # Absolute: ansible-playbook does not run from the caller's directory.
        "ansible_extra_vars_file": str(options.extra_vars_file.resolve()) if options.extra_vars_file else "",
    }


class BuilderImds:
    """Make the amazon-ebs builder instance IMDSv2-only as soon as Packer reports launching it.

    Packer 1.6 rejects `metadata_options` (and modern Packer cannot take it from the same template;
    docs/ami-pipeline.md), so the builder would boot with the account's IMDS defaults, often IMDSv1.
    Packer says which instance it launched before it waits for SSH; this watches for that line and
    calls ModifyInstanceMetadataOptions. If that fails it raises, which interrupts Packer (see
    Packer.build) before any provisioner runs. The template's first provisioner checks from inside
    the builder that IMDSv1 is refused, in case this wrapper ever misses the line.
    """

    def __init__(self, build: str, region: str) -> None:
        self.build = build
        self.region = region
        self.instance_id: str | None = None

    def __call__(self, line: MachineLine) -> None:
        instance_id = launched_instance(line, self.build)
        if instance_id is None or self.instance_id is not None:
            # Only the first report is the builder's: a later "Instance ID:" line is provisioner output.
            return
        images.require_instance_imdsv2(instance_id, self.region)
        self.instance_id = instance_id
        LOG.info("builder %s now requires IMDSv2 (HttpTokens=required)", instance_id)

    def check(self) -> None:
        """After a successful build: the builder must have been seen and secured."""
        if self.instance_id is None:
            raise ExternalError(
                f"packer never reported the instance {self.build} launched ('Instance ID: i-...'), so "
                "gpuforge could not require IMDSv2 on it; the image is discarded"
            )


def _run_packer(
    run: Run,
    variables: dict[str, Any],
    only: str,
    watch: Callable[[MachineLine], None] | None = None,
    packer: Packer | None = None,
) -> list[packer_manifest.Artifact]:
    """Run the build; watch (if given) sees every machine-readable line, and may raise to stop Packer."""
    # Packer's ansible provisioner runs the playbooks; Ansible is an extra of the wheel.
    bin_dir = str(Path(sys.executable).parent)
    path = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    if shutil.which("ansible-playbook", path=path) is None:
        raise UserError("a bake runs Ansible, which is not installed: pip install 'gpuforge[ansible]'")
    packer = packer or Packer.find()
    staged = packer.stage(template_dir(), run.directory)
    var_file = write_var_file(run.directory / "variables.json", variables)
    progress = Progress()

    def on_line(line: MachineLine) -> None:
        progress(line)
        if watch is not None:
            watch(line)

    # Packer looks up ansible-playbook on PATH (above); the one next to this Python is the pinned one.
    LOG.info("packer %s build %s (log %s)", ".".join(map(str, packer.version)), run.build_id, run.log)
    status = packer.build(staged, var_file, run.log, only=[only], on_line=on_line, env={"PATH": path})
    if status != 0:
        detail = "\n  ".join(progress.errors[-5:]) or "no error message"
        raise ExternalError(f"packer build failed with exit status {status}; see {run.log}:\n  {detail}")
    return packer_manifest.last_run(run.manifest)


def _discard(run: Run, region: str) -> None:
    """Retire whatever this bake left in region (images and snapshots tagged with its build id), so a
    failed bake leaves nothing behind.

    A failure here (an unreachable endpoint or a refused call too) is logged with what to run by hand,
    not raised, so the other regions are still cleaned and the caller still sees why the bake failed.
    """
    try:
        images.discard_build(run.build_id, region)
    except (UserError, ExternalError, BotoCoreError, ClientError) as exc:
        LOG.error(
            "could not discard what failed bake %s left in %s: %s; finish by hand: %s",
            run.build_id,
            region,
            exc,
            images.manual_discard(run.build_id, region),
        )


def check_image(image: images.Image, expected: dict[str, str], base: images.Image) -> None:
    """Packer must have tagged the image with every expected tag and launched the base we resolved."""
    wrong = {k: v for k, v in expected.items() if image.tags.get(k) != v}
    if wrong:
        raise ExternalError(f"image {image.id} lacks the expected tags {sorted(wrong)}")
    source = image.tags.get(images.SOURCE_AMI_TAG)
    if source != base.id:
        raise ExternalError(f"image {image.id} was built from {source}, not the resolved base {base.id}")


def installed_tags(run: Run) -> dict[str, str]:
    """The image's tags for what the bake really left installed, from the builder's node manifest."""
    if not run.node_manifest.exists():
        raise ExternalError(
            f"packer brought back no node manifest ({run.node_manifest}): "
            "the bake did not record what it installed"
        )
    node = node_manifest.load(run.node_manifest)
    for name, item in sorted(node.installed.items()):
        LOG.info("installed %s %s (%s)", name, item.version, item.source)
    return node.image_tags()


def bake_aws(options: BakeOptions) -> images.Image:
    """Bake and register one golden AMI; return it, available and IMDSv2-only."""
    region = options.the_region
    manifest = versions.load()
    image_targets = options.resolve_targets(manifest)
    base = resolve_base(options)
    check_root_volume(options, base)
    images.check_copy_regions(options.ami_regions, region)
    # Before anything is launched: a Packer the pipeline policy would stop halfway is refused here.
    packer = Packer.find()
    require_for_aws(packer)
    tags = _tags(options, manifest, image_targets)
    run = Run.new(options.work_dir)
    variables = {
        **_common_variables(options, run, tags, image_targets),
        "region": region,
        "source_ami": base.id,
        "instance_type": options.instance_type,
        "subnet_id": options.subnet_id,
        "iam_instance_profile": options.the_iam_instance_profile,
        "kms_key_id": options.kms_key_id,
        "root_volume_size_gib": options.root_volume_size_gib,
    }
    builder_imds = BuilderImds(AWS_SOURCE, region)
    try:
        artifacts = _run_packer(run, variables, AWS_SOURCE, watch=builder_imds, packer=packer)
        builder_imds.check()
        ami_id = packer_manifest.image_in(artifacts, region)
        images.wait_available(ami_id, region)
        image = images.describe(ami_id, region)
        check_image(image, tags, base)
        images.require_imdsv2(ami_id, region)
        # What the bake really left installed (the builder's node manifest), on the image and every copy.
        installed = installed_tags(run)
        images.add_tags(ami_id, installed, region)
        image = images.describe(ami_id, region)
        # The copies, made from the finished image: every tag (the installed ones too) is given at
        # creation, to the copy and its snapshots (images.copy_image says why not Packer's ami_regions).
        copies = {
            r: images.copy_image(image, region, r, options.copy_region_kms_keys.get(r, ""))
            for r in options.ami_regions
        }
        # Each copy must be what the original is: same tags, IMDSv2-only (whether CopyImage carries
        # ImdsSupport over is not documented, so it is set on each copy).
        for copy_region, copy_id in copies.items():
            images.wait_available(copy_id, copy_region)
            check_image(images.describe(copy_id, copy_region), {**tags, **installed}, base)
            images.require_imdsv2(copy_id, copy_region)
    except BaseException:
        for where in (region, *options.ami_regions):
            _discard(run, where)
        raise
    LOG.info("baked %s (%s) from %s", image.id, image.name, base.id)
    return image


@dataclass(frozen=True)
class HostTarget:
    """An SSH host to bake in place with Packer's null source: no AWS call, nothing registered.

    A plain address and login, so whoever owns the host (the checkout's lab, `gpuforge-lab bake`) resolves
    it and this module needs nothing of theirs.
    """

    host: str  # address Packer connects to (IP or DNS name)
    user: str  # SSH user with passwordless sudo
    # None: Packer uses the SSH agent (the template's lab_private_key_file "").
    private_key_file: Path | None = None
    port: int = 22
    name: str = ""  # how logs name the host (default: its address)

    def __post_init__(self) -> None:
        if not self.host or not self.user:
            raise UserError("a host bake needs the host's address and SSH user")
        # lab_port is a number in packer/variables.pkr.hcl; a TCP port is 16 bits (RFC 9293 3.1), 0 reserved.
        if not 0 < self.port < 65536:
            raise UserError(f"SSH port {self.port} is not a TCP port (1-65535)")
        if self.private_key_file is not None and not self.private_key_file.is_file():
            raise UserError(f"SSH private key {self.private_key_file} does not exist")


def bake_host(options: BakeOptions, target: HostTarget) -> Path:
    """Run the same provisioners over SSH against one host; return the run directory.

    No AWS call is made and nothing is registered: the host itself is the result (sanitized, so its SSH
    keys are gone afterwards, exactly as in an image).
    """
    manifest = versions.load()
    image_targets = options.resolve_targets(manifest)
    run = Run.new(options.work_dir)
    variables = {
        **_common_variables(options, run, _tags(options, manifest, image_targets), image_targets),
        "lab_host": target.host,
        "lab_port": target.port,
        "lab_username": target.user,
        "lab_private_key_file": str(target.private_key_file) if target.private_key_file else "",
    }
    artifacts = _run_packer(run, variables, HOST_SOURCE)
    installed_tags(run)  # Logs what the host really carries now; a host bake has no tags to write.
    LOG.info(
        "host bake %s of %s finished (%d build(s))", run.build_id, target.name or target.host, len(artifacts)
    )
    return run.directory
