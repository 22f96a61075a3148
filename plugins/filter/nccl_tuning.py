"""Select the NCCL/EFA settings that still apply to a node's hardware and software versions.

The role passes every candidate setting with the conditions under which it matters; this filter
returns the settings to write and, for each one left out, the reason, so a play can report why
a setting the seed asked for is not on the node.
"""

from __future__ import annotations

import re
from typing import Any

from ansible_collections.gpuforge.gpu.plugins.plugin_utils.policy import compare

_VERSION = re.compile(r"\d+(?:\.\d+)*")

# Conditions a candidate may carry: each compares one probed version with an exclusive upper bound.
_BOUNDS = {
    "kernel_before": "kernel",
    "libfabric_before": "libfabric",
    "aws_ofi_nccl_before": "aws_ofi_nccl",
}


def _release(text: str) -> str:
    """A probed version as the policy compares it: without surrounding blanks or a leading 'v'."""
    return str(text).strip().lstrip("v")


def parse_version(text: str) -> tuple[int, ...] | None:
    """Leading dotted number of a version string ("1.22.0amzn4.0" -> (1, 22, 0)); None if there is none."""
    match = _VERSION.match(_release(text))
    if match is None:
        return None
    return tuple(int(part) for part in match.group(0).split("."))


def _below(found: str, bound: str) -> bool | None:
    """Whether version `found` sorts below `bound`, compared as the version policy compares
    (plugins/plugin_utils/policy.py: "6.8" == "6.8.0", "1.22.0amzn4.0" above "1.22.0"); None when
    either is not a version (no leading number)."""
    if parse_version(found) is None or parse_version(bound) is None:
        return None
    return compare(_release(found), _release(bound)) < 0


def _left_to_plugin(name: str, node: dict[str, Any]) -> str | None:
    """Why the aws-ofi-nccl plugin, not gpuforge, sets `name` on this node (None when it does not).

    node["plugin_env"] is what the plugin sets itself on the node's instance type
    (data/instance_types.yml aws_ofi_nccl.env); it applies them only where the variable is unset, so
    a value gpuforge wrote would replace the plugin's own. Only when NCCL traffic goes through the
    plugin ("ofi"), and not for a name listed in node["plugin_overrides"] (an override on purpose).
    """
    plugin_env = node.get("plugin_env") or {}
    if (
        node.get("transport") != "ofi"
        or name not in plugin_env
        or name in (node.get("plugin_overrides") or [])
    ):
        return None
    where = node.get("instance_type") or "this instance type"
    return (
        f"the aws-ofi-nccl plugin sets it itself on {where} ({name}={plugin_env[name]}, "
        "data/instance_types.yml); list it in nccl_tuning_plugin_overrides to override the plugin"
    )


def _reason_left_out(candidate: dict[str, Any], node: dict[str, Any]) -> str | None:
    """None when the candidate applies to the node, else why it does not."""
    if candidate.get("efa") and int(node.get("efa_interfaces", 0)) == 0:
        return "the instance type has no EFA interface"
    transport = candidate.get("transport")
    if transport is not None and transport != node.get("transport"):
        used = node.get("transport")
        return f"only read by NCCL's {transport} transport; this node's NCCL traffic uses {used}"
    plugin = _left_to_plugin(str(candidate["name"]), node)
    if plugin is not None:
        return plugin
    if "value" in candidate and str(candidate["value"]) == "":
        return "no value configured"
    bounds = [(key, field) for key, field in _BOUNDS.items() if key in candidate]
    if not bounds:
        return None
    # A setting with version bounds is a workaround for old software: it applies when any
    # of the named components is older than its bound.
    verdicts = []
    for key, field in bounds:
        found = str(node.get(field, ""))
        below = _below(found, str(candidate[key]))
        if below:
            return None
        verdicts.append(f"{field} {found or 'unknown'} is not below {candidate[key]}")
    return "; ".join(verdicts)


def nccl_tuning_select(candidates: list[dict[str, Any]], node: dict[str, Any]) -> dict[str, Any]:
    """Split candidates into {"applied": {name: value}, "left_out": [{"name", "reason"}]}.

    `node` holds efa_interfaces, transport, the probed versions (kernel, libfabric, aws_ofi_nccl),
    and instance_type, plugin_env and plugin_overrides (see _left_to_plugin). A later candidate
    with the same name replaces an earlier one (the role passes its group overrides last).
    """
    applied: dict[str, str] = {}
    left_out: list[dict[str, str]] = []
    for candidate in candidates:
        name = str(candidate["name"])
        reason = _reason_left_out(candidate, node)
        if reason is None:
            applied[name] = str(candidate["value"])
        else:
            applied.pop(name, None)
            left_out.append({"name": name, "reason": reason})
    return {"applied": applied, "left_out": left_out}


def nccl_tuning_describe(left_out: dict[str, str]) -> str:
    """One report line for a setting left out."""
    return f"{left_out['name']} not set: {left_out['reason']}"


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict[str, Any]:
        return {"nccl_tuning_select": nccl_tuning_select, "nccl_tuning_describe": nccl_tuning_describe}
