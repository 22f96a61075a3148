#!/usr/bin/env bash
# Remove everything host-specific or secret before the disk becomes an image: SSH host keys,
# authorized_keys, shell histories, cloud-init state and the machine id. Each instance launched
# from the image then generates its own (cloud-init runs as on a first boot, systemd writes a new
# machine-id). SANITIZE_ROOT lets the tests run this against a scratch tree instead of "/".
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

# cloud-init state and logs, so the next boot is a first boot (keys, hostname, user data).
# This is what `cloud-init clean --logs` does, kept explicit so it also works under SANITIZE_ROOT.
if [ -d "$root"/var/lib/cloud ]; then
  for entry in "$root"/var/lib/cloud/*; do
    [ "$(basename "$entry")" = seed ] || remove "$entry"
  done
fi
remove "$root"/var/log/cloud-init.log "$root"/var/log/cloud-init-output.log

# An empty machine-id (not a missing one) makes systemd generate a fresh id on first boot;
# the D-Bus copy is removed so it cannot pin the old id.
if [ -e "$root"/etc/machine-id ]; then
  : >"$root"/etc/machine-id
  removed=$((removed + 1))
fi
remove "$root"/var/lib/dbus/machine-id

sync
echo "sanitize: cleaned ${removed} item(s) under ${root:-/}"
