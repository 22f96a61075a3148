# The golden AMI build: one amazon-ebs source for both base flavors and a null source that runs
# the very same provisioners over SSH against a lab host (gpuforge-lab bake).
# Plugin and Packer version requirements live in plugins.pkr.hcl.modern (see docs/ami-pipeline.md),
# because Packer 1.6 rejects required_plugins.

locals {
  # One timestamp per run, shared by the AMI name and the build-time tag.
  build_time = formatdate("YYYYMMDDhhmmss", timestamp())
  image_name = "${var.image_name_prefix}-${var.flavor}-${local.build_time}-${var.git_revision}"

  # Tags every artifact carries: the versions manifest (from gpuforge), provenance, and the base image.
  # Packer renders {{ .SourceAMI }} and {{ .SourceAMIName }} from the image it actually launched.
  image_tags = merge(var.image_tags, {
    "Name"                           = local.image_name
    "gpuforge:flavor"                = var.flavor
    "gpuforge:git-revision"          = var.git_revision
    "gpuforge:build-id"              = var.build_id
    "gpuforge:build-time"            = local.build_time
    "gpuforge:source-ami-id"         = "{{ .SourceAMI }}"
    "gpuforge:source-ami-name"       = "{{ .SourceAMIName }}"
    "gpuforge:target-instance-types" = join(",", var.target_instance_types)
  })

  # A fallback filter only when gpuforge did not resolve the base AMI itself: the Deep Learning
  # Base OSS Nvidia Driver GPU AMI of base_os (images.DLAMI_NAME_FILTERS in gpuforge).
  dlami_name_filters = {
    "ubuntu22.04" = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) *"
    "ubuntu24.04" = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) *"
  }
  source_ami_name_filter = var.source_ami_name_filter != "" ? var.source_ami_name_filter : local.dlami_name_filters[var.base_os]
  source_ami_filters     = var.source_ami == "" ? [local.source_ami_name_filter] : []

  ansible_extra_vars = var.ansible_extra_vars_file == "" ? [] : ["-e", "@${var.ansible_extra_vars_file}"]
}

source "amazon-ebs" "gpu" {
  region               = var.region
  instance_type        = var.instance_type
  source_ami           = var.source_ami
  ssh_username         = var.ssh_username
  subnet_id            = var.subnet_id
  iam_instance_profile = var.iam_instance_profile
  # Session Manager by default: no inbound rule on the builder, reachable in a private subnet. Otherwise
  # SSH is open only to the CIDRs given; an empty list would be Packer's 0.0.0.0/0 default, so it becomes
  # a value Packer refuses by name ("Error parsing CIDR in temporary_security_group_source_cidrs").
  ssh_interface = var.ssh_interface
  temporary_security_group_source_cidrs = var.ssh_interface == "session_manager" ? null : (
    length(var.temporary_security_group_source_cidrs) > 0 ? var.temporary_security_group_source_cidrs : ["set-temporary_security_group_source_cidrs-when-ssh_interface-is-not-session_manager"]
  )
  ami_name                = local.image_name
  ami_description         = "gpuforge ${var.flavor} GPU image built from ${var.git_revision}"
  ami_virtualization_type = "hvm"
  ena_support             = true
  # No ami_regions (nor encrypt_boot, which copies too): Packer's copies arrive with untagged snapshots
  # that it then tags in a call the pipeline policy denies (packer-plugin-amazon v1.8.2
  # builder/common/step_ami_region_copy.go:215-222, step_create_tags.go:116-120). `gpuforge bake
  # --copy-region` copies the finished image itself, tagging the copy and its snapshots at creation.

  # gpuforge:modern-packer-settings
  # Packer >= 1.7 only: `gpuforge bake` (Packer.stage) replaces the line above with
  # packer/amazon-ebs.pkr.hcl.modern (IMDSv2-only builder and image). Packer 1.6 rejects those settings,
  # so with it the wrapper secures the builder and the image through the EC2 API instead.

  dynamic "source_ami_filter" {
    for_each = local.source_ami_filters
    content {
      filters = {
        name                = source_ami_filter.value
        architecture        = "x86_64"
        virtualization-type = "hvm"
        root-device-type    = "ebs"
      }
      owners      = ["amazon"]
      most_recent = true
    }
  }

  # The root volume is gp3 and encrypted from launch, so the image's snapshot is encrypted with the
  # same key and no unencrypted snapshot ever exists. No encrypt_boot: it would copy the image and
  # then delete an untagged intermediate one, which the pipeline role may not do (it deregisters
  # only gpuforge-tagged images: packer/iam/pipeline-policy.json).
  launch_block_device_mappings {
    device_name = "/dev/sda1"
    # null (root_volume_size_gib 0): EC2 sizes the volume from the base AMI's root snapshot.
    volume_size           = var.root_volume_size_gib == 0 ? null : var.root_volume_size_gib
    volume_type           = "gp3"
    iops                  = 3000
    throughput            = 250
    encrypted             = true
    kms_key_id            = var.kms_key_id
    delete_on_termination = true
  }

  tags          = local.image_tags
  snapshot_tags = local.image_tags
  run_tags = {
    "Name"              = "gpuforge-bake-${var.build_id}"
    "gpuforge:build-id" = var.build_id
  }
  # The builder's volumes carry the build id from RunInstances on: the pipeline role may launch only
  # volumes tagged with it (packer/iam/pipeline-policy.json, PackerLaunchBuilderVolumes).
  run_volume_tags = {
    "Name"              = "gpuforge-bake-${var.build_id}"
    "gpuforge:build-id" = var.build_id
  }
}

source "null" "lab" {
  communicator         = "ssh"
  ssh_host             = var.lab_host
  ssh_port             = var.lab_port
  ssh_username         = var.lab_username
  ssh_private_key_file = var.lab_private_key_file
  ssh_agent_auth       = var.lab_private_key_file == ""
}

build {
  sources = ["source.amazon-ebs.gpu", "source.null.lab"]

  # Before anything runs on the EC2 builder: it must refuse IMDSv1. Packer 1.6 rejects
  # metadata_options, so `gpuforge bake` requires IMDSv2 when Packer reports the instance; this
  # checks from inside that it took effect (the lab host has no IMDS).
  provisioner "shell" {
    only   = ["amazon-ebs.gpu"]
    script = "${var.repo_root}/packer/scripts/check-imdsv2.sh"
  }

  # Then: refuse a base that cannot make this flavor, before spending time on the playbook.
  provisioner "shell" {
    script           = "${var.repo_root}/packer/scripts/check-base.sh"
    environment_vars = ["GPUFORGE_FLAVOR=${var.flavor}"]
  }

  # Ansible connects to the host directly (no Packer SSH proxy), the same way it reaches the fleet.
  provisioner "ansible" {
    playbook_file = "${var.repo_root}/playbooks/bake.yml"
    use_proxy     = false
    user          = source.name == "lab" ? var.lab_username : var.ssh_username
    # The image's target instance types decide every hardware-specific install (fabric manager,
    # NVLink subnet manager); the builder's own hardware only decides what can be checked.
    # A bake is always a full install: the golden fast path (playbooks/bake.yml) never trusts a
    # builder's own manifest, even one left by an earlier gpuforge image used as the base.
    extra_arguments = concat([
      "--tags", "install",
      "-e", "gpuforge_full_install=true",
      "-e", "gpuforge_bake_flavor=${var.flavor}",
      "-e", jsonencode({ gpuforge_target_instance_types = var.target_instance_types }),
    ], local.ansible_extra_vars)
    # Facts in memory only: ansible.cfg's jsonfile cache is keyed by inventory name, and every
    # Packer build's host is "default", so a bake would reuse the facts of another image's build
    # (another OS release) gathered within the hour, or of one running beside it.
    ansible_env_vars = [
      "ANSIBLE_CONFIG=${var.repo_root}/ansible.cfg",
      "ANSIBLE_HOST_KEY_CHECKING=False",
      "ANSIBLE_CACHE_PLUGIN=ansible.builtin.memory",
    ]
  }

  # What the bake really left installed (docs/manifest.md): gpuforge tags the image with it.
  provisioner "file" {
    source      = "/etc/gpuforge/manifest.json"
    destination = var.node_manifest_path
    direction   = "download"
  }

  # Last step: leave nothing host-specific or secret in the image.
  provisioner "shell" {
    script          = "${var.repo_root}/packer/scripts/sanitize.sh"
    execute_command = "chmod +x {{ .Path }}; sudo -n env {{ .Vars }} {{ .Path }}"
  }

  post-processor "manifest" {
    output     = var.manifest_path
    strip_path = true
    custom_data = {
      flavor        = var.flavor
      build_id      = var.build_id
      git_revision  = var.git_revision
      versions_hash = lookup(var.image_tags, "gpuforge:versions-hash", "")
    }
  }
}
