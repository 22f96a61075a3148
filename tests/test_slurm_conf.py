"""slurm.conf's timers: the role's values, each replaced by a key of slurm_extra_config, never written twice
(slurmd and slurmctld log an error for every repeated key)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
ROLE = REPO / "roles/slurm"
TIMERS = yaml.safe_load((ROLE / "vars/main.yml").read_text())["_slurm_timers"]


def render(extra: dict[str, Any]) -> list[str]:
    """The template's lines for a head node alone (the same template every node gets)."""
    env = jinja2.Environment(  # noqa: S701 - slurm.conf, not HTML
        loader=jinja2.FileSystemLoader(ROLE / "templates"), undefined=jinja2.StrictUndefined
    )
    head = {"inventory_hostname": "head", "ansible_host": "10.0.0.2"}
    text = env.get_template("etc/slurm/slurm.conf.j2").render(
        ansible_managed="managed",
        slurm_cluster_name="lab",
        hostvars={"head": head},
        groups={"head_node": ["head"]},
        slurm_head_group="head_node",
        _slurm_nodes={"head": {"hostname": "head"}},
        _slurm_user="slurm",
        slurm_slurmctld_port=6817,
        slurm_slurmd_port=6818,
        slurm_state_save_location="/var/spool/slurmctld",
        slurm_slurmd_spool_dir="/var/spool/slurmd",
        slurm_proctrack_type="proctrack/linuxproc",
        slurm_task_plugin="task/none",
        _slurm_config_dir="/etc/slurm",
        slurm_task_prolog_path="/etc/slurm/task_prolog.sh",
        _slurm_timers=TIMERS,
        slurm_extra_config=extra,
        _slurm_described=[],
        _slurm_gpus={},
        slurm_default_partition="gpu",
        slurm_placeholder_node="placeholder",
        slurm_memory_reserve_mb=0,
    )
    return text.splitlines()


def test_the_prolog_may_take_minutes_before_the_batch_launch_gives_up() -> None:
    lines = render({})
    assert "BatchStartTimeout=180" in lines
    assert "MessageTimeout=60" in lines
    # Slurm 24.05 logs an error when UnkillableStepTimeout is under five MessageTimeouts.
    assert TIMERS["UnkillableStepTimeout"] >= 5 * TIMERS["MessageTimeout"]
    assert f"UnkillableStepTimeout={TIMERS['UnkillableStepTimeout']}" in lines


@pytest.mark.parametrize("key", ["MessageTimeout", "messagetimeout"])
def test_a_key_of_the_extra_config_replaces_the_roles_value_once(key: str) -> None:
    lines = render({key: 30, "SlurmctldDebug": "debug"})
    keys = [line.split("=", 1)[0].lower() for line in lines if "=" in line and not line.startswith("#")]
    assert keys.count("messagetimeout") == 1
    assert f"{key}=30" in lines
    assert "SlurmctldDebug=debug" in lines and "BatchStartTimeout=180" in lines
