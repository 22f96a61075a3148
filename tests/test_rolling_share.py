"""playbooks/tasks/queue_share.yml: a rolling update never drains more than a set share of a queue.

The check runs on the control host (connection local) over an inventory of five compute nodes:
four in queue `gpu`, one in `small`; nothing is drained, only the batches are checked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
INVENTORY = {
    "all": {
        "children": {
            "compute": {
                "hosts": {
                    **{f"g{n}": {"gpuforge_queue": "gpu"} for n in range(1, 5)},
                    "s1": {"gpuforge_queue": "small"},
                }
            }
        },
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
    }
}


def run(tmp_path: Path, serial: str, share: float | None = None) -> subprocess.CompletedProcess[str]:
    play = [
        {
            "name": "Batches as rolling_update.yml makes them",
            "hosts": "compute",
            "gather_facts": False,
            "serial": serial,
            "tasks": [
                {"ansible.builtin.import_tasks": str(REPO / "playbooks" / "tasks" / "queue_share.yml")},
                {"name": "Passed", "ansible.builtin.debug": {"msg": "batch passed"}},
            ],
        }
    ]
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump(INVENTORY))
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    extra = ["-e", f"rolling_update_max_queue_share={share}"] if share is not None else []
    return subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            str(tmp_path / "inventory.yml"),
            str(tmp_path / "play.yml"),
            *extra,
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={"PATH": f"{BIN}:/usr/bin:/bin", "ANSIBLE_NOCOLOR": "1", "HOME": str(tmp_path)},
    )


@pytest.mark.parametrize(
    ("serial", "share", "refused"),
    [
        ("1", None, False),  # one node at a time: always within the share
        ("2", None, True),  # 2 of 4 gpu nodes > 25 %
        ("2", 0.5, False),  # 2 of 4 = 50 %
        ("40%", None, True),  # percentages of the compute group work the same way
    ],
)
def test_a_batch_over_the_queue_share_is_refused_before_draining(
    tmp_path: Path, serial: str, share: float | None, refused: bool
) -> None:
    out = run(tmp_path, serial, share)
    if refused:
        assert out.returncode != 0
        assert "would drain 2 of the 4 nodes of queue gpu at once" in out.stdout + out.stderr
        assert "batch passed" not in out.stdout
    else:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert out.stdout.count("batch passed") == 5


def test_rolling_update_runs_the_check_first() -> None:
    play = yaml.safe_load((REPO / "playbooks" / "rolling_update.yml").read_text())[1]
    assert play["tasks"][0]["ansible.builtin.import_tasks"] == "tasks/queue_share.yml"
    assert play["serial"] == "{{ rolling_update_serial | default(1) }}"


@pytest.mark.parametrize("playbook", ["playbooks/bake.yml", "playbooks/fleet.yml"])
def test_site_plays_take_serial_and_max_fail_percentage_from_the_documented_variables(playbook: str) -> None:
    # The play that does the work (bake.yml first decides the golden fast path, in a play of its own).
    play = yaml.safe_load((REPO / playbook).read_text())[-1]
    assert play["serial"] == "{{ gpuforge_serial | default('100%') }}"
    assert play["max_fail_percentage"] == "{{ gpuforge_max_fail_percentage | default(100) }}"
    docs = (REPO / "docs" / "reliability.md").read_text()
    for variable in ("gpuforge_serial", "gpuforge_max_fail_percentage", "rolling_update_max_queue_share"):
        assert f"`-e {variable}" in docs or f"`{variable}`" in docs
