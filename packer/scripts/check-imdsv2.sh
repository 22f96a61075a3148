#!/usr/bin/env bash
# The first provisioner on the EC2 builder: the instance must already refuse IMDSv1 (a metadata
# request without a session token) before anything else runs on it. `gpuforge bake` requires IMDSv2
# as soon as Packer reports the instance (BuilderImds in scripts/gpuforge/ami/bake.py), because
# Packer 1.6 cannot ask for it at launch; this checks from inside that it took effect, so a bake
# whose wrapper missed the instance fails here instead of provisioning an IMDSv1 host.
# IMDS_URL and IMDS_WAIT_S let the tests point this at a stand-in.
set -euo pipefail

url="${IMDS_URL:-http://169.254.169.254}/latest/meta-data/instance-id"
wait_s="${IMDS_WAIT_S:-60}"

if ! command -v curl >/dev/null; then
  echo "check-imdsv2: curl is missing on the builder, so IMDS cannot be checked" >&2
  exit 1
fi

# The metadata options change applies within seconds; wait that long, no longer.
deadline=$((SECONDS + wait_s))
while :; do
  code="$(curl --silent --output /dev/null --write-out '%{http_code}' --max-time 2 "$url" || true)"
  if [ "$code" = 401 ]; then
    echo "check-imdsv2: IMDS refuses requests without a session token (IMDSv2 only)"
    exit 0
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "check-imdsv2: after ${wait_s}s IMDS still answers a request without a token with HTTP" \
      "${code:-none} (401 expected): the builder allows IMDSv1; see ModifyInstanceMetadataOptions" \
      "in the gpuforge bake log" >&2
    exit 1
  fi
  sleep 2
done
