"""playbooks/drift.yml on lab hosts: node manifest vs the AMI's tags vs versions.yml.

EC2 is moto_server (a test double); the nodes are real lab hosts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

import labtools
from gpuforge import versions

if TYPE_CHECKING:
    from conftest import PlaybookRunner

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[1]
# The managed files of the one role the baked fixture ran (not the whole site.yml, which these hosts
# never got): the file check runs that playbook in check mode.
ONLY_COMMON = ["-e", json.dumps({"gpuforge_drift_playbooks": [str(REPO / "molecule/default/converge.yml")]})]


@pytest.fixture(scope="module")
def baked(fleet_lab: dict[str, str], run_playbook: PlaybookRunner) -> dict[str, str]:
    # Only the role that writes the manifest; the full bake is covered by Molecule.
    result = run_playbook(fleet_lab, "molecule/default/converge.yml")
    assert result.returncode == 0, result.stdout[-3000:]
    return fleet_lab


def _lab_images(env: dict[str, str]) -> tuple[Any, list[str]]:
    """The lab's EC2 client and the images its hosts run."""
    client = labtools.lab_client(env, "ec2")
    images = {i["ImageId"] for r in client.describe_instances()["Reservations"] for i in r["Instances"]}
    return client, sorted(images)


def _tag_lab_image(env: dict[str, str], tags: dict[str, str]) -> None:
    client, images = _lab_images(env)
    client.create_tags(Resources=images, Tags=[{"Key": k, "Value": v} for k, v in tags.items()])


def test_fresh_nodes_match_versions_yml_and_their_image(
    baked: dict[str, str], run_playbook: PlaybookRunner
) -> None:
    _tag_lab_image(baked, versions.load().image_tags())
    result = run_playbook(baked, "playbooks/drift.yml", *ONLY_COMMON)
    assert result.returncode == 0, result.stdout[-3000:]
    assert result.stdout.count("up to date with versions.yml") == 2
    assert result.stdout.count("matches the node") == 2


def test_a_changed_pin_is_reported_as_drift(
    baked: dict[str, str], tmp_path: Path, run_playbook: PlaybookRunner
) -> None:
    manifest = versions.load()
    bumped = {name: dict(pins) for name, pins in manifest.components.items()}
    bumped["nccl"]["version"] = bumped["nccl"]["version"] + ".1"
    newer = tmp_path / "versions.yml"
    newer.write_text(yaml.safe_dump({"gpuforge_versions": bumped}))
    result = run_playbook(
        baked, "playbooks/drift.yml", *ONLY_COMMON, "-e", f"gpuforge_common_versions_file={newer}"
    )
    assert result.returncode == 2, result.stdout[-3000:]
    assert "drifted from versions.yml" in result.stdout
    report_only = run_playbook(
        baked,
        "playbooks/drift.yml",
        *ONLY_COMMON,
        "-e",
        f"gpuforge_common_versions_file={newer}",
        "-e",
        "gpuforge_drift_fail=false",
    )
    assert report_only.returncode == 0
    assert report_only.stdout.count("DRIFT: node pins") == 2


def test_an_edited_managed_file_is_reported_for_its_host_only(
    baked: dict[str, str], run_playbook: PlaybookRunner
) -> None:
    """A hand-edited file the roles manage is drift (check mode with diff), even with matching pins."""
    _tag_lab_image(baked, versions.load().image_tags())
    manifest = "/etc/gpuforge/manifest.json"
    labtools.on(baked["GPUFORGE_LAB"], "gpu-st-p5-48xlarge-1", f"echo >> {manifest}")
    try:
        result = run_playbook(baked, "playbooks/drift.yml", *ONLY_COMMON)
        assert result.returncode == 2, result.stdout[-3000:]
        assert (
            result.stdout.count(
                f"DRIFT: 1 managed file(s) differ from what the roles would write: {manifest}"
            )
            == 1
        )
        assert result.stdout.count("managed files as the roles would write them") == 1
        assert "has managed files that differ from what the roles would write" in result.stdout
        report_only = run_playbook(
            baked, "playbooks/drift.yml", *ONLY_COMMON, "-e", "gpuforge_drift_fail=false"
        )
        assert report_only.returncode == 0, report_only.stdout[-3000:]
        # The versions check still sees matching pins: only the file differs.
        assert report_only.stdout.count("up to date with versions.yml") == 2
    finally:
        repaired = run_playbook(baked, "molecule/default/converge.yml")
        assert repaired.returncode == 0, repaired.stdout[-3000:]


def test_installed_release_differing_from_the_image_is_drift(
    baked: dict[str, str], run_playbook: PlaybookRunner
) -> None:
    """The image recorded an installed release (gpuforge:installed:*) the node does not have: drift,
    even though the pins' hashes agree."""
    _tag_lab_image(baked, {**versions.load().image_tags(), "gpuforge:installed:nccl": "2.30.7/gpuforge"})
    result = run_playbook(baked, "playbooks/drift.yml", *ONLY_COMMON)
    assert result.returncode == 2, result.stdout[-3000:]
    assert result.stdout.count("up to date with versions.yml") == 2
    drift = "DRIFT: installed differs from the image: nccl absent (image 2.30.7/gpuforge)"
    assert " ".join(result.stdout.split()).count(drift) == 2
    # Put the image back as it was for the other tests of this module.
    client_tags = {"gpuforge:installed:nccl": ""}
    _untag_lab_image(baked, client_tags)


def _untag_lab_image(env: dict[str, str], tags: dict[str, str]) -> None:
    client, images = _lab_images(env)
    client.delete_tags(Resources=images, Tags=[{"Key": k} for k in tags])
