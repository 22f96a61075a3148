#!/usr/bin/env bash
# Install AWS's session-manager-plugin on the machine that runs Packer (a GitHub runner or CodeBuild,
# Ubuntu x86_64), so Packer's ssh_interface = "session_manager" can open its SSM tunnel to the builder.
# The package is AWS's documented Debian/Ubuntu one at a pinned version, and it is installed only after
# its detached signature verifies against AWS's signer key (session-manager-plugin.asc next to this
# script, fingerprint checked below), as AWS documents in
# https://docs.aws.amazon.com/systems-manager/latest/userguide/install-plugin-linux-verify-signature.html
# Versions: https://docs.aws.amazon.com/systems-manager/latest/userguide/plugin-version-history.html
set -euo pipefail

version="${SESSION_MANAGER_PLUGIN_VERSION:?set SESSION_MANAGER_PLUGIN_VERSION to the pinned plugin release}"
# Versioned path of the same bucket as AWS's .../plugin/latest/ubuntu_64bit/ URLs.
base_url="${SESSION_MANAGER_PLUGIN_BASE_URL:-https://s3.amazonaws.com/session-manager-downloads/plugin}"
# AWS's signer key for plugin 1.2.707.0 and later (the page above).
fingerprint="7959637124CE093AD501D47A2C4D4AFF6F6757EE"
key_file="$(dirname "$0")/session-manager-plugin.asc"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export GNUPGHOME="$work/gnupg"
install -d -m 0700 "$GNUPGHOME"

deb="$work/session-manager-plugin.deb"
curl -fsSL --retry 3 -o "$deb" "$base_url/$version/ubuntu_64bit/session-manager-plugin.deb"
curl -fsSL --retry 3 -o "$deb.sig" "$base_url/$version/ubuntu_64bit/session-manager-plugin.deb.sig"

gpg --batch --quiet --import "$key_file"
imported="$(gpg --batch --with-colons --fingerprint | awk -F: '$1 == "fpr" { print $10; exit }')"
if [ "$imported" != "$fingerprint" ]; then
  echo "session-manager-plugin.asc has fingerprint $imported, not AWS's $fingerprint" >&2
  exit 1
fi
# A good signature by exactly that key, or nothing is installed.
if ! gpg --batch --status-fd 1 --verify "$deb.sig" "$deb" 2>/dev/null | grep -q "^\[GNUPG:\] VALIDSIG $fingerprint "; then
  echo "session-manager-plugin $version: the signature does not verify against AWS's key $fingerprint" >&2
  exit 1
fi

sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
"${sudo_cmd[@]}" dpkg -i "$deb"
installed="$(session-manager-plugin --version)"
if [ "$installed" != "$version" ]; then
  echo "session-manager-plugin reports $installed, expected $version" >&2
  exit 1
fi
echo "session-manager-plugin $installed installed (signature by $fingerprint)"
