#!/bin/bash
# ParallelCluster OnNodeConfigured custom action: configure this node from its image, offline.
#
# The image carries gpuforge (roles/gpuforge_node: the collection of the bake's revision, a pinned
# Ansible runtime and /usr/local/sbin/gpuforge-node), so this runs no git, no pip and no apt and
# needs no network; a newer revision, when the Args name one, comes from S3 by exact revision and
# sha256 (docs/node-side.md). ParallelCluster runs it as root with the Args of the head node's or
# the queue's CustomActions.OnNodeConfigured; `gpuforge cluster-config generate` writes them:
#   --node-type HeadNode|Compute [--queue NAME] [--cluster NAME]
#   [--revision COMMIT --sha256 HEX --bucket BUCKET [--prefix P] [--region R]] [-- ansible args]
# It never reads /etc/parallelcluster/cfnconfig, which ParallelCluster does not support for custom
# actions (https://docs.aws.amazon.com/parallelcluster/latest/ug/custom-bootstrap-actions-v3.html).
set -euo pipefail

entry="${GPUFORGE_NODE:-/usr/local/sbin/gpuforge-node}"

if [ ! -x "$entry" ]; then
    echo "on_node_configured: $entry is missing: this image was not baked with gpuforge (roles/gpuforge_node)" >&2
    exit 3
fi
exec "$entry" apply "$@"
