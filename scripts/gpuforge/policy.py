"""The version policy, for the CLI: adopt what a host has, install the pin, or refuse to downgrade.

The decision lives once, in the collection (plugins/module_utils/policy.py, installed with the wheel as
ansible_collections.gpuforge.gpu); the roles call the same code through the filter
gpuforge.gpu.version_decision. This module only re-exports it under its old name.
"""

from __future__ import annotations

from ansible_collections.gpuforge.gpu.plugins.module_utils.policy import (
    ALLOW_DOWNGRADE_VARIABLE,
    SOURCES,
    Action,
    Decision,
    Source,
    compare,
    decide,
    upstream_version,
    version_key,
)

__all__ = [
    "ALLOW_DOWNGRADE_VARIABLE",
    "SOURCES",
    "Action",
    "Decision",
    "Source",
    "compare",
    "decide",
    "upstream_version",
    "version_key",
]
