"""playbooks/drift.yml on lab hosts: node manifest vs the AMI's tags vs versions.yml.

EC2 is moto_server (a test double); the nodes are real lab hosts.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from ansible_collections.gpuforge.gpu.plugins.plugin_utils import fast_path

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
        # A file a converge writes (this play is no install playbook's): a converge of that host puts it back.
        assert re.search(
            rf"DRIFT: 1 managed file\(s\) differ from what the roles would write: {manifest}; "
            r"to put them back: ansible-playbook site.yml --limit \S+ \(",
            " ".join(result.stdout.split()),
        ), result.stdout[-3000:]
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


def test_a_file_of_the_install_phase_on_a_golden_node_needs_a_full_install(
    baked: dict[str, str], tmp_path: Path, run_playbook: PlaybookRunner
) -> None:
    """The least remedy: the install play's file on a golden node (its converge skips that play) is put
    back only by `-e gpuforge_full_install=true`; the same file on a node that is not golden by a converge.
    The one role's play stands for the install playbook here under its name, bake.yml."""
    _tag_lab_image(baked, versions.load().image_tags())
    bake = tmp_path / "bake.yml"
    bake.write_text((REPO / "molecule/default/converge.yml").read_text())
    as_install = ["-e", json.dumps({"gpuforge_drift_playbooks": [str(bake)], "gpuforge_drift_fail": False})]
    manifest = "/etc/gpuforge/manifest.json"
    golden = "gpu-st-p5-48xlarge-1"
    # This node's manifest says a whole install phase ran for the current pins and its type: golden.
    done = fast_path.completed(versions.load().digest, ["p5.48xlarge"])
    edit = (
        f"import json; m = json.load(open('{manifest}')); m['completed'] = {done!r}; "
        f"json.dump(m, open('{manifest}', 'w'))"
    )
    lab = baked["GPUFORGE_LAB"]
    labtools.on(lab, golden, f"python3 -c {shlex.quote(edit)}")
    try:
        result = run_playbook(baked, "playbooks/drift.yml", *as_install)
        assert result.returncode == 0, result.stdout[-3000:]
        text = " ".join(result.stdout.split())
        drifted = "DRIFT: 1 managed file(s) differ from what the roles would write"
        assert text.count(drifted) == 1, text[-3000:]
        assert re.search(
            rf"write: {manifest}; to put them back: ansible-playbook site.yml --limit \S+ "
            r"-e gpuforge_full_install=true \(",
            text,
        ), result.stdout[-3000:]
    finally:
        drop = edit.replace(f"m['completed'] = {done!r}", "m.pop('completed', None)")
        labtools.on(lab, golden, f"python3 -c {shlex.quote(drop)}")
        repaired = run_playbook(baked, "molecule/default/converge.yml")
        assert repaired.returncode == 0, repaired.stdout[-3000:]
