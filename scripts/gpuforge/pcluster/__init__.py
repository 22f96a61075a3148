"""AWS ParallelCluster 3 cluster configs: generate from a small spec, validate offline, patch the AMI."""
