#!/bin/bash
# TEST FIXTURE builder (Molecule scenario "nvidia" only). The lab cannot reach NVIDIA's apt
# repositories, so this builds stand-ins on the lab host: flat apt repositories with the real
# package names and pinned versions, whose packages contain only a marker file (and, for DCGM,
# a unit that refuses to start). They prove the roles' repository trust, version pinning and
# holds; they prove nothing about NVIDIA's binaries. Usage:
#   build-fixture-repos.sh ROOT GOOD_KEY.sec.asc IMPOSTOR_KEY.sec.asc DCGM_VERSION TOOLKIT_VERSION
set -euo pipefail
root=$1 good_key=$2 impostor_key=$3 dcgm_version=$4 toolkit_version=$5
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export GNUPGHOME="$work/gnupg"
mkdir -m 700 "$GNUPGHOME"

# package NAME VERSION REPO [UNIT_NAME]
package() {
  local name=$1 version=$2 repo=$3 unit=${4:-}
  local dir="$work/pkg/$name"
  mkdir -p "$dir/DEBIAN" "$dir/usr/share/doc/$name"
  cat > "$dir/DEBIAN/control" <<CONTROL
Package: $name
Version: $version
Architecture: amd64
Maintainer: gpuforge test fixtures <fixtures@gpuforge.invalid>
Description: gpuforge TEST FIXTURE standing in for NVIDIA's $name
 Marker content only; built by molecule/nvidia for the lab, never for production.
CONTROL
  echo "gpuforge test fixture for $name $version" > "$dir/usr/share/doc/$name/GPUFORGE-TEST-FIXTURE"
  if [ -n "$unit" ]; then
    mkdir -p "$dir/lib/systemd/system"
    cat > "$dir/lib/systemd/system/$unit" <<UNIT
[Unit]
Description=gpuforge TEST FIXTURE for $unit (no GPU software inside)

[Service]
ExecStart=/bin/false

[Install]
WantedBy=multi-user.target
UNIT
  fi
  mkdir -p "$root/$repo"
  dpkg-deb --root-owner-group --build "$dir" "$root/$repo/${name}_${version#*:}_amd64.deb" >/dev/null
}

# index REPO KEYFILE: Packages, Release and a clearsigned InRelease, as a flat repository.
index() {
  local repo=$1 key=$2
  gpg --batch --quiet --import "$key"
  local fpr
  fpr=$(gpg --batch --with-colons --import-options show-only --import "$key" | awk -F: '$1 == "fpr" { print $10; exit }')
  (cd "$root/$repo" && apt-ftparchive packages . > Packages && apt-ftparchive release . > Release)
  gpg --batch --yes --local-user "$fpr" --clearsign --output "$root/$repo/InRelease" "$root/$repo/Release"
}

rm -rf "$root"
package datacenter-gpu-manager "$dcgm_version" cuda nvidia-dcgm.service
index cuda "$good_key"
for name in nvidia-container-toolkit nvidia-container-toolkit-base libnvidia-container-tools libnvidia-container1; do
  package "$name" "$toolkit_version" libnvidia-container
done
index libnvidia-container "$good_key"
package gpuforge-fixture-impostor 1.0 impostor
index impostor "$impostor_key"
gpg --batch --armor --export "$(gpg --batch --with-colons --import-options show-only --import "$good_key" | awk -F: '$1 == "fpr" { print $10; exit }')" > "$root/fixture-repo-key.pub.asc"
chmod -R a+rX "$root"
