"""Action plugin gpuforge.gpu.component: the one writer of the node record (docs/architecture.md#reality).

A stack role calls it once per component with what it knows; it decides through the version policy
(plugins/plugin_utils/node_record.py over policy.py), returns the record with the component's entry as
the fact gpuforge_reality, prints the one line about it, and fails with the policy's message on a
refusal. It reads the previous manifest and the downgrade opt-in from the play itself (gpuforge_common
publishes both), so no role passes them. Runs on the controller; documented in
plugins/modules/component.py.

The record is a fact (ansible_facts.gpuforge_reality, which the roles read; no role writes it by
set_fact, which would only make a second, top-level gpuforge_reality that no role reads). Facts
outlive a run in the fact cache (ansible.cfg: jsonfile), so gpuforge_common starts each run's record
empty (`begin: true`, roles/gpuforge_common/tasks/load_data.yml).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.action import ActionBase
from ansible_collections.gpuforge.gpu.plugins.plugin_utils import node_record
from ansible_collections.gpuforge.gpu.plugins.plugin_utils.policy import ALLOW_DOWNGRADE_VARIABLE

RECORD = "gpuforge_reality"
PREVIOUS_MANIFEST = "gpuforge_previous_manifest"

ARGUMENT_SPEC: dict[str, Any] = {
    "begin": {"type": "bool", "default": False},
    "component": {"type": "str"},
    "installed": {"type": "str", "default": ""},
    "pin": {"type": "str"},
    "floor": {"type": "str"},
    "compatible": {"type": "bool", "default": True},
    "incompatible_reason": {"type": "str", "default": ""},
    "ours": {"type": "str", "default": ""},
    "installable": {"type": "bool", "default": True},
    "details": {"type": "dict", "default": {}},
    "kept_details": {"type": "dict", "default": {}},
}


def _text(value: Any) -> str:
    return "" if value is None else str(value).strip()


class ActionModule(ActionBase):
    """Decide about one component and record it in the node record."""

    TRANSFERS_FILES = False
    _requires_connection = False
    _supports_check_mode = True

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = super().run(tmp, task_vars)
        task_vars = task_vars or {}
        # The strategy keeps a looped task's facts from its last item, gives a run_once task's facts to
        # every host and a delegated task's to the delegate (delegate_facts): each would record a wrong
        # record. The task's own loop only: a role included in a loop (rolling_update.yml) runs this once
        # per host.
        # (with_<lookup> sets the task's loop too: ansible-core playbook/task.py _preprocess_with_loop.)
        if self._task.loop is not None or self._task.run_once or self._task.delegate_to:
            return {
                **result,
                "failed": True,
                "msg": "gpuforge.gpu.component: call it once per component on the host it decides for "
                "(no loop, run_once or delegate_to)",
            }
        _validation, args = self.validate_argument_spec(
            argument_spec=ARGUMENT_SPEC,
            mutually_exclusive=[("begin", "component")],
            required_one_of=[("begin", "component")],
            required_by={"component": ("pin", "floor")},
        )
        if args["begin"]:
            return {**result, "changed": False, "ansible_facts": {RECORD: {}}}
        facts = task_vars.get("ansible_facts") or {}
        current = facts.get(RECORD) if isinstance(facts, Mapping) else None
        previous = self._templar.template(task_vars.get(PREVIOUS_MANIFEST, {}))
        allow = self._templar.template(task_vars.get(ALLOW_DOWNGRADE_VARIABLE, False))
        try:
            done = node_record.record(
                current if isinstance(current, Mapping) else {},
                _text(args["component"]),
                installed=_text(args["installed"]),
                pin=_text(args["pin"]),
                floor=_text(args["floor"]),
                compatible=args["compatible"],
                incompatible_reason=_text(args["incompatible_reason"]),
                ours=_text(args["ours"]),
                installable=args["installable"],
                details=args["details"],
                kept_details=args["kept_details"],
                allow_downgrade=boolean(allow, strict=False),
                previous_manifest=previous if isinstance(previous, Mapping) else None,
            )
        except ValueError as exc:
            return {**result, "failed": True, "msg": f"gpuforge.gpu.component: {exc}"}
        if done.refused:
            return {**result, "failed": True, "changed": False, "msg": done.message}
        return {
            **result,
            "changed": False,
            "msg": done.message,
            "outcome": done.outcome,
            "ansible_facts": {RECORD: done.record},
            # Printed at the default verbosity, as debug prints: the one line about the component.
            "_ansible_verbose_always": True,
        }
