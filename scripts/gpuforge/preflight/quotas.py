"""Service Quotas check: the Region's On-Demand vCPU quota leaves room to replace failed nodes.

The quota counts vCPUs of every running On-Demand instance of the family in the Region (not only
this cluster's), so usage is summed over the whole Region. A running cluster is by definition
within its quota; what preflight verifies is headroom: room to launch `spare_nodes` more of the
cluster's largest instance of that family (a replacement for a node that health checks drain).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpuforge.preflight.cluster import LIVE_STATES, Instance
from gpuforge.preflight.result import CheckResult, failed, passed, skipped


@dataclass(frozen=True)
class Quota:
    code: str
    title: str
    families: tuple[str, ...]


# Quota codes of the EC2 service in Service Quotas; values are vCPU counts.
QUOTAS = (
    Quota("L-417A185B", "Running On-Demand P instances", ("p",)),
    Quota("L-DB2E81BA", "Running On-Demand G and VT instances", ("g", "vt")),
)
# Errors meaning "this endpoint cannot tell us the quota", as opposed to a broken request.
_UNAVAILABLE = {
    "NoSuchResourceException",
    "AccessDeniedException",
    "ServiceException",
    "NotImplemented",
    "UnknownOperationException",
}
_FAMILY_RE = re.compile(r"^([a-z]+)\d")


def family(instance_type: str) -> str:
    """'p5.48xlarge' -> 'p', 'vt1.3xlarge' -> 'vt'."""
    match = _FAMILY_RE.match(instance_type)
    return match.group(1) if match else instance_type


def quota_for(instance_type: str) -> Quota | None:
    fam = family(instance_type)
    return next((q for q in QUOTAS if fam in q.families), None)


def check_name(quota: Quota) -> str:
    return f"quota-{quota.code}"


def get_quota_value(quotas: Any, quota: Quota) -> tuple[float | None, str]:
    """The applied quota in vCPUs, or (None, why it is unavailable)."""
    try:
        response = quotas.get_service_quota(ServiceCode="ec2", QuotaCode=quota.code)
    except ClientError as exc:
        code = exc.response["Error"]["Code"]
        if code in _UNAVAILABLE or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500:
            message = exc.response["Error"].get("Message", "")
            return None, f"Service Quotas did not return {quota.code} ({code}: {message})"
        raise
    except BotoCoreError as exc:
        return None, f"Service Quotas unreachable: {exc}"
    return float(response["Quota"]["Value"]), ""


def vcpus_by_type(ec2: Any, types: Iterable[str]) -> dict[str, int]:
    wanted = sorted(set(types))
    if not wanted:
        return {}
    paginator = ec2.get_paginator("describe_instance_types")
    return {
        t["InstanceType"]: int(t["VCpuInfo"]["DefaultVCpus"])
        for page in paginator.paginate(InstanceTypes=wanted)
        for t in page["InstanceTypes"]
    }


def region_usage(ec2: Any) -> list[str]:
    """Instance types of every live On-Demand instance in the Region (one entry per instance).

    Spot Instances count against separate Spot quotas, so they are left out.
    """
    paginator = ec2.get_paginator("describe_instances")
    pages = paginator.paginate(Filters=[{"Name": "instance-state-name", "Values": list(LIVE_STATES)}])
    return [
        i["InstanceType"]
        for page in pages
        for r in page["Reservations"]
        for i in r["Instances"]
        if i.get("InstanceLifecycle") != "spot"
    ]


def evaluate(quota: Quota, limit: float, used_vcpus: int, spare_vcpus: int, spare_desc: str) -> CheckResult:
    """PASS when the quota covers current usage plus the spare nodes."""
    need = used_vcpus + spare_vcpus
    figures = f"quota {limit:g} vCPUs, {used_vcpus} in use, {spare_vcpus} for {spare_desc}"
    if need > limit:
        return failed(
            check_name(quota),
            f"{quota.title}: {figures}; raise {quota.code} to at least {need} in Service Quotas",
        )
    return passed(check_name(quota), f"{quota.title}: {figures}")


def run(ec2: Any, quotas: Any, compute: Sequence[Instance], spare_nodes: int) -> list[CheckResult]:
    relevant = [q for q in QUOTAS if any(quota_for(i.instance_type) == q for i in compute)]
    if not relevant:
        return [skipped("quota", "no P, G or VT compute nodes")]
    in_region = region_usage(ec2)
    vcpus = vcpus_by_type(ec2, [*in_region, *(i.instance_type for i in compute)])
    results = []
    for quota in relevant:
        limit, why = get_quota_value(quotas, quota)
        if limit is None:
            results.append(skipped(check_name(quota), why))
            continue
        used = sum(vcpus[t] for t in in_region if quota_for(t) == quota)
        largest = max(
            (i.instance_type for i in compute if quota_for(i.instance_type) == quota), key=vcpus.__getitem__
        )
        spare = spare_nodes * vcpus[largest]
        results.append(evaluate(quota, limit, used, spare, f"{spare_nodes} spare {largest}"))
    return results
