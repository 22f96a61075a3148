#!/usr/bin/env bash
# Remove everything host-specific or secret before the disk becomes an image: SSH host keys,
# authorized_keys, shell histories, cloud-init state and the machine id. Each instance launched
# from the image then generates its own (cloud-init runs as on a first boot, systemd writes a new
# machine-id). SANITIZE_ROOT lets the tests run this against a scratch tree instead of "/".
#
# It also clears everything ParallelCluster's own AMI cleanup clears (aws-parallelcluster-cookbook,
# cookbooks/aws-parallelcluster-platform/files/ami_cleanup.sh, `pcluster build-image`'s last step):
# `cloud-init clean -s` (state and seed), /tmp and /var/tmp, SSH host keys, udev's persistent-net
# rules, cloud-init's ifcfg files, /var/crash, every file under /var/log (then an empty lastlog), and
# ParallelCluster's release pin. Its resolv.conf reset applies only to AWS's official AMI builds.
set -euo pipefail

root="${SANITIZE_ROOT:-/}"
root="${root%/}"

removed=0
remove() {
  local path
  for path in "$@"; do
    if [ -e "$path" ] || [ -L "$path" ]; then
      rm -rf -- "$path"
      removed=$((removed + 1))
    fi
  done
}

shopt -s nullglob dotglob

# SSH host keys: every instance must have its own.
remove "$root"/etc/ssh/ssh_host_*

# Login keys of every user, including the temporary key Packer logged in with.
remove "$root"/root/.ssh/authorized_keys "$root"/root/.ssh/authorized_keys2
remove "$root"/home/*/.ssh/authorized_keys "$root"/home/*/.ssh/authorized_keys2

# Shell and tool histories may hold commands with secrets in them.
for home in "$root"/root "$root"/home/*; do
  remove "$home"/.bash_history "$home"/.zsh_history "$home"/.python_history \
    "$home"/.lesshst "$home"/.viminfo "$home"/.wget-hsts
done

# cloud-init state, seed and logs, so the next boot is a first boot (keys, hostname, user data).
# This is what `cloud-init clean --logs --seed` does, kept explicit so it also works under SANITIZE_ROOT.
remove "$root"/var/lib/cloud/*
remove "$root"/var/log/cloud-init.log "$root"/var/log/cloud-init-output.log

# The munge key Debian's and Ubuntu's munge package generated on the builder: every node of the
# image would share it until configured. The slurm role writes the cluster's own (from SSM) on each node.
remove "$root"/etc/munge/munge.key

# Scratch space and crash dumps of the build (Packer's uploaded scripts included: this one is
# already read by bash, and Packer removes its copy with rm -f).
remove "$root"/tmp/* "$root"/var/tmp/* "$root"/var/crash/*

# Network identity cloud-init or udev pinned to the builder's interfaces.
remove "$root"/etc/udev/rules.d/70-persistent-net.rules
for ifcfg in "$root"/etc/sysconfig/network-scripts/ifcfg-*; do
  if grep -q "Created by cloud-init on instance boot automatically" "$ifcfg"; then
    remove "$ifcfg"
  fi
done

# ParallelCluster's release pin (RHEL family), as ami_cleanup.sh removes it.
if [ -e "$root"/opt/parallelcluster/pin_releasesever ]; then
  remove "$root"/opt/parallelcluster/pin_releasesever "$root"/etc/yum/vars/releasever
fi

# Every log file of the build (the directories stay, for the services that write there), then an
# empty lastlog as ami_cleanup.sh leaves it.
while IFS= read -r -d '' log; do
  remove "$log"
done < <(find "$root"/var/log -type f ! -path "$root/var/log/lastlog" -print0 2>/dev/null)
if [ -d "$root"/var/log ]; then
  : >"$root"/var/log/lastlog
fi

# An empty machine-id (not a missing one) makes systemd generate a fresh id on first boot;
# the D-Bus copy is removed so it cannot pin the old id.
if [ -e "$root"/etc/machine-id ]; then
  : >"$root"/etc/machine-id
  removed=$((removed + 1))
fi
remove "$root"/var/lib/dbus/machine-id

sync
echo "sanitize: cleaned ${removed} item(s) under ${root:-/}"
