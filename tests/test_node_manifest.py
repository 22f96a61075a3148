"""/etc/gpuforge/manifest.json: the Python reader (gpuforge.node_manifest) and the role-side reader
(roles/gpuforge_common/tasks/read_manifest.yml) read the same files the same way, and the writer's
template produces what both read. The role side runs in one check-mode play on the control host.
The golden fast path's decision is one implementation (plugins/plugin_utils/fast_path.py), tested
here through the CLI's gpuforge.node_manifest.fast_path and the bake play's filter gpuforge.gpu.fast_path.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.gpuforge.gpu.plugins.plugin_utils import fast_path as fast_path_module
from ansible_collections.gpuforge.gpu.plugins.plugin_utils.manifest import Completed, Installed, differences

import sourcefile
from gpuforge import node_manifest, versions
from gpuforge.errors import UserError
from localplay import REPO, record, run_cases

fast_path_filter = sourcefile.load("fast_path_filter", "plugins/filter/fast_path.py")

PINS = versions.load()
SCHEMA2 = {
    "schema": 2,
    "versions_hash": PINS.digest,
    "pins": PINS.components,
    "installed": {
        "nvidia_driver": {"version": "580.105.08", "source": "base_image"},
        "dcgm": {"version": "4.5.3", "source": "gpuforge"},
    },
}
# case -> file content (None: no file)
FILES: dict[str, str | None] = {
    "schema-2": json.dumps(SCHEMA2),
    "schema-1": json.dumps({"versions_hash": "abc", "components": {"nccl": {"version": "2.21.5"}}}),
    "missing": None,
}


def test_python_reads_schema_2() -> None:
    manifest = node_manifest.parse(SCHEMA2)
    assert manifest.installed["nvidia_driver"] == Installed("580.105.08", "base_image")
    assert manifest.image_tags() == {
        "gpuforge:installed:dcgm": "4.5.3/gpuforge",
        "gpuforge:installed:nvidia_driver": "580.105.08/base_image",
    }


def test_python_reads_schema_1_as_nothing_installed_recorded() -> None:
    manifest = node_manifest.parse(json.loads(str(FILES["schema-1"])))
    assert (manifest.schema, manifest.versions_hash, manifest.installed) == (2, "abc", {})
    assert manifest.pins == {"nccl": {"version": "2.21.5"}}


@pytest.mark.parametrize(
    "bad",
    [[], {"schema": 2, "installed": {"nccl": {"version": "2.27.7", "source": "apt"}}}, {"schema": "2"}],
)
def test_python_refuses_malformed_manifests(bad: Any) -> None:
    with pytest.raises(UserError):
        node_manifest.parse(bad)


def test_differences_compare_actual_versions() -> None:
    manifest = node_manifest.parse(SCHEMA2)
    assert differences(manifest, {"nvidia_driver": "580.105.08", "dcgm": "4.5.3"}) == {}
    assert differences(manifest, {"nvidia_driver": "580.95.05", "dcgm": "4.5.3", "nccl": "2.27.7"}) == {
        "nccl": ("", "2.27.7"),
        "nvidia_driver": ("580.105.08", "580.95.05"),
    }


# The golden fast path's decision: case -> (manifest or None, instance type, full install, expected).
GOLDEN = {
    **SCHEMA2,
    "completed": {
        "versions_hash": PINS.digest,
        "targets": ["p5.48xlarge", "p5e.48xlarge"],
        "install_revision": fast_path_module.INSTALL_REVISION,
    },
}
OLD = "0" * 64
FAST_PATH: dict[str, tuple[dict[str, Any] | None, str, bool, tuple[bool, str]]] = {
    "golden": (
        GOLDEN,
        "p5e.48xlarge",
        False,
        (True, f"golden: pins {PINS.digest[:12]} installed for p5.48xlarge, p5e.48xlarge"),
    ),
    "asked-for": (
        GOLDEN,
        "p5.48xlarge",
        True,
        (False, "full install asked for (gpuforge_full_install=true)"),
    ),
    "no-manifest": (
        None,
        "p5.48xlarge",
        False,
        (False, "no readable /etc/gpuforge/manifest.json (never baked by gpuforge)"),
    ),
    "never-completed": (
        SCHEMA2,
        "p5.48xlarge",
        False,
        (False, "the manifest records no install phase run to its end"),
    ),
    "pins-changed": (
        {**GOLDEN, "versions_hash": OLD, "completed": {"versions_hash": OLD, "targets": ["p5.48xlarge"]}},
        "p5.48xlarge",
        False,
        (False, f"pins changed: the node has {OLD[:12]}, versions.yml {PINS.digest[:12]}"),
    ),
    # The first write of a run records the new pins; only the last one records them completed.
    "stopped-half-way": (
        {**GOLDEN, "completed": {"versions_hash": OLD, "targets": ["p5.48xlarge"]}},
        "p5.48xlarge",
        False,
        (False, f"the last install phase for pins {PINS.digest[:12]} did not finish"),
    ),
    # Baked before the install phase baked munge and Slurm (no install_revision recorded).
    "older-install-phase": (
        {**GOLDEN, "completed": {"versions_hash": PINS.digest, "targets": ["p5.48xlarge"]}},
        "p5.48xlarge",
        False,
        (
            False,
            "the image's install phase is revision 1, gpuforge's is 2"
            " (it did not bake munge and the Slurm daemons)",
        ),
    ),
    "foreign-type": (
        GOLDEN,
        "g6e.xlarge",
        False,
        (False, "g6e.xlarge is not among the image's targets (p5.48xlarge, p5e.48xlarge)"),
    ),
    "unknown-type": (
        GOLDEN,
        "",
        False,
        (False, "this node's instance type is unknown (the inventory sets no gpuforge_instance_type)"),
    ),
}


def test_the_install_revision_is_defined_once() -> None:
    """plugins/plugin_utils/fast_path.py's INSTALL_REVISION, which the CLI reads and the manifest's
    writer records through gpuforge.gpu.completed_install (the written file:
    test_only_the_last_write_records_a_completed_install); no role variable copies it."""
    assert max(fast_path_module.REVISIONS) == fast_path_module.INSTALL_REVISION
    assert "install_revision" not in (REPO / "roles/gpuforge_common/vars/main.yml").read_text()
    template = (REPO / "roles/gpuforge_common/templates/etc/gpuforge/manifest.json.j2").read_text()
    assert "gpuforge.gpu.completed_install(gpuforge_targets)" in template
    assert fast_path_filter.completed_install("abc", ["p5.48xlarge"]) == {
        "versions_hash": "abc",
        "targets": ["p5.48xlarge"],
        "install_revision": fast_path_module.INSTALL_REVISION,
    }


@pytest.mark.parametrize(
    ("pins_hash", "targets"), [("", ["p5.48xlarge"]), ("abc", "p5.48xlarge"), ("abc", None)]
)
def test_completed_install_refuses_what_is_not_a_hash_or_targets(pins_hash: Any, targets: Any) -> None:
    with pytest.raises(AnsibleFilterError, match="completed_install: pass"):
        fast_path_filter.completed_install(pins_hash, targets)


def test_targets_recorded_as_a_string_are_a_malformed_manifest() -> None:
    """Read character by character, completed.targets "p5.48xlarge" would hold "p": not golden."""
    for recorded in ("p5.48xlarge", "p", {"p5.48xlarge": True}):
        raw = {**GOLDEN, "completed": {**GOLDEN["completed"], "targets": recorded}}
        golden, why = fast_path_filter.fast_path(raw, PINS.digest, "p")
        assert not golden
        assert (
            why == f"the manifest's completed.targets is {recorded!r}, not a list of instance types "
            "(a malformed manifest)"
        )
    # No targets recorded at all is an empty list, as the CLI's reader takes it.
    raw = {
        **GOLDEN,
        "completed": {"versions_hash": PINS.digest, "install_revision": fast_path_module.INSTALL_REVISION},
    }
    assert fast_path_filter.fast_path(raw, PINS.digest, "p5.48xlarge") == [
        False,
        "p5.48xlarge is not among the image's targets (none)",
    ]


def test_an_older_revision_is_told_what_it_lacks_from_the_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    """The message names what each later revision added (REVISIONS), not a hard-coded revision 2."""
    monkeypatch.setattr(fast_path_module, "REVISIONS", {**fast_path_module.REVISIONS, 3: "the frobnicator"})
    raw = {**GOLDEN, "completed": {**GOLDEN["completed"], "install_revision": 2}}
    assert fast_path_module.decide(raw, PINS.digest, "p5.48xlarge", install_revision=3) == (
        False,
        "the image's install phase is revision 2, gpuforge's is 3 (it did not bake the frobnicator)",
    )
    raw = {**GOLDEN, "completed": {**GOLDEN["completed"], "install_revision": 1}}
    assert fast_path_module.decide(raw, PINS.digest, "p5.48xlarge", install_revision=3)[1].endswith(
        "(it did not bake munge and the Slurm daemons; the frobnicator)"
    )


@pytest.mark.parametrize("case", list(FAST_PATH))
def test_python_fast_path_decision(case: str) -> None:
    data, instance_type, full, expected = FAST_PATH[case]
    node = None if data is None else node_manifest.parse(data)
    assert node_manifest.fast_path(node, PINS.digest, instance_type, full_install=full) == expected


@pytest.mark.parametrize("case", list(FAST_PATH))
def test_bake_filter_fast_path_decision(case: str) -> None:
    """The bake play's filter, given what read_manifest.yml sets ({} for no manifest) and values as a
    play passes them (templated strings), decides as the CLI does."""
    data, instance_type, full, expected = FAST_PATH[case]
    manifest = {} if data is None else node_manifest.parse(data).as_dict()
    got = fast_path_filter.fast_path(manifest, PINS.digest, instance_type, full_install=str(full))
    assert tuple(got) == expected


def test_bake_filter_reads_a_role_side_manifest_without_a_recorded_revision() -> None:
    """read_manifest.yml passes the file's "completed" as it is: no install_revision reads as revision 1."""
    raw = {**GOLDEN, "completed": {"versions_hash": PINS.digest, "targets": ["p5.48xlarge"]}}
    golden, why = fast_path_filter.fast_path(raw, PINS.digest, "p5.48xlarge")
    assert (golden, why) == FAST_PATH["older-install-phase"][3]
    assert fast_path_filter.fast_path(GOLDEN, PINS.digest, " unknown ")[1] == FAST_PATH["unknown-type"][3][1]


@pytest.mark.parametrize(("manifest", "pins_hash"), [("nope", PINS.digest), ({}, ""), ({}, None)])
def test_bake_filter_refuses_what_is_not_a_manifest_or_a_hash(manifest: Any, pins_hash: Any) -> None:
    with pytest.raises(AnsibleFilterError, match="fast_path: pass"):
        fast_path_filter.fast_path(manifest, pins_hash, "p5.48xlarge")


def test_completed_round_trips_and_malformed_is_refused() -> None:
    node = node_manifest.parse(GOLDEN)
    assert node.completed == Completed(
        PINS.digest, ("p5.48xlarge", "p5e.48xlarge"), fast_path_module.INSTALL_REVISION
    )
    assert node_manifest.parse(node.as_dict()) == node
    with pytest.raises(UserError, match="completed"):
        node_manifest.parse({**SCHEMA2, "completed": {"targets": []}})
    with pytest.raises(UserError, match="install_revision"):
        node_manifest.parse({**SCHEMA2, "completed": {**GOLDEN["completed"], "install_revision": "2"}})


@pytest.fixture(scope="module")
def role_side(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("manifests")
    cases: dict[str, list[dict[str, Any]]] = {}
    for case, content in FILES.items():
        directory = root / case
        directory.mkdir()
        if content is not None:
            (directory / "manifest.json").write_text(content)
        cases[case] = [
            {
                "ansible.builtin.include_role": {
                    "name": "gpuforge.gpu.gpuforge_common",
                    "tasks_from": "read_manifest.yml",
                },
                "vars": {"gpuforge_common_config_dir": str(directory)},
            },
            record(case, "{{ gpuforge_previous_manifest }}"),
        ]
    # The writer's template, rendered with a run's decisions over the schema-2 manifest as the earlier one.
    cases["written"] = [
        {
            "ansible.builtin.set_fact": {
                "gpuforge_versions": PINS.components,
                "gpuforge_versions_hash": PINS.digest,
                "gpuforge_previous_manifest": SCHEMA2,
                "gpuforge_targets": ["p5.48xlarge"],
                "gpuforge_reality": {
                    "dcgm": {"action": "adopt", "version": "4.6.0", "source": "base_image"},
                    "nccl": {"action": "install", "version": "2.27.7", "source": "gpuforge"},
                    "efa_installer": {"action": "refuse", "version": "", "source": ""},
                },
            }
        },
        record(
            "written",
            "{{ lookup('ansible.builtin.template', '"
            + str(REPO / "roles/gpuforge_common/templates/etc/gpuforge/manifest.json.j2")
            + "', template_vars={'_gpuforge_common_installed_now': _now}) | from_json }}",
        ),
    ]
    cases["written"][1]["vars"]["_now"] = (
        "{{ {'dcgm': {'version': '4.6.0', 'source': 'base_image'},"
        " 'nccl': {'version': '2.27.7', 'source': 'gpuforge'}} }}"
    )
    # The last write of a bake records what it completed; a later first write keeps it.
    cases["written-completed"] = [
        {
            "ansible.builtin.set_fact": {
                "gpuforge_versions": PINS.components,
                "gpuforge_versions_hash": PINS.digest,
                "gpuforge_previous_manifest": SCHEMA2,
                "gpuforge_targets": ["p5.48xlarge"],
                "gpuforge_reality": {},
            }
        },
        record(
            "written-completed",
            "{{ [lookup('ansible.builtin.template', _template, template_vars=_last) | from_json,"
            " lookup('ansible.builtin.template', _template, template_vars=_over_golden) | from_json,"
            " lookup('ansible.builtin.template', _template, template_vars=_over_fresh) | from_json] }}",
        ),
    ]
    cases["written-completed"][1]["vars"].update(
        {
            "_template": str(REPO / "roles/gpuforge_common/templates/etc/gpuforge/manifest.json.j2"),
            "_last": {
                "_gpuforge_common_installed_now": {},
                "_gpuforge_common_install_completed": True,
            },
            "_over_golden": {"_gpuforge_common_installed_now": {}, "gpuforge_previous_manifest": GOLDEN},
            "_over_fresh": {"_gpuforge_common_installed_now": {}},
        }
    )
    (root / "play").mkdir()
    return run_cases(root / "play", cases, {})


@pytest.mark.slow
def test_only_the_last_write_records_a_completed_install(role_side: dict[str, Any]) -> None:
    last, first_over_golden, first_over_fresh = role_side["written-completed"]
    assert last["completed"] == {
        "versions_hash": PINS.digest,
        "targets": ["p5.48xlarge"],
        # The module's revision, which the template takes through gpuforge.gpu.completed_install.
        "install_revision": fast_path_module.INSTALL_REVISION,
    }
    assert first_over_golden["completed"] == GOLDEN["completed"]  # kept from the earlier run
    assert "completed" not in first_over_fresh


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FILES))
def test_role_reads_as_python(role_side: dict[str, Any], case: str) -> None:
    content = FILES[case]
    expected = {} if content is None else node_manifest.parse(json.loads(content)).as_dict()
    assert role_side[case] == expected


@pytest.mark.slow
def test_written_manifest_keeps_earlier_records_and_adds_this_runs(role_side: dict[str, Any]) -> None:
    assert role_side["written"]["targets"] == ["p5.48xlarge"]  # the targets' writer's key, kept as it is
    written = node_manifest.parse(role_side["written"])
    assert written.versions_hash == PINS.digest and written.pins == PINS.components
    assert {n: (i.version, i.source) for n, i in written.installed.items()} == {
        "nvidia_driver": ("580.105.08", "base_image"),  # recorded by an earlier run
        "dcgm": ("4.6.0", "base_image"),  # this run's decision replaces the earlier record
        "nccl": ("2.27.7", "gpuforge"),
    }
