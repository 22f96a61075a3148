#!/usr/bin/env bash
# Fail the bake early when the base image cannot make the flavor asked for: ParallelCluster
# refuses a custom AMI whose base lacks its bootstrap marker, and finding out at cluster
# creation costs far more than at bake time. CHECK_ROOT lets the tests point this at a scratch tree.
set -euo pipefail

root="${CHECK_ROOT:-/}"
root="${root%/}"
flavor="${GPUFORGE_FLAVOR:?GPUFORGE_FLAVOR must be set (dlami or pcluster)}"

case "$flavor" in
  pcluster)
    marker="$root/opt/parallelcluster/.bootstrapped"
    if [ ! -s "$marker" ]; then
      echo "check-base: $marker is missing or empty: the base is not an official ParallelCluster AMI" >&2
      exit 1
    fi
    echo "check-base: ParallelCluster base, bootstrapped as $(cat "$marker")"
    ;;
  dlami)
    echo "check-base: dlami base, nothing flavor-specific to check"
    ;;
  *)
    echo "check-base: unknown flavor $flavor" >&2
    exit 1
    ;;
esac
