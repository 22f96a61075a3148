"""The gpuforge.gpu.units_to_start filter: which daemons the slurm role still has to start, read from
one `systemctl show` (roles/slurm/tasks/services.yml)."""

from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError

import sourcefile

systemd_units = sourcefile.load("systemd_units", "plugins/filter/systemd_units.py")


def _shown(*units: tuple[str, str, str]) -> str:
    # systemctl show prints the properties in its own order, one block per unit, blank-line separated.
    return (
        "\n\n".join(
            f"ActiveState={active}\nUnitFileState={enabled}\nId={unit}" for unit, active, enabled in units
        )
        + "\n"
    )


def test_only_units_not_both_active_and_enabled_are_returned_in_the_order_shown() -> None:
    shown = _shown(
        ("munge.service", "active", "enabled"),
        ("slurmctld.service", "failed", "enabled"),
        ("slurmd.service", "active", "disabled"),
    )
    assert systemd_units.units_to_start(shown) == ["slurmctld.service", "slurmd.service"]


@pytest.mark.parametrize(
    ("active", "enabled"),
    [
        ("inactive", ""),
        ("activating", "enabled"),
        ("active", "masked"),
        ("active", "static"),
        ("inactive", "enabled"),
    ],
    ids=["not-found", "activating", "masked", "static", "stopped"],
)
def test_anything_short_of_running_and_enabled_is_started(active: str, enabled: str) -> None:
    assert systemd_units.units_to_start(_shown(("slurmd.service", active, enabled))) == ["slurmd.service"]


def test_all_running_and_enabled_means_nothing_to_do() -> None:
    shown = _shown(("munge.service", "active", "enabled"), ("slurmd.service", "active", "enabled"))
    assert systemd_units.units_to_start(shown) == []


def test_output_without_ids_is_refused_rather_than_guessed() -> None:
    with pytest.raises(AnsibleFilterError, match="no Id="):
        systemd_units.units_to_start("ActiveState=active\nUnitFileState=enabled\n")
    with pytest.raises(AnsibleFilterError, match="a string"):
        systemd_units.units_to_start(None)
