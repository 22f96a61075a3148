"""The golden fast path's promises that a reading of the playbooks can check (the decision itself:
tests/test_node_manifest.py; on a lab host from a baked image: tests/test_ami_local_bake.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BAKE = yaml.safe_load((REPO / "playbooks/bake.yml").read_text())
INSTALL_PLAY = next(p for p in BAKE if p["name"] == "Bake the GPU software stack")
INSTALL_ROLES = [r["role"].rsplit(".", 1)[-1] for r in INSTALL_PLAY["roles"]]
FLEET_PLAY = yaml.safe_load((REPO / "playbooks/fleet.yml").read_text())[0]
FLEET_ROLES = [r["role"].rsplit(".", 1)[-1] for r in FLEET_PLAY["roles"]]


def _tasks(role: str) -> list[dict[str, Any]]:
    tasks: list[dict[str, Any]] = yaml.safe_load((REPO / "roles" / role / "tasks/main.yml").read_text())
    return tasks


@pytest.mark.parametrize("role", [r for r in INSTALL_ROLES if r not in FLEET_ROLES])
def test_every_configure_task_of_an_install_role_is_baked(role: str) -> None:
    """A golden node skips the install play: whatever it configures must already be in the image.

    A role the fleet play runs too (slurm) configures there, golden node or not.
    """
    left_out = [
        t["name"]
        for t in _tasks(role)
        if "configure" in t.get("tags", []) and not {"install", "always"} & set(t.get("tags", []))
    ]
    assert left_out == [], f"{role}: tagged configure but not install (Packer never runs them)"


def test_the_install_play_leaves_golden_hosts_out_after_one_decision() -> None:
    decision = BAKE[0]
    assert decision["hosts"] == INSTALL_PLAY["hosts"].split("{{ ':!")[0]
    assert decision["gather_facts"] is False
    assert ":!gpuforge_golden" in INSTALL_PLAY["hosts"]
    assert [t.get("ansible.builtin.import_role", {}).get("tasks_from") for t in decision["tasks"][:2]] == [
        "load_data.yml",
        "read_manifest.yml",
    ]
    # The decision itself is the collection's filter (plugins/plugin_utils/fast_path.py), no Jinja copy.
    decide = decision["tasks"][2]
    assert set(decide["ansible.builtin.set_fact"]) == {"gpuforge_fast_path", "gpuforge_fast_path_reason"}
    assert "gpuforge_previous_manifest | gpuforge.gpu.fast_path(gpuforge_versions_hash," in " ".join(
        decide["vars"]["_bake_decision"].split()
    )
    assert "full_install=gpuforge_full_install" in decide["vars"]["_bake_decision"]
    assert not (REPO / "roles/gpuforge_common/tasks/fast_path.yml").exists()
    assert all("always" in t["tags"] for t in decision["tasks"])


@pytest.mark.parametrize(
    ("path", "text"),
    [
        # A bake never trusts its builder's manifest; the drift check looks at golden nodes' install roles.
        ("packer/gpuforge.pkr.hcl", '"-e", "gpuforge_full_install=true"'),
        ("playbooks/drift.yml", "['--extra-vars', 'gpuforge_full_install=true']"),
    ],
)
def test_bakes_and_the_drift_check_ask_for_the_full_install(path: str, text: str) -> None:
    assert text in (REPO / path).read_text()


def test_the_image_carries_slurm_and_a_golden_node_only_configures_it() -> None:
    """The install play installs munge and the Slurm daemons (install part only); the fleet play
    configures them and runs the apt check only where no install phase ran before it."""
    (slurm,) = [r for r in INSTALL_PLAY["roles"] if r["role"] == "gpuforge.gpu.slurm"]
    assert slurm["vars"] == {"_slurm_install_phase": True}
    assert "slurm" in FLEET_ROLES
    main = {t["name"]: t for t in _tasks("slurm")}
    install = main["Install munge and the Slurm daemons"]
    assert install["tags"] == ["install"] and "_slurm_install_here | bool" in install["when"]
    for name, task in main.items():
        if "configure" in task.get("tags", []):
            assert "not _slurm_install_phase | default(false) | bool" in task["when"], name
    # The role reads its own argument, not a fact bake.yml set: site.yml says where the install phase ran.
    here = yaml.safe_load((REPO / "roles/slurm/vars/main.yml").read_text())["_slurm_install_here"]
    assert "not slurm_install_phase_ran | bool" in here and "gpuforge_fast_path" not in here
    assert (
        yaml.safe_load((REPO / "roles/slurm/defaults/main.yml").read_text())["slurm_install_phase_ran"]
        is False
    )
    (_, fleet) = yaml.safe_load((REPO / "site.yml").read_text())
    assert fleet["vars"] == {"slurm_install_phase_ran": "{{ gpuforge_fast_path is defined }}"}
