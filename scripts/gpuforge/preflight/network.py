"""Network checks for an EFA fleet: one Availability Zone, every EFA interface, the EFA security group."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from gpuforge import instance_types
from gpuforge.preflight.cluster import Instance
from gpuforge.preflight.result import CheckResult, failed, passed, skipped

AZ_CHECK = "single-az"
EFA_CHECK = "efa-interfaces"
SG_CHECK = "efa-security-group"


def check_single_az(compute: Sequence[Instance]) -> CheckResult:
    if not compute:
        return skipped(AZ_CHECK, "no compute nodes")
    zones = Counter(i.availability_zone for i in compute)
    if len(zones) == 1:
        return passed(AZ_CHECK, f"all {len(compute)} compute nodes in {next(iter(zones))}")
    spread = ", ".join(f"{zone}: {count}" for zone, count in sorted(zones.items()))
    return failed(AZ_CHECK, f"compute nodes span {len(zones)} AZs ({spread}); EFA does not cross AZs")


def check_efa_interfaces(compute: Sequence[Instance]) -> CheckResult:
    """Every GPU node has as many EFA interfaces as data/instance_types.yml says its type supports."""
    known = instance_types.all_types()
    problems: list[str] = []
    checked = 0
    for inst in compute:
        facts = known.get(inst.instance_type)
        if facts is None:
            problems.append(
                f"{inst.instance_id}: type {inst.instance_type} is not in data/instance_types.yml"
            )
            continue
        if facts.gpus == 0 or facts.efa_interfaces == 0:
            continue
        checked += 1
        if inst.efa_interfaces < facts.efa_interfaces:
            problems.append(
                f"{inst.instance_id} ({inst.instance_type}): {inst.efa_interfaces} of "
                f"{facts.efa_interfaces} EFA interfaces"
            )
    if problems:
        return failed(EFA_CHECK, "; ".join(problems))
    if checked == 0:
        return skipped(EFA_CHECK, "no GPU compute nodes with EFA support")
    return passed(EFA_CHECK, f"{checked} GPU nodes have all their EFA interfaces")


def _allows_self_all_traffic(group: dict[str, Any], key: str) -> bool:
    """Whether the group's rules under key allow all protocols to/from the group itself."""
    return any(
        perm.get("IpProtocol") == "-1"
        and any(pair.get("GroupId") == group["GroupId"] for pair in perm.get("UserIdGroupPairs", []))
        for perm in group.get(key, [])
    )


def efa_ready_groups(groups: Sequence[dict[str, Any]]) -> set[str]:
    """Ids of the groups with the self-referencing all-traffic ingress AND egress rule EFA needs.

    The same rule as ParallelCluster's EfaSecurityGroupValidator and AWS's EFA guide: the group
    itself must be named on both sides; an egress rule to 0.0.0.0/0 does not satisfy it.
    """
    return {
        g["GroupId"]
        for g in groups
        if _allows_self_all_traffic(g, "IpPermissions") and _allows_self_all_traffic(g, "IpPermissionsEgress")
    }


def describe_groups(ec2: Any, group_ids: Sequence[str]) -> list[dict[str, Any]]:
    if not group_ids:
        return []
    paginator = ec2.get_paginator("describe_security_groups")
    return [g for page in paginator.paginate(GroupIds=list(group_ids)) for g in page["SecurityGroups"]]


def check_security_group(ec2: Any, compute: Sequence[Instance]) -> CheckResult:
    efa_nodes = [i for i in compute if i.efa_interfaces > 0]
    if not efa_nodes:
        return skipped(SG_CHECK, "no compute node has an EFA interface")
    ids = sorted({g for i in efa_nodes for g in i.security_group_ids})
    ready = efa_ready_groups(describe_groups(ec2, ids))
    lacking = [i for i in efa_nodes if not ready.intersection(i.security_group_ids)]
    if lacking:
        listed = ", ".join(
            f"{i.instance_id} ({' '.join(i.security_group_ids) or 'no groups'})" for i in lacking
        )
        return failed(
            SG_CHECK,
            f"no security group allows all traffic to and from itself (ingress and egress) on: {listed}",
        )
    # Each node's group only admits its own members, so the fleet must share one such group.
    shared = set(ready)
    for inst in efa_nodes:
        shared.intersection_update(inst.security_group_ids)
    if not shared:
        return failed(
            SG_CHECK, "EFA nodes use different self-referencing groups; attach one group to all of them"
        )
    return passed(SG_CHECK, f"{len(efa_nodes)} EFA nodes share self-referencing group {min(shared)}")
