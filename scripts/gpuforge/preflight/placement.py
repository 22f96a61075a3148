"""Placement-group checks: the group exists as a cluster group and holds the whole compute fleet.

What "at capacity" means here: EC2 exposes no capacity figure for a cluster placement group.
When a group's rack cannot take another instance, RunInstances fails with
InsufficientInstanceCapacity and nothing is created, so the only trace the EC2 API keeps is a
fleet that is not wholly inside the group (ParallelCluster launches every compute node of a
placement-group queue into it). The capacity check therefore fails when any live compute node
of the cluster runs outside the group, and says that a launch retry or a capacity reservation
is the remedy; it cannot predict an InsufficientInstanceCapacity error before a launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from botocore.exceptions import ClientError

from gpuforge.preflight.cluster import Instance
from gpuforge.preflight.result import CheckResult, failed, passed, skipped

GROUP_CHECK = "placement-group"
CAPACITY_CHECK = "placement-group-capacity"


def resolve_group_name(compute: Sequence[Instance], requested: str | None) -> str | None:
    """The group to check: the one asked for, else the single group the compute nodes are in."""
    if requested:
        return requested
    names = {i.placement_group for i in compute if i.placement_group}
    return names.pop() if len(names) == 1 else None


def describe_group(ec2: Any, name: str) -> dict[str, Any] | None:
    """The DescribePlacementGroups entry for name, or None when the group does not exist."""
    try:
        groups = ec2.describe_placement_groups(GroupNames=[name])["PlacementGroups"]
    except ClientError as exc:
        if exc.response["Error"]["Code"] in ("InvalidPlacementGroup.Unknown", "InvalidGroup.NotFound"):
            return None
        raise
    return groups[0] if groups else None


def check_group(
    compute: Sequence[Instance], group_name: str | None, group: dict[str, Any] | None
) -> CheckResult:
    if group_name is None:
        names = sorted({i.placement_group for i in compute if i.placement_group})
        if names:
            return failed(GROUP_CHECK, f"compute nodes span several placement groups ({', '.join(names)})")
        return failed(GROUP_CHECK, "no compute node is in a placement group; pass --placement-group NAME")
    if group is None:
        return failed(GROUP_CHECK, f"placement group {group_name!r} does not exist in this region")
    if group.get("State") != "available":
        return failed(GROUP_CHECK, f"placement group {group_name!r} is {group.get('State')}, not available")
    if group.get("Strategy") != "cluster":
        return failed(
            GROUP_CHECK,
            f"placement group {group_name!r} has strategy {group.get('Strategy')}; "
            "EFA fleets need strategy cluster (one low-latency network segment)",
        )
    return passed(GROUP_CHECK, f"{group_name} exists, strategy cluster, available")


def check_capacity(
    compute: Sequence[Instance], group_name: str | None, group: dict[str, Any] | None
) -> CheckResult:
    if group_name is None or group is None:
        return skipped(CAPACITY_CHECK, "no placement group to check")
    if not compute:
        return skipped(CAPACITY_CHECK, "no compute nodes")
    outside = [i for i in compute if i.placement_group != group_name]
    if outside:
        listed = ", ".join(f"{i.instance_id} ({i.placement_group or 'no group'})" for i in outside)
        return failed(
            CAPACITY_CHECK,
            f"{len(outside)} of {len(compute)} compute nodes run outside {group_name}: {listed}; "
            "the group could not place them (insufficient capacity) or they were launched without it - "
            "relaunch them into the group or use a capacity reservation",
        )
    return passed(CAPACITY_CHECK, f"all {len(compute)} compute nodes are placed in {group_name}")


def run(ec2: Any, compute: Sequence[Instance], requested: str | None) -> list[CheckResult]:
    name = resolve_group_name(compute, requested)
    group = describe_group(ec2, name) if name else None
    return [check_group(compute, name, group), check_capacity(compute, name, group)]
