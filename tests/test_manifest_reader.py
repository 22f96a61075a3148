"""The node manifest's one reader and the drift check's comparison, in the collection
(plugins/plugin_utils/manifest.py): the CLI's gpuforge.node_manifest reads the file with it, the roles call it
through the filters gpuforge.gpu.node_manifest (roles/gpuforge_common/tasks/read_manifest.yml) and
gpuforge.gpu.manifest_drift (playbooks/drift.yml). read_manifest.yml had its own Jinja upgrade of
schema 1 without the validation, and drift.yml its own tag format, tag prefix and floor loop.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from ansible_collections.gpuforge.gpu.plugins.plugin_utils import manifest

import sourcefile
from gpuforge import node_manifest, versions
from gpuforge.errors import UserError
from localplay import REPO, record, run_cases

FILTERS = sourcefile.load("manifest_filters", "plugins/filter/manifest.py").FilterModule().filters()
PINS = versions.load()
DCGM = PINS.version("dcgm")
EXPORTER = PINS.version("dcgm_exporter")
SCHEMA2 = {
    "schema": 2,
    "versions_hash": PINS.digest,
    "pins": PINS.components,
    "installed": {
        "nvidia_driver": {"version": "580.105.08", "source": "base_image"},
        "dcgm": {"version": DCGM, "source": "gpuforge"},
    },
}
GOOD: dict[str, Any] = {
    "schema-2": SCHEMA2,
    "schema-1": {"versions_hash": "abc", "components": {"nccl": {"version": "2.21.5"}}},
}
# Files that are not manifests: both readers refuse them, naming what is wrong (the role side passed
# them through as they were, or read a non-object as "never baked").
# case -> (file content, what the message names)
BAD_FILES: dict[str, tuple[str, str]] = {
    "unknown-source": (
        json.dumps({**SCHEMA2, "installed": {"nccl": {"version": "2.27.7", "source": "apt"}}}),
        "installed.nccl needs a version and a source (base_image or gpuforge)",
    ),
    "not-an-object": ("[]", "expected a JSON object"),
    "bad-completed": (
        json.dumps({**SCHEMA2, "completed": {"targets": []}}),
        "completed needs a versions_hash",
    ),
    "not-json": ("{", "not JSON"),
}


def _slurped(text: str) -> dict[str, Any]:
    """What ansible.builtin.slurp registers for a file holding `text`."""
    return {"content": base64.b64encode(text.encode()).decode(), "encoding": "base64"}


def test_the_tag_prefix_and_schema_are_the_documented_ones() -> None:
    """docs/manifest.md's schema 2 and image tags gpuforge:installed:<component>."""
    assert manifest.INSTALLED_TAG_PREFIX == "gpuforge:installed:"
    assert manifest.SCHEMA == 2


@pytest.mark.parametrize("case", list(GOOD))
def test_the_filter_reads_as_the_cli(case: str) -> None:
    data = GOOD[case]
    got = FILTERS["node_manifest"](_slurped(json.dumps(data)), where="/etc/gpuforge/manifest.json")
    assert got == node_manifest.parse(data).as_dict()


def test_no_content_is_no_manifest() -> None:
    """slurp of a missing or unreadable file (failed_when: false) registers no content."""
    assert FILTERS["node_manifest"]({"failed": True, "msg": "file not found"}) == {}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_both_readers_refuse_what_is_not_a_manifest(case: str) -> None:
    content, named = BAD_FILES[case]
    with pytest.raises(manifest.ManifestError, match=re.escape(named)):
        manifest.loads(content, "/etc/gpuforge/manifest.json")
    if case != "not-json":
        with pytest.raises(UserError, match=re.escape(named)):
            node_manifest.parse(json.loads(content))
    with pytest.raises(AnsibleFilterError) as raised:
        FILTERS["node_manifest"](_slurped(content), where="/etc/gpuforge/manifest.json")
    assert named in str(raised.value)
    assert "fix or remove /etc/gpuforge/manifest.json" in str(raised.value)


def test_the_filter_refuses_what_slurp_did_not_register() -> None:
    with pytest.raises(AnsibleFilterError, match=r"pass what ansible\.builtin\.slurp registered"):
        FILTERS["node_manifest"]("{}")


# The drift comparison: case -> (manifest as read back, image tags, expected report fields)
IMAGE = {manifest.VERSIONS_HASH_TAG: PINS.digest, **node_manifest.parse(SCHEMA2).image_tags()}
DRIFT: dict[str, tuple[dict[str, Any], dict[str, str], dict[str, Any]]] = {
    "up-to-date": (
        SCHEMA2,
        IMAGE,
        {
            "node_matches_image": True,
            "node_matches_current": True,
            "installed_vs_image": [],
            "below_floor": [],
        },
    ),
    "image-recorded-what-the-node-lacks": (
        SCHEMA2,
        {**IMAGE, "gpuforge:installed:nccl": "2.30.7/gpuforge"},
        {"installed_vs_image": ["nccl absent (image 2.30.7/gpuforge)"]},
    ),
    "digest-is-part-of-the-value": (
        {
            **SCHEMA2,
            "installed": {
                **SCHEMA2["installed"],
                "dcgm_exporter": {"version": EXPORTER, "source": "gpuforge", "digest": "sha256:aa"},
            },
        },
        {**IMAGE, "gpuforge:installed:dcgm_exporter": f"{EXPORTER}/gpuforge@sha256:bb"},
        {
            "installed_vs_image": [
                f"dcgm_exporter {EXPORTER}/gpuforge@sha256:aa (image {EXPORTER}/gpuforge@sha256:bb)"
            ]
        },
    ),
    # Numbers compare as numbers: 580.9.1 is below the floor 580.65.06 (as text it would be above).
    "below-the-current-floor": (
        {
            **SCHEMA2,
            "installed": {
                "nvidia_driver": {"version": "580.9.1", "source": "base_image"},
                "dcgm": {"version": "4.5.3", "source": "gpuforge"},
                "unpinned": {"version": "0.1", "source": "gpuforge"},
            },
        },
        {},
        {
            "image": "untagged",
            "node_matches_image": False,
            "below_floor": [
                f"nvidia_driver 580.9.1 < floor {PINS.components['nvidia_driver']['floor']}",
                f"dcgm 4.5.3 < floor {PINS.components['dcgm']['floor']}",
            ],
        },
    ),
    "no-manifest": (
        {},
        IMAGE,
        {
            "node": "missing",
            "node_matches_image": False,
            "node_matches_current": False,
            "installed_vs_image": [
                f"dcgm absent (image {DCGM}/gpuforge)",
                "nvidia_driver absent (image 580.105.08/base_image)",
            ],
        },
    ),
    "pins-changed": (
        {**SCHEMA2, "versions_hash": "0" * 64},
        IMAGE,
        {"node": "0" * 64, "node_matches_image": False, "node_matches_current": False},
    ),
}


@pytest.mark.parametrize("case", list(DRIFT))
def test_drift_report(case: str) -> None:
    node, tags, expected = DRIFT[case]
    got = FILTERS["manifest_drift"](node, tags, PINS.components, PINS.digest)
    unchanged = {
        "node": PINS.digest,
        "image": PINS.digest,
        "current": PINS.digest,
        "node_matches_image": True,
        "node_matches_current": True,
        "installed_vs_image": [],
        "below_floor": [],
    }
    assert got == {**unchanged, **expected}


@pytest.mark.parametrize(
    ("node", "tags", "pins", "pins_hash", "says"),
    [
        (None, {}, {}, "abc", "pass gpuforge_previous_manifest"),
        ({}, [], {}, "abc", "pass the image's tags"),
        ({}, {}, {}, "", "pass the current pins' hash"),
        ({"schema": 2, "installed": {"x": {}}}, {}, {}, "abc", "installed.x needs a version"),
    ],
)
def test_drift_filter_refuses_what_it_cannot_compare(
    node: Any, tags: Any, pins: Any, pins_hash: Any, says: str
) -> None:
    with pytest.raises(AnsibleFilterError, match=re.escape(says)):
        FILTERS["manifest_drift"](node, tags, pins, pins_hash)


def test_the_role_and_the_playbook_call_the_filters() -> None:
    """No Jinja copy of the reader or the comparison is left."""
    reader = (REPO / "roles/gpuforge_common/tasks/read_manifest.yml").read_text()
    assert "gpuforge.gpu.node_manifest(" in reader and "m.components" not in reader
    drift = (REPO / "playbooks/drift.yml").read_text()
    assert "gpuforge.gpu.manifest_drift(" in drift
    assert "key[19:]" not in drift and "namespace(" not in drift


def _drift_tasks() -> list[dict[str, Any]]:
    """playbooks/drift.yml's comparison and its report, as shipped."""
    tasks = yaml.safe_load((REPO / "playbooks/drift.yml").read_text())[0]["tasks"]
    return [t for t in tasks if t["name"] in ("Compare the three", "Report drift")]


@pytest.fixture(scope="module")
def role_side(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """read_manifest.yml on each bad file, and drift.yml's comparison and report on two drift cases,
    in one check-mode play on the control host."""
    root = tmp_path_factory.mktemp("manifest-reader")
    cases: dict[str, list[dict[str, Any]]] = {}
    for case, (content, _) in BAD_FILES.items():
        (root / case).mkdir()
        (root / case / "manifest.json").write_text(content)
        cases[case] = [
            {
                "ansible.builtin.include_role": {
                    "name": "gpuforge.gpu.gpuforge_common",
                    "tasks_from": "read_manifest.yml",
                },
                "vars": {"gpuforge_common_config_dir": str(root / case)},
            },
            record(case, "read as {{ gpuforge_previous_manifest }}"),
        ]
    for case in ("image-recorded-what-the-node-lacks", "below-the-current-floor"):
        node, tags, _ = DRIFT[case]
        cases[f"drift:{case}"] = [
            {
                # What drift.yml's one DescribeImages call registers for the fleet, and the host's image.
                "ansible.builtin.set_fact": {
                    "gpuforge_previous_manifest": node,
                    "aws_image_id": "ami-0123456789abcdef0",
                    "_drift_images": {"images": [{"image_id": "ami-0123456789abcdef0", "tags": tags}]},
                }
            },
            *_drift_tasks(),
            record(f"drift:{case}", "{{ _drift_report }}"),
        ]
    (root / "play").mkdir()
    play_vars = {"gpuforge_versions": PINS.components, "gpuforge_versions_hash": PINS.digest}
    return run_cases(root / "play", cases, play_vars)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_FILES))
def test_the_role_refuses_what_the_cli_refuses(role_side: dict[str, Any], case: str) -> None:
    _, named = BAD_FILES[case]
    assert not role_side[case].startswith("read as"), role_side[case]
    assert named in role_side[case]
    assert "fix or remove" in role_side[case]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["image-recorded-what-the-node-lacks", "below-the-current-floor"])
def test_the_playbook_reports_what_the_filter_compares(role_side: dict[str, Any], case: str) -> None:
    node, tags, _ = DRIFT[case]
    assert role_side[f"drift:{case}"] == FILTERS["manifest_drift"](node, tags, PINS.components, PINS.digest)
