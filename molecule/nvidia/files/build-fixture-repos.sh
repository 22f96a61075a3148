#!/bin/bash
# TEST FIXTURE builder (Molecule scenario "nvidia" only). The lab cannot reach NVIDIA's apt
# repositories, so this builds stand-ins on the lab host: flat apt repositories with the real
# package names and pinned versions, whose packages contain only a marker file (and, for DCGM,
# a unit that refuses to start; nvidia-smi fails as it does without a driver). They follow the
# production pins of versions.yml (Debian 12 ships only the R535 driver, so the lab's driver packages
# are stand-ins too). They prove the roles' repository trust, version policy, pinning and holds;
# they prove nothing about NVIDIA's binaries. Usage:
#   build-fixture-repos.sh ROOT GOOD_KEY.sec.asc IMPOSTOR_KEY.sec.asc DCGM_VERSION TOOLKIT_VERSION \
#     DRIVER_DEBIAN_VERSION DCGM_CUDA_MAJOR
set -euo pipefail
root=$1 good_key=$2 impostor_key=$3 dcgm_version=$4 toolkit_version=$5 driver_version=$6 dcgm_cuda=$7
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
  if [ "$name" = nvidia-smi ]; then
    # What nvidia-smi does on a host without the driver loaded: say so and exit non-zero.
    mkdir -p "$dir/usr/bin"
    printf '#!/bin/sh\necho "gpuforge TEST FIXTURE nvidia-smi: NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver." >&2\nexit 9\n' > "$dir/usr/bin/nvidia-smi"
    chmod 0755 "$dir/usr/bin/nvidia-smi"
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
# The Debian names of the driver packages nvidia_driver installs in the lab (vars/Debian.yml).
for name in nvidia-smi libnvidia-ml1 libcuda1 libnvidia-ptxjitcompiler1 libnvidia-pkcs11-openssl3 libnvidia-cfg1 \
  nvidia-alternative nvidia-legacy-check; do
  package "$name" "$driver_version" cuda
done
package nvidia-persistenced "$driver_version" cuda nvidia-persistenced.service
package datacenter-gpu-manager-4-core "$dcgm_version" cuda nvidia-dcgm.service
package "datacenter-gpu-manager-4-cuda$dcgm_cuda" "$dcgm_version" cuda
index cuda "$good_key"
for name in nvidia-container-toolkit nvidia-container-toolkit-base libnvidia-container-tools libnvidia-container1; do
  package "$name" "$toolkit_version" libnvidia-container
done
index libnvidia-container "$good_key"
package gpuforge-fixture-impostor 1.0 impostor
index impostor "$impostor_key"
gpg --batch --armor --export "$(gpg --batch --with-colons --import-options show-only --import "$good_key" | awk -F: '$1 == "fpr" { print $10; exit }')" > "$root/fixture-repo-key.pub.asc"
chmod -R a+rX "$root"
