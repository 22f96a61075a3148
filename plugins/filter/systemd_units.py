"""Ansible filter: the units a role must still start and enable, from one `systemctl show`.

The slurm role used to run the systemd module once per daemon (munge, then slurmctld or slurmd) on
every run; each is a round trip even when all are running and enabled. It now reads them in one:

    command: systemctl show --property=Id,ActiveState,UnitFileState -- munge.service slurmd.service
    loop: "{{ shown.stdout | gpuforge.gpu.units_to_start }}"

and the systemd module runs only for the units this returns, in the order they were shown.
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError, AnsibleUndefinedVariable
from jinja2 import Undefined


def units_to_start(shown: Any) -> list[str]:
    """Ids of the units in `systemctl show` output (blocks split by blank lines) that are not both
    active and enabled: not found, inactive, failed, activating, disabled, masked, static..."""
    if isinstance(shown, Undefined):
        # A loop is templated before the task's `when`. ansible-core 2.19 never hands a filter an
        # undefined value (it raises the undefined error itself); 2.17 (the node runtime,
        # roles/gpuforge_node) does, and defers only an undefined error until `when` is known. So:
        # an undefined error here, and a task skipped by its `when` (the `systemctl show` task it
        # reads was skipped too) stays skipped instead of failing.
        raise AnsibleUndefinedVariable("units_to_start: the systemctl show result is undefined")
    if not isinstance(shown, str):
        raise AnsibleFilterError("units_to_start: the stdout of systemctl show, a string")
    units: list[str] = []
    for block in shown.strip().split("\n\n"):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if "Id" not in props:
            raise AnsibleFilterError(
                f"units_to_start: no Id= in a block of systemctl show output (add --property=Id): {block!r}"
            )
        if props.get("ActiveState") != "active" or props.get("UnitFileState") != "enabled":
            units.append(props["Id"])
    return units


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict[str, Any]:
        return {"units_to_start": units_to_start}
