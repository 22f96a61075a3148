"""The NCCL range of an aws-ofi-nccl release (data/aws_ofi_nccl.yml), and which release is in use, written
once in the collection's plugins/plugin_utils/ofi_nccl.py: the roles call it through the filters
gpuforge.gpu.ofi_nccl_range and gpuforge.gpu.ofi_nccl_release_in_use; the cases test it directly, and
the nccl role's adopt-or-install decision is run against the plugin in use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from ansible_collections.gpuforge.gpu.plugins.plugin_utils import ofi_nccl, policy

import sourcefile
from gpuforge import versions
from localplay import record, run_cases

REPO = Path(__file__).resolve().parents[1]
FILTERS = sourcefile.load("ofi_nccl_range", "plugins/filter/ofi_nccl_range.py").FilterModule().filters()


def _table() -> dict[str, dict[str, str]]:
    """data/aws_ofi_nccl.yml's rows, as the roles load them (gpuforge_common's load_data)."""
    return ofi_nccl.rows_of(yaml.safe_load((REPO / "data" / "aws_ofi_nccl.yml").read_text()))


# case -> (aws-ofi-nccl release, NCCL release, row used, NCCL inside the range, a note expected)
CASES: dict[str, tuple[str, str, str, bool, bool]] = {
    # The December 2026 pins: NCCL 2.30.7 beside aws-ofi-nccl 1.21.1.
    "pins": ("1.21.1", "2.30.7", "1.21.1", True, False),
    "at-tested-max": ("1.21.1", "2.31.2", "1.21.1", True, False),
    "past-tested-max": ("1.21.1", "2.31.3", "1.21.1", False, False),
    "below-backward-compat": ("1.21.1", "2.16.5", "1.21.1", False, False),
    # What the pin alone got wrong: a base image's NCCL 2.31.2 beside an adopted bundle 1.21.0 is
    # fine, while a 1.20.0 plugin was only tested up to 2.30.4.
    "adopted-bundle-newer-range": ("1.21.0", "2.31.2", "1.21.0", True, False),
    "older-plugin-narrower-range": ("1.20.0", "2.31.2", "1.20.0", False, False),
    # A release with no row of its own: the newest older row, with a note; never more than that row allows.
    "unknown-newer-release": ("1.22.0", "2.31.2", "1.21.1", True, True),
    "unknown-newer-release-newer-nccl": ("1.22.0", "2.32.1", "1.21.1", False, True),
    "unknown-between-rows": ("1.19.3", "2.29.7", "1.19.2", True, True),
    # Older than every row: no range, so no NCCL is compatible.
    "older-than-every-row": ("1.13.2", "2.21.5", "", False, True),
    # Numbers compare as numbers: 1.9.0 is older than 1.14.0, not newer.
    "numeric-not-lexical": ("1.9.0", "2.21.5", "", False, True),
    # No NCCL to check: only the range.
    "range-only": ("1.17.3", "", "1.17.3", True, False),
}


def _python(case: str) -> ofi_nccl.NcclRange:
    return ofi_nccl.nccl_range(CASES[case][0], _table())


@pytest.mark.parametrize("case", list(CASES))
def test_python_range(case: str) -> None:
    _, nccl, row, inside, noted = CASES[case]
    found = _python(case)
    assert found.row == row
    assert (found.check(nccl) == "") is inside
    assert bool(found.note) is noted
    if row:
        assert (found.nccl_min, found.nccl_tested_max) == (
            _table()[row]["nccl_min"],
            _table()[row]["nccl_tested_max"],
        )


def test_messages_name_the_plugin_and_the_bound() -> None:
    assert _python("past-tested-max").check("2.31.3") == (
        "newer than 2.31.2, the newest NCCL aws-ofi-nccl 1.21.1 is tested with"
    )
    assert "add its row" in _python("unknown-newer-release").note
    unknown = _python("older-than-every-row").check("2.21.5")
    assert unknown == "no tested NCCL range is known for aws-ofi-nccl 1.13.2"


def test_every_row_is_a_consistent_range() -> None:
    """Each row's oldest NCCL is not above its newest, and the pinned plugin has a row of its own."""
    rows = _table()
    for release, row in rows.items():
        assert policy.compare(row["nccl_min"], row["nccl_tested_max"]) <= 0, release
    manifest = versions.load()
    pin = manifest.version("aws_ofi_nccl")
    assert pin in rows, f"versions.yml pins aws-ofi-nccl {pin}: add its row to data/aws_ofi_nccl.yml"
    assert _range_note(pin) == ""
    # The pinned NCCL is inside the pinned plugin's range, or a bake would replace its own pin.
    assert ofi_nccl.nccl_range(pin, rows).check(manifest.version("nccl")) == ""


def _range_note(release: str) -> str:
    return ofi_nccl.nccl_range(release, _table()).note


def _run_with_table(work: Path, cases: dict[str, list[dict[str, Any]]], **extra: Any) -> dict[str, Any]:
    """Run the role tasks with data/aws_ofi_nccl.yml loaded, as gpuforge_common's load_data does."""
    table = yaml.safe_load((REPO / "data" / "aws_ofi_nccl.yml").read_text())
    return run_cases(work, cases, {"gpuforge_common_imds_enabled": False, **extra, **table})


@pytest.mark.parametrize("case", list(CASES))
def test_the_filter_describes_each_case(case: str) -> None:
    """What the roles get (gpuforge.gpu.ofi_nccl_range): the range, its note, and `outside` for the
    NCCL given, from the one implementation."""
    plugin, nccl, row, inside, noted = CASES[case]
    filters = FILTERS
    table = yaml.safe_load((REPO / "data" / "aws_ofi_nccl.yml").read_text())[ofi_nccl.TABLE_KEY]
    found = filters["ofi_nccl_range"](plugin, table, nccl=nccl)
    assert found == {
        "plugin": plugin,
        "row": row,
        "nccl_min": table[row]["nccl_min"] if row else "",
        "nccl_tested_max": table[row]["nccl_tested_max"] if row else "",
        "note": _python(case).note,
        "outside": _python(case).check(nccl),
    }
    assert (found["outside"] == "") is inside
    assert bool(found["note"]) is noted


# Which plugin release the nccl role checks NCCL against (roles/nccl/tasks/plugin_range.yml as shipped):
# case -> (nccl_plugin_version, what the aws_ofi_nccl role decided in this run (the node record), its record
# file, expected)
PIN = "1.21.1"
IN_USE_CASES: dict[str, tuple[str, str, dict[str, str] | None, str]] = {
    "adopted-this-play": ("", "1.22.0", {"source": "bundled", "version": "1.21.0"}, "1.22.0"),
    "recorded-earlier-run": ("", "", {"source": "bundled", "version": "1.21.0"}, "1.21.0"),
    "recorded-build": ("", "", {"source": "built", "version": "1.20.0"}, "1.20.0"),
    "skipped-is-the-pin": ("", "", {"source": "skipped", "version": "1.20.0"}, PIN),
    "nothing-is-the-pin": ("", "", None, PIN),
    "explicit-release": ("1.19.2", "1.22.0", None, "1.19.2"),
}


def _in_use_cases(root: Path) -> dict[str, list[dict[str, Any]]]:
    cases: dict[str, list[dict[str, Any]]] = {}
    for case, (explicit, this_play, recorded, _) in IN_USE_CASES.items():
        record_file = root / case / "aws_ofi_nccl.json"
        record_file.parent.mkdir()
        if recorded is not None:
            record_file.write_text(json.dumps(recorded))
        cases[case] = [
            # Each case starts from its own node record: what an aws_ofi_nccl role run decided, or nothing.
            {"gpuforge.gpu.component": {"begin": True}},
            *(
                [
                    {
                        "gpuforge.gpu.component": {
                            "component": "aws_ofi_nccl",
                            "installed": this_play,
                            "pin": PIN,
                            "floor": "1.0.0",
                        }
                    }
                ]
                if this_play
                else []
            ),
            {
                "ansible.builtin.include_tasks": str(REPO / "roles/nccl/tasks/plugin_range.yml"),
                "vars": {
                    "nccl_plugin_version": explicit,
                    "gpuforge_ofi_nccl_record": str(record_file),
                    "_nccl_installed": "2.30.7",
                },
            },
            record(f"in_use:{case}", "{{ _nccl_ofi_range.plugin }}"),
        ]
    return cases


@pytest.fixture(scope="module")
def in_use(plays: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return plays["in_use"]


@pytest.mark.parametrize("case", list(IN_USE_CASES))
def test_nccl_checks_against_the_plugin_in_use(in_use: dict[str, Any], case: str) -> None:
    assert in_use[case] == IN_USE_CASES[case][-1]


# The NCCL the nccl role installs must be inside the range of the plugin in use
# (roles/nccl/tasks/pair_check.yml as shipped): case -> (plugin in use, policy action, NCCL after the run)
PAIR_CASES: dict[str, tuple[str, str, str]] = {
    "pin-inside-the-pinned-plugin": ("1.21.1", "install", "2.30.7"),
    "pin-beyond-an-older-plugin": ("1.19.2", "install", "2.30.7"),
    "plugin-older-than-every-row": ("1.13.2", "install", "2.30.7"),
    "downgrade-checked-too": ("1.19.2", "downgrade", "2.30.7"),
    # An adopted NCCL passed the range when it was adopted.
    "adopted-not-checked-again": ("1.19.2", "adopt", "2.30.7"),
    # A kept NCCL is the pin already on the host: judged as the pin on a fresh host is.
    "kept-pin-inside": ("1.21.1", "keep", "2.30.7"),
    "kept-pin-beyond-an-older-plugin": ("1.19.2", "keep", "2.30.7"),
}


# action -> the arguments that make the version policy decide it, leaving `version` in place.
PAIR_DECISIONS: dict[str, Any] = {
    "install": lambda version: {"installed": "", "pin": version, "floor": "2.0.0"},
    "downgrade": lambda version: {
        "installed": "9.0.0",
        "pin": version,
        "floor": "2.0.0",
        "compatible": False,
    },
    "adopt": lambda version: {"installed": version, "pin": "9.0.0", "floor": "2.0.0"},
    "keep": lambda version: {"installed": version, "pin": version, "floor": "2.0.0"},
}


def _pair_cases() -> dict[str, list[dict[str, Any]]]:
    cases: dict[str, list[dict[str, Any]]] = {}
    for case, (plugin, action, version) in PAIR_CASES.items():
        cases[case] = [
            # The nccl role's decision, through the node record's writer (PAIR_DECISIONS), and the range it
            # looked up for the plugin in use.
            {
                "gpuforge.gpu.component": {"component": "nccl", **PAIR_DECISIONS[action](version)},
                "vars": {"gpuforge_common_allow_downgrade": action == "downgrade"},
            },
            {"ansible.builtin.set_fact": {"_nccl_ofi_range": {"plugin": plugin}}},
            {"ansible.builtin.include_tasks": str(REPO / "roles/nccl/tasks/pair_check.yml")},
            record(f"pairs:{case}", "passed"),
        ]
    return cases


@pytest.fixture(scope="module")
def pairs(plays: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return plays["pairs"]


@pytest.fixture(scope="module")
def plays(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The two tables' cases in one play (one ansible-playbook run instead of two).

    Each case sets the play state it reads (the node record, the range) first, and the
    in-use cases, the only ones that read the pin (gpuforge_versions) or register anything, run last,
    as they did in a play of their own.
    """
    root = tmp_path_factory.mktemp("ofi-nccl")
    tables = {"pairs": _pair_cases(), "in_use": _in_use_cases(root)}
    cases = {
        f"{table}:{case}": tasks
        for table, table_cases in tables.items()
        for case, tasks in table_cases.items()
    }
    results = _run_with_table(root, cases, gpuforge_versions={"aws_ofi_nccl": {"version": PIN}})
    return {
        table: {case: results[f"{table}:{case}"] for case in table_cases}
        for table, table_cases in tables.items()
    }


@pytest.mark.parametrize("case", list(PAIR_CASES))
def test_nccl_installed_beside_the_plugin_is_a_tested_pair(pairs: dict[str, Any], case: str) -> None:
    plugin, action, version = PAIR_CASES[case]
    outside = (
        ofi_nccl.nccl_range(plugin, _table()).check(version)
        if action in ("install", "downgrade", "keep")
        else ""
    )
    if outside:
        assert pairs[case] != "passed"
        assert f"the pinned NCCL {version} is {outside}" in pairs[case]
    else:
        assert pairs[case] == "passed"


# A damaged table is refused with a message naming what to fix (it raised AttributeError or KeyError,
# which the filter passed on as a bare Python error): case -> (gpuforge_aws_ofi_nccl_releases, message).
BAD_TABLES: dict[str, tuple[Any, str]] = {
    "missing": (None, "must be a non-empty mapping of aws-ofi-nccl release -> {nccl_min, nccl_tested_max}"),
    "empty": ({}, "got dict {}"),
    "row-not-a-mapping": (
        {"1.21.1": "2.17.1"},
        "['1.21.1'] must be a mapping with nccl_min and nccl_tested_max",
    ),
    "bound-missing": (
        {"1.21.1": {"nccl_min": "2.17.1"}},
        "['1.21.1'] has no nccl_tested_max: add them from that release's RELEASENOTES.md",
    ),
    "bound-empty": (
        {"1.21.1": {"nccl_min": "", "nccl_tested_max": None}},
        "has no nccl_min and no nccl_tested_max",
    ),
}


@pytest.mark.parametrize("case", list(BAD_TABLES))
def test_a_damaged_table_is_refused_with_what_to_fix(case: str) -> None:
    rows, message = BAD_TABLES[case]
    with pytest.raises(ValueError, match=f"^{ofi_nccl.TABLE_KEY}") as raised:
        ofi_nccl.rows_of({ofi_nccl.TABLE_KEY: rows})
    assert message in str(raised.value)
    with pytest.raises(AnsibleFilterError) as filtered:
        FILTERS["ofi_nccl_range"]("1.21.1", rows)
    # The filter names itself and the variable once.
    assert str(filtered.value) == f"ofi_nccl_range: {raised.value}"
    assert str(filtered.value).count(ofi_nccl.TABLE_KEY) == 1


# Which release is in use (ofi_nccl.release_in_use), directly and through the filter:
# case -> (chosen, the node record's decision of this run, the earlier run's record file, expected)
RELEASE_CASES: dict[str, tuple[str, Any, Any, str]] = {
    "chosen-wins": ("1.19.2", {"action": "adopt", "version": "1.22.0"}, None, "1.19.2"),
    "adopted-bundle": ("", {"action": "adopt", "version": "1.22.0"}, {"version": "1.20.0"}, "1.22.0"),
    "built-pin": ("", {"action": "install", "version": PIN}, None, PIN),
    "refused-names-none": ("", {"action": "refuse", "version": ""}, None, PIN),
    "recorded-earlier-run": ("", None, {"source": "bundled", "version": "1.21.0"}, "1.21.0"),
    "recorded-skip-is-the-pin": ("", None, {"source": "skipped", "version": "1.20.0"}, PIN),
    "empty-values-from-a-play": ("", "", "", PIN),
}


@pytest.mark.parametrize("case", list(RELEASE_CASES))
def test_release_in_use(case: str) -> None:
    chosen, decision, recorded, expected = RELEASE_CASES[case]
    got = FILTERS["ofi_nccl_release_in_use"](PIN, chosen=chosen, decision=decision, record=recorded)
    assert got == expected
    if decision != "" and recorded != "":
        direct = ofi_nccl.release_in_use(PIN, chosen=chosen, decision=decision, record=recorded)
        assert direct == expected


def test_release_in_use_refuses_a_record_that_is_not_a_mapping() -> None:
    with pytest.raises(AnsibleFilterError, match=r"record must be a mapping .*rerun the aws_ofi_nccl role"):
        FILTERS["ofi_nccl_release_in_use"](PIN, record=["1.21.1"])


def test_both_roles_choose_the_release_through_the_filter() -> None:
    """roles/aws_ofi_nccl/tasks/register.yml and roles/nccl/tasks/plugin_range.yml had each their own Jinja
    choice of the release in use; both call gpuforge.gpu.ofi_nccl_release_in_use now."""
    for path in ("roles/aws_ofi_nccl/tasks/register.yml", "roles/nccl/tasks/plugin_range.yml"):
        text = (REPO / path).read_text()
        assert "gpuforge.gpu.ofi_nccl_release_in_use(" in text, path
        # The Jinja copies: "<bundle> if plan == 'bundled' else <pin>" and "<record> if not skipped".
        assert "else aws_ofi_nccl_version }}" not in text and "!= 'skipped'" not in text, path
