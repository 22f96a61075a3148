"""Run every preflight check for one cluster, in a fixed order.

Placement group and Availability Zone are properties of a Slurm queue in ParallelCluster (each
queue has its own subnet and placement group), so those checks run per queue and their rows
are named "check[queue]" when the cluster has more than one queue.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from itertools import groupby
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpuforge import aws
from gpuforge.errors import ExternalError, UserError
from gpuforge.preflight import network, placement, quotas
from gpuforge.preflight.cluster import CLUSTER_TAG, QUEUE_TAG, Instance, instances
from gpuforge.preflight.result import CheckResult, failed, passed


def by_queue(compute: Sequence[Instance]) -> dict[str | None, list[Instance]]:
    ordered = sorted(compute, key=lambda i: i.queue or "")
    return {queue: list(nodes) for queue, nodes in groupby(ordered, key=lambda i: i.queue)}


def _queue_checks(ec2: Any, nodes: Sequence[Instance], placement_group: str | None) -> list[CheckResult]:
    return [*placement.run(ec2, nodes, placement_group), network.check_single_az(nodes)]


def run(
    ec2: Any,
    service_quotas: Any,
    cluster_name: str,
    placement_group: str | None = None,
    spare_nodes: int = 1,
    queue: str | None = None,
) -> list[CheckResult]:
    nodes = instances(ec2, cluster_name)
    if not nodes:
        detail = f"no pending or running instance is tagged {CLUSTER_TAG}={cluster_name}"
        return [failed("cluster-instances", detail)]
    compute = [i for i in nodes if i.is_compute]
    queues = by_queue(compute)
    if queue is not None:
        if queue not in queues:
            known = ", ".join(sorted(q for q in queues if q)) or "none tagged"
            return [
                failed(
                    "cluster-instances", f"no compute node is tagged {QUEUE_TAG}={queue} (queues: {known})"
                )
            ]
        compute = queues[queue]
        queues = {queue: compute}
    results = [passed("cluster-instances", f"{len(nodes)} instances, {len(compute)} compute nodes")]
    if len(queues) <= 1:
        results.extend(_queue_checks(ec2, compute, placement_group))
    else:
        for name, members in queues.items():
            rows = _queue_checks(ec2, members, placement_group)
            results.extend(dataclasses.replace(r, name=f"{r.name}[{name or 'untagged'}]") for r in rows)
    results.append(network.check_efa_interfaces(compute))
    results.append(network.check_security_group(ec2, compute))
    results.extend(quotas.run(ec2, service_quotas, compute, spare_nodes))
    return results


_REGION_RE = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+$")
# ParallelCluster cluster names: a letter, then letters, digits and hyphens, at most 60 characters.
_CLUSTER_RE = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,59}$")


def check_request(cluster_name: str, region: str | None, spare_nodes: int) -> None:
    """Refuse a cluster name, region or headroom that cannot be right, before any AWS call."""
    if not _CLUSTER_RE.match(cluster_name):
        raise UserError(
            f"--cluster-name {cluster_name!r} is not a ParallelCluster name "
            "(a letter, then letters, digits or hyphens, 60 characters at most)"
        )
    if region is not None and not _REGION_RE.match(region):
        raise UserError(f"--region {region!r} is not an AWS Region name such as us-east-1")
    if spare_nodes < 0:
        raise UserError("--spare-nodes must be 0 or more")


def run_in(
    region: str, cluster_name: str, placement_group: str | None, spare_nodes: int, queue: str | None
) -> list[CheckResult]:
    """run() with the region's clients; an AWS call that fails is an ExternalError naming the region."""
    try:
        return run(
            aws.client("ec2", region),
            aws.client("service-quotas", region),
            cluster_name,
            placement_group=placement_group,
            spare_nodes=spare_nodes,
            queue=queue,
        )
    except (BotoCoreError, ClientError) as exc:
        raise ExternalError(f"AWS call failed during preflight in {region}: {exc}") from exc
