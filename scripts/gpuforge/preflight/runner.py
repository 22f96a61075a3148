"""Run every preflight check for one cluster, in a fixed order."""

from __future__ import annotations

from typing import Any

from gpuforge.preflight import network, placement, quotas
from gpuforge.preflight.cluster import CLUSTER_TAG, instances
from gpuforge.preflight.result import CheckResult, failed, passed


def run(
    ec2: Any,
    service_quotas: Any,
    cluster_name: str,
    placement_group: str | None = None,
    spare_nodes: int = 1,
) -> list[CheckResult]:
    nodes = instances(ec2, cluster_name)
    if not nodes:
        return [
            failed(
                "cluster-instances", f"no pending or running instance is tagged {CLUSTER_TAG}={cluster_name}"
            )
        ]
    compute = [i for i in nodes if i.is_compute]
    results = [passed("cluster-instances", f"{len(nodes)} instances, {len(compute)} compute nodes")]
    results.extend(placement.run(ec2, compute, placement_group))
    results.append(network.check_single_az(compute))
    results.append(network.check_efa_interfaces(compute))
    results.append(network.check_security_group(ec2, compute))
    results.extend(quotas.run(ec2, service_quotas, compute, spare_nodes))
    return results
