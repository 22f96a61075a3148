# Inputs of the golden AMI build. `gpuforge bake` sets every one of them (resolving the base AMI
# with boto3 and the tags from versions.yml); the defaults only let `packer validate` run alone.
# Packer 1.6 has no regex() or can(), so validations use substr/length/contains.

variable "repo_root" {
  type        = string
  default     = "."
  description = "Absolute path of the gpuforge checkout (playbooks/ and packer/scripts/ are read from it)."
}

variable "flavor" {
  type        = string
  default     = "dlami"
  description = "Base image flavor: dlami (Deep Learning Base GPU AMI) or pcluster (official ParallelCluster AMI)."
  validation {
    condition     = contains(["dlami", "pcluster"], var.flavor)
    error_message = "The flavor must be dlami or pcluster."
  }
}

variable "region" {
  type        = string
  default     = "us-east-1"
  description = "AWS region the builder instance runs in and the AMI is registered in."
  validation {
    condition     = length(var.region) >= 9 && length(split("-", var.region)) >= 3
    error_message = "The region must be an AWS region name such as us-east-1."
  }
}

variable "source_ami" {
  type        = string
  default     = ""
  description = "Base AMI id resolved by gpuforge; empty falls back to source_ami_name_filter (owner amazon)."
  validation {
    condition     = var.source_ami == "" || (substr(var.source_ami, 0, 4) == "ami-" && contains([12, 21], length(var.source_ami)))
    error_message = "The source_ami must be an AMI id such as ami-0123456789abcdef0, or empty."
  }
}

variable "source_ami_name_filter" {
  type        = string
  default     = ""
  description = "Name filter (owner amazon, newest wins) used only when source_ami is empty; empty means the Deep Learning Base OSS Nvidia Driver GPU AMI of base_os."
}

variable "base_os" {
  type        = string
  default     = "ubuntu22.04"
  description = "Operating system of the Deep Learning Base OSS Nvidia Driver GPU AMI to bake on: ubuntu22.04 or ubuntu24.04 (gpuforge bake --base-os)."
  validation {
    condition     = contains(["ubuntu22.04", "ubuntu24.04"], var.base_os)
    error_message = "The base_os must be ubuntu22.04 or ubuntu24.04."
  }
}

variable "target_instance_types" {
  type        = list(string)
  default     = ["p5.48xlarge", "p5en.48xlarge"]
  description = "Instance types the image is for (gpuforge bake --target-instance-types, checked against data/instance_types.yml); they decide the hardware-specific installs and go into the gpuforge:target-instance-types tag."
  validation {
    condition     = length(var.target_instance_types) > 0 && length(join(",", var.target_instance_types)) <= 256
    error_message = "The target_instance_types must name at least one instance type and fit one tag value (256 characters)."
  }
}

variable "instance_type" {
  type        = string
  default     = "g5.2xlarge"
  description = "Builder instance type; a GPU type lets the bake load the driver it installs."
  validation {
    condition     = length(split(".", var.instance_type)) == 2
    error_message = "The instance_type must look like g5.2xlarge."
  }
}

variable "ssh_username" {
  type        = string
  default     = "ubuntu"
  description = "Login user of the base AMI (ubuntu for both Ubuntu 22.04 flavors)."
}

variable "subnet_id" {
  type        = string
  default     = ""
  description = "Subnet for the builder instance; empty uses the default VPC."
}

variable "iam_instance_profile" {
  type        = string
  default     = ""
  description = "Instance profile for the builder. With ssh_interface session_manager it must give the builder the Session Manager permissions (gpuforge pipeline-role's gpuforge-builder-<region> attaches AmazonSSMManagedInstanceCore); Packer refuses session_manager without one."
}

# How Packer (and Ansible, use_proxy = false) reach the builder. session_manager: an SSM port-forwarding
# tunnel from the machine running Packer, so the builder needs no inbound rule at all and may sit in a
# private subnet (Packer then creates no SSH ingress rule: SkipSSHRuleCreation = SSMAgentEnabled(),
# hashicorp/packer v1.6.6 builder/amazon/ebs/builder.go:260, packer-plugin-amazon v1.8.2
# builder/ebs/builder.go:346). The runner needs session-manager-plugin (packer/scripts/install-session-manager-plugin.sh).
variable "ssh_interface" {
  type        = string
  default     = "session_manager"
  description = "How Packer reaches the builder: session_manager (default; no inbound rule, needs iam_instance_profile) or public_ip/private_ip/public_dns/private_dns with temporary_security_group_source_cidrs."
  validation {
    # The values Packer accepts (hashicorp/packer v1.6.6 builder/amazon/common/run_config.go:527-533).
    condition     = contains(["session_manager", "public_ip", "private_ip", "public_dns", "private_dns"], var.ssh_interface)
    error_message = "The ssh_interface must be session_manager, public_ip, private_ip, public_dns or private_dns."
  }
}

variable "temporary_security_group_source_cidrs" {
  type        = list(string)
  default     = []
  description = "Without Session Manager: the CIDRs allowed to reach the builder's SSH port (e.g. the runner's egress address /32). Required then; never 0.0.0.0/0."
  validation {
    # Packer's own default for an empty list is 0.0.0.0/0 (run_config.go:604-605 at v1.6.6), which is why
    # the source never passes an empty list, and why the whole internet is refused here.
    condition     = length([for c in var.temporary_security_group_source_cidrs : c if c == "0.0.0.0/0" || c == "::/0"]) == 0
    error_message = "The temporary_security_group_source_cidrs must not open SSH to the whole internet (0.0.0.0/0 or ::/0)."
  }
}

# The image's root snapshot has the bake volume's size, and EC2 refuses to launch an image with a root
# volume smaller than its snapshot, so this size becomes every node's minimum root volume. 0 (the default)
# leaves volume_size unset: EC2 then sizes the volume from the base AMI's own root snapshot, the smallest
# the base can have. A larger value is for a bake that needs the room; EC2 refuses one below the base
# snapshot at RunInstances, and gpuforge bake checks it first.
variable "root_volume_size_gib" {
  type        = number
  default     = 0
  description = "Root volume size in GiB during the bake, and so the image's minimum root volume; 0 (default) keeps the base AMI's root snapshot size."
  validation {
    condition     = var.root_volume_size_gib == 0 || (var.root_volume_size_gib >= 8 && var.root_volume_size_gib <= 16384)
    error_message = "The root_volume_size_gib must be 0 (the base AMI's snapshot size) or between 8 and 16384."
  }
}

variable "kms_key_id" {
  type        = string
  default     = ""
  description = "KMS key for the encrypted root volume and AMI snapshots; empty uses the AWS-managed EBS key."
}

variable "image_name_prefix" {
  type        = string
  default     = "gpuforge"
  description = "AMI names are <prefix>-<flavor>-<UTC timestamp>-<git revision>."
  validation {
    condition     = length(var.image_name_prefix) > 0 && length(var.image_name_prefix) <= 64
    error_message = "The image_name_prefix must be 1 to 64 characters."
  }
}

variable "git_revision" {
  type        = string
  default     = "unknown"
  description = "Short git revision of the checkout that baked the image (goes into the name and tags)."
  validation {
    condition     = length(var.git_revision) > 0
    error_message = "The git_revision must not be empty."
  }
}

variable "build_id" {
  type        = string
  default     = "manual"
  description = "Unique id of this bake (tag gpuforge:build-id) so a failed bake's leftovers can be found."
}

variable "image_tags" {
  type        = map(string)
  default     = {}
  description = "Tags from versions.yml (every component version and gpuforge:versions-hash) and flavor extras."
}

variable "manifest_path" {
  type        = string
  default     = "packer/manifest.json"
  description = "Where the manifest post-processor writes the artifact list gpuforge parses."
}

variable "node_manifest_path" {
  type        = string
  default     = "packer/node-manifest.json"
  description = "Where the builder's /etc/gpuforge/manifest.json is downloaded to (gpuforge tags the image with what it lists)."
}

variable "ansible_extra_vars_file" {
  type        = string
  default     = ""
  description = "Optional YAML/JSON file passed to ansible-playbook with -e @file."
}

variable "lab_host" {
  type        = string
  default     = "127.0.0.1"
  description = "Lab host for the null source (gpuforge-lab bake takes it from `gpuforge-lab status`)."
}

variable "lab_port" {
  type        = number
  default     = 22
  description = "SSH port of the lab host."
}

variable "lab_username" {
  type        = string
  default     = "admin"
  description = "SSH user on the lab host (passwordless sudo)."
}

variable "lab_private_key_file" {
  type        = string
  default     = ""
  description = "Private key for the lab host; empty uses the SSH agent."
}
