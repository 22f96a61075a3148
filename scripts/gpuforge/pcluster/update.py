"""What `pcluster update-cluster` will do with a changed cluster config, from ParallelCluster's own code.

`pcluster update-cluster` (aws-parallelcluster 3.16.1, pcluster/models/cluster.py Cluster._validate_patch)
compares the deployed config with the new one in `pcluster.config.config_patch.ConfigPatch` and checks
each change against the update policy its schema field carries (pcluster/schemas/cluster_schema.py,
policies in pcluster/config/update_policy.py). This module runs that same ConfigPatch on two configs;
nothing here restates a policy.

What cannot run offline, and what stands in for it: ConfigPatch.check() asks the cluster object three
things that `pcluster` reads from AWS: `has_running_capacity()` (the compute fleet status in the
cluster's DynamoDB table), `has_running_login_nodes()` (login pool target health) and
`head_node_instance.state` (EC2 DescribeInstances). Without a cluster to ask, `_AssumedCluster` answers
with the state given (by default the worst case: compute fleet and login nodes running, head node
running), so a change reported as accepted is accepted whatever the cluster's state. The old config is
the file as it was before the edit: the result holds for a cluster deployed from that file.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpuforge.pcluster.validate import config_region, region_env

LOG = logging.getLogger(__name__)

# What each queue update strategy does to the nodes of a queue whose settings changed
# (https://docs.aws.amazon.com/parallelcluster/latest/ug/Scheduling-v3.html, SlurmSettings /
# QueueUpdateStrategy; the values are pcluster.config.cluster_config.QueueUpdateStrategy's).
STRATEGY_EFFECTS = {
    "DRAIN": "the queue's nodes are drained: running jobs finish, no new job starts on them, and each "
    "node is replaced with the new settings once idle (no job is killed)",
    "TERMINATE": "the queue's nodes are terminated at once and replaced with the new settings (running "
    "jobs are killed and requeued)",
    "COMPUTE_FLEET_STOP": "the compute fleet must be stopped first (pcluster update-compute-fleet "
    "--status STOP_REQUESTED); nodes start with the new settings when it is started again",
}
DEFAULT_STRATEGY = "COMPUTE_FLEET_STOP"  # ParallelCluster's default when the config sets none


@dataclass(frozen=True)
class _Instance:
    state: str


class _AssumedCluster:
    """The three answers ConfigPatch needs from a cluster, given instead of read from AWS."""

    def __init__(self, fleet_running: bool, login_nodes_running: bool) -> None:
        self.name = "gpuforge-update-check"
        self.stack_name = self.name
        self._fleet_running = fleet_running
        self._login_nodes_running = login_nodes_running
        self.head_node_instance = _Instance("running")

    def has_running_capacity(self, updated_value: bool = False) -> bool:
        return self._fleet_running

    def has_running_login_nodes(self, updated_value: bool = False, pool_name: str | None = None) -> bool:
        return self._login_nodes_running


@dataclass(frozen=True)
class Change:
    """One row of ConfigPatch.check(): a changed setting, its update policy and pcluster's verdict."""

    path: str
    old: Any
    new: Any
    policy: str
    result: str  # SUCCEEDED, ACTION NEEDED or FAILED (UpdatePolicy.CheckResult values)
    reason: str
    action: str

    @property
    def accepted(self) -> bool:
        return self.result == "SUCCEEDED"


@dataclass(frozen=True)
class Plan:
    changes: tuple[Change, ...]
    accepted: bool  # ConfigPatch.check()'s patch_allowed
    strategy: str
    fleet_running: bool

    def lines(self) -> Iterator[str]:
        """What `pcluster update-cluster` will do, one line per change, for people."""
        if not self.changes:
            yield "pcluster update-cluster: no change it acts on"
            return
        verdict = "accepts" if self.accepted else "refuses"
        fleet = "compute fleet running" if self.fleet_running else "compute fleet stopped"
        yield f"pcluster update-cluster {verdict} this change ({fleet}, QueueUpdateStrategy {self.strategy}):"
        for change in self.changes:
            yield f"  {change.path}: {change.old} -> {change.new} [{change.policy}: {change.result}]"
            if not change.accepted:
                yield f"    why: {change.reason}; to do: {change.action}"
            elif change.policy == "QUEUE_UPDATE_STRATEGY" and self.fleet_running:
                yield f"    {STRATEGY_EFFECTS[self.strategy]}"


def _value(value: Any) -> Any:
    return "-" if value is None else value


def _strategy(config: dict[str, Any]) -> str:
    settings = (config.get("Scheduling") or {}).get("SlurmSettings") or {}
    return str(settings.get("QueueUpdateStrategy") or DEFAULT_STRATEGY)


def plan(
    old: dict[str, Any],
    new: dict[str, Any],
    *,
    fleet_running: bool = True,
    login_nodes_running: bool = True,
) -> Plan:
    """Run ParallelCluster's ConfigPatch on old -> new (plain dicts, as `pcluster` parses them)."""
    # Imported here: ConfigPatch pulls in ParallelCluster's whole config model.
    from pcluster.config.config_patch import ConfigPatch

    cluster = _AssumedCluster(fleet_running, login_nodes_running)
    # The ADC-region policy (UpdatePolicy.SUPPORTED_UNLESS_ADC) reads the region from boto3's session.
    with region_env(config_region(new)):
        patch = ConfigPatch(cluster, copy.deepcopy(old), copy.deepcopy(new))
        accepted, rows = patch.check()
    header, *body = rows
    index = {name: i for i, name in enumerate(header)}
    changes = tuple(
        Change(
            path=ConfigPatch.build_config_param_path(row[index["param_path"]], row[index["parameter"]]),
            old=_value(row[index["old value"]]),
            new=_value(row[index["new value"]]),
            policy=str(row[index["update_policy"]]),
            result=str(row[index["check"]]),
            reason=str(row[index["reason"]]),
            action=str(row[index["action_needed"]] or "-"),
        )
        for row in body
    )
    return Plan(changes, bool(accepted), _strategy(new), fleet_running)
