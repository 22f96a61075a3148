"""Target instance types: the facts in data/instance_types.yml and the decisions taken from them,
written once in the collection's plugins/plugin_utils/targets.py. The CLI (gpuforge.targets) and the
roles (filters gpuforge.gpu.target_*, targets_*) call that one implementation; the cases below test it
directly, and one check-mode play on the control host (tests/localplay.py) checks that gpuforge_common
and nvidia_driver's defaults take the same decisions through the filters: a builder that is a
g5.2xlarge (no NVSwitch) baking for p5.48xlarge must still get the fabric manager.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from ansible_collections.gpuforge.gpu.plugins.plugin_utils import targets as rules

import sourcefile
from gpuforge import instance_types, targets, versions
from gpuforge.errors import UserError
from localplay import REPO, record, run_cases

CURRENT = versions.load()


def _pins(**versions_by_component: str) -> versions.Manifest:
    components = {name: dict(fields) for name, fields in CURRENT.components.items()}
    for name, version in versions_by_component.items():
        components[name]["version"] = version
    return versions.Manifest(components)


# Pins that serve B200 (driver 570.133.20+, CUDA 12.8+, aws-ofi-nccl 1.17.0+, NCCL 2.28.3+).
BLACKWELL_PINS = {"nvidia_driver": "580.95.05", "cuda": "13.0", "aws_ofi_nccl": "1.17.0", "nccl": "2.28.3"}
# Pins too old for B200: R535 and CUDA 12.2, as gpuforge pinned before the Blackwell types.
OLD_PINS = {"nvidia_driver": "535.261.03", "cuda": "12.2", "aws_ofi_nccl": "1.16.3", "nccl": "2.21.5"}


def test_parse_keeps_order_drops_blanks_and_duplicates() -> None:
    assert targets.parse(" p5.48xlarge, p5en.48xlarge,,p5.48xlarge ") == ("p5.48xlarge", "p5en.48xlarge")
    with pytest.raises(UserError, match="at least one instance type"):
        targets.parse(" , ")


def test_nvswitch_targets_need_the_fabric_manager_whatever_the_builder() -> None:
    resolved = targets.resolve(["p5.48xlarge", "p5en.48xlarge"], _pins(**OLD_PINS))
    assert resolved.nvswitch and not resolved.nvlink_subnet_manager
    assert resolved.tags() == {"gpuforge:target-instance-types": "p5.48xlarge,p5en.48xlarge"}
    assert resolved.ansible_vars() == {"gpuforge_target_instance_types": ["p5.48xlarge", "p5en.48xlarge"]}
    assert not targets.resolve(["g6e.48xlarge", "p5.4xlarge"], _pins(**OLD_PINS)).nvswitch


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("p9.fake", "unknown instance type 'p9.fake'; known types:"),
        ("p6e-gb200.36xlarge", "instance type 'p6e-gb200.36xlarge' is not supported: arm64"),
        ("g7e.48xlarge", "instance type 'g7e.48xlarge' is not supported: RTX PRO Server 6000"),
    ],
)
def test_unknown_or_unsupported_target_is_refused_by_name(name: str, message: str) -> None:
    with pytest.raises(UserError, match=message.replace(".", r"\.")):
        targets.resolve(["p5.48xlarge", name], _pins(**BLACKWELL_PINS))


def test_driver_branch_must_support_every_target_gpu() -> None:
    with pytest.raises(UserError) as caught:
        targets.resolve(["p5.48xlarge", "p6-b200.48xlarge"], _pins(**OLD_PINS))
    text = str(caught.value)
    assert "p6-b200.48xlarge: the pinned driver 535.261.03 does not support its B200" in text
    assert "it needs 570.133.20 or later" in text
    assert "p6-b200.48xlarge: the pinned CUDA 12.2 does not support its B200" in text
    assert "p6-b200.48xlarge: the pinned aws_ofi_nccl 1.16.3 is older than the 1.17.0" in text
    assert "p6-b200.48xlarge: the pinned nccl 2.21.5 is older than the 2.28.3" in text
    assert "p5.48xlarge:" not in text


def test_blackwell_pins_serve_p6_b200_with_the_nvlink_subnet_manager() -> None:
    resolved = targets.resolve(["p6-b200.48xlarge"], _pins(**BLACKWELL_PINS))
    assert resolved.nvswitch and resolved.nvlink_subnet_manager


def test_p6_b200_settings_are_what_the_aws_ofi_nccl_plugin_sets() -> None:
    """aws-ofi-nccl src/platform-aws.cpp (v1.17.0 to v1.21.x), platform entry "p5en/p6-b200":
    its env block, and NCCL_NETDEVS_POLICY exists from NCCL v2.28.3 on (same file's notes)."""
    facts = instance_types.get("p6-b200.48xlarge")
    assert facts.aws_ofi_nccl is not None
    assert facts.aws_ofi_nccl.env == {
        "NCCL_BUFFSIZE": "8388608",
        "NCCL_P2P_NET_CHUNKSIZE": "524288",
        "NCCL_NVLSTREE_MAX_CHUNKSIZE": "524288",
        "NCCL_NVLS_CHUNKSIZE": "524288",
        "NCCL_NET_FORCE_FLUSH": "0",
        "NCCL_NETDEVS_POLICY": "max:1",
    }
    assert (facts.aws_ofi_nccl.min_version, facts.aws_ofi_nccl.min_nccl) == ("1.17.0", "2.28.3")


@pytest.mark.parametrize(
    ("name", "gpus", "model", "memory", "efa", "gbps", "nvswitch"),
    [
        # AWS, "Specifications for Amazon EC2 accelerated computing instances".
        ("p6-b200.48xlarge", 8, "B200", 179, 8, 3200, True),
        ("p5.4xlarge", 1, "H100", 80, 1, 100, False),
        ("p5en.48xlarge", 8, "H200", 141, 16, 3200, True),
        ("p4de.24xlarge", 8, "A100", 80, 4, 400, True),
        ("g6e.8xlarge", 1, "L40S", 44, 1, 25, False),
        ("g6e.12xlarge", 4, "L40S", 44, 1, 100, False),
        ("g6e.16xlarge", 1, "L40S", 44, 1, 35, False),
        ("g6e.24xlarge", 4, "L40S", 44, 2, 200, False),
        ("g6e.48xlarge", 8, "L40S", 44, 4, 400, False),
        ("g6.8xlarge", 1, "L4", 22, 1, 25, False),
        ("gr6.8xlarge", 1, "L4", 22, 1, 25, False),
    ],
)
def test_instance_type_rows_match_aws_tables(
    name: str, gpus: int, model: str, memory: int, efa: int, gbps: int, nvswitch: bool
) -> None:
    facts = instance_types.get(name)
    assert (facts.gpus, facts.gpu_model, facts.gpu_memory_gib) == (gpus, model, memory)
    assert (facts.efa_interfaces, facts.network_gbps, facts.nvswitch) == (efa, gbps, nvswitch)


def test_every_gpu_type_names_a_known_gpu_model_and_no_type_is_both_supported_and_not() -> None:
    cat = instance_types.catalog()
    for facts in cat.types.values():
        if facts.gpus:
            assert facts.gpu_model in cat.gpu_models, facts.name
        assert facts.nvswitch or not facts.nvlink_subnet_manager, facts.name
    assert not set(cat.types) & set(cat.unsupported)


# ---- each decision, in the one implementation and through the roles -------------------------

# case -> (builder instance type, targets given, pins)
CASES: dict[str, tuple[str, list[str] | str, dict[str, str]]] = {
    "g5-builder-for-p5": ("g5.2xlarge", ["p5.48xlarge"], OLD_PINS),
    "g5-builder-for-g6e": ("g5.2xlarge", "g6e.48xlarge, p5.4xlarge", OLD_PINS),
    "fleet-node-own-type": ("p4d.24xlarge", [], OLD_PINS),
    "unknown": ("g5.2xlarge", ["p9.fake"], BLACKWELL_PINS),
    "unsupported": ("g5.2xlarge", ["p6e-gb200.36xlarge"], BLACKWELL_PINS),
    "b200-old-pins": ("g5.2xlarge", ["p6-b200.48xlarge"], OLD_PINS),
    "b200-new-pins": ("g5.2xlarge", ["p6-b200.48xlarge"], BLACKWELL_PINS),
}
# Fleet nodes booted from an image: no targets given, the node's manifest records the image's.
RECORDED = {"g5-node-of-a-p5-image": ["p5.48xlarge", "p5en.48xlarge"]}
CASES["g5-node-of-a-p5-image"] = ("g5.2xlarge", [], OLD_PINS)

# case -> (targets, fabric manager, nvlsm), or the words of the refusal.
EXPECTED: dict[str, tuple[list[str], bool, bool] | str] = {
    "g5-builder-for-p5": (["p5.48xlarge"], True, False),
    "g5-builder-for-g6e": (["g6e.48xlarge", "p5.4xlarge"], False, False),
    # data/instance_types.yml: p4d.24xlarge has NVSwitch (AWS, "Amazon EC2 P4d instances").
    "fleet-node-own-type": (["p4d.24xlarge"], True, False),
    "unknown": "unknown instance type 'p9.fake'; known types:",
    "unsupported": "instance type 'p6e-gb200.36xlarge' is not supported: arm64",
    "b200-old-pins": "p6-b200.48xlarge: the pinned driver 535.261.03 does not support its B200",
    "b200-new-pins": (["p6-b200.48xlarge"], True, True),
    "g5-node-of-a-p5-image": (["p5.48xlarge", "p5en.48xlarge"], True, False),
}


def _decide(case: str) -> tuple[list[str], bool, bool] | str:
    """The one implementation's decisions for a case, as the roles' filters ask for them."""
    builder, given, pins = CASES[case]
    data = instance_types.data()
    types = data["gpuforge_instance_types"]
    names = rules.choose(given, RECORDED.get(case, []), builder, types)
    refused = rules.refusals(
        names,
        types,
        data["gpuforge_gpu_models"],
        data["gpuforge_unsupported_instance_types"],
        _pins(**pins).components,
    )
    if refused:
        return "; ".join(refused)
    return names, rules.nvswitch(names, types), rules.nvlink_subnet_manager(names, types)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_case_is_decided_once(case: str) -> None:
    decided, expected = _decide(case), EXPECTED[case]
    if isinstance(expected, str):
        assert isinstance(decided, str) and expected in decided, decided
        return
    assert decided == expected
    # The CLI resolves the same targets to the same needs (it imports the same rules).
    resolved = targets.resolve(expected[0], _pins(**CASES[case][2]))
    assert (list(resolved.names), resolved.nvswitch, resolved.nvlink_subnet_manager) == expected


def test_the_cli_refuses_the_same_targets_in_the_same_words() -> None:
    for case, expected in EXPECTED.items():
        if isinstance(expected, str):
            given = CASES[case][1]
            with pytest.raises(UserError, match=expected.replace(".", r"\.").replace("(", r"\(")):
                targets.resolve(rules.names(given), _pins(**CASES[case][2]))


def test_targets_come_from_what_is_given_else_recorded_else_the_node_itself() -> None:
    types = instance_types.data()["gpuforge_instance_types"]
    assert rules.choose("p5.48xlarge, p5en.48xlarge,,p5.48xlarge", ["g6e.48xlarge"], "g5.2xlarge", types) == [
        "p5.48xlarge",
        "p5en.48xlarge",
    ]
    assert rules.choose([], ["p5.48xlarge"], "p4d.24xlarge", types) == ["p5.48xlarge"]
    assert rules.choose(None, None, "p4d.24xlarge", types) == ["p4d.24xlarge"]
    # An instance type data/instance_types.yml does not know is no target at all (health checks say why).
    assert rules.choose("", [], "t3.micro", types) == []


def test_a_given_value_naming_no_type_falls_back_like_an_empty_one() -> None:
    """choose's docstring: a given value naming no type (only blanks and commas too) is as if none
    was given (it named none and left the image without targets before)."""
    types = instance_types.data()["gpuforge_instance_types"]
    assert rules.choose(" , ", ["p5.48xlarge"], "g5.2xlarge", types) == ["p5.48xlarge"]
    assert rules.choose(" ", [], "p4d.24xlarge", types) == ["p4d.24xlarge"]


def test_a_missing_pin_is_refused_by_name() -> None:
    """No driver (or CUDA, plugin, NCCL) pinned: refused in words that name what is missing, not
    as 'the pinned driver  does not support' with an empty release."""
    data = instance_types.data()
    types, models = data["gpuforge_instance_types"], data["gpuforge_gpu_models"]
    pins = {
        name: fields for name, fields in _pins(**BLACKWELL_PINS).components.items() if name != "nvidia_driver"
    }
    refused = rules.refusals(["p6-b200.48xlarge"], types, models, {}, pins)
    assert refused == [
        "p6-b200.48xlarge: no nvidia_driver pinned; this type needs "
        f"{models[types['p6-b200.48xlarge']['gpu_model']]['min_driver']} or later (pin it in versions.yml)"
    ]
    no_nccl = {name: fields for name, fields in _pins(**BLACKWELL_PINS).components.items() if name != "nccl"}
    assert [
        why for why in rules.refusals(["p6-b200.48xlarge"], types, models, {}, no_nccl) if "nccl" in why
    ] == [
        "p6-b200.48xlarge: no nccl pinned; this type needs "
        f"{types['p6-b200.48xlarge']['aws_ofi_nccl']['min_nccl']} or later (pin it in versions.yml)"
    ]


def test_releases_compare_as_the_version_policy_compares() -> None:
    """targets used its own comparison (cut at '-', epoch kept); now policy.compare's."""
    data = instance_types.data()
    types, models = data["gpuforge_instance_types"], data["gpuforge_gpu_models"]
    minimum = str(models[types["p6-b200.48xlarge"]["gpu_model"]]["min_driver"])
    pins = _pins(**BLACKWELL_PINS).components
    # An epoch is no part of the release (it made any pin with one sort below every minimum).
    epoch = {
        **pins,
        "nvidia_driver": {**pins["nvidia_driver"], "version": f"1:{BLACKWELL_PINS['nvidia_driver']}"},
    }
    assert rules.refusals(["p6-b200.48xlarge"], types, models, {}, epoch) == []
    # A '~' pre-release of the minimum is below it.
    rc = {**pins, "nvidia_driver": {**pins["nvidia_driver"], "version": f"{minimum}~rc1"}}
    assert any(
        "does not support" in why for why in rules.refusals(["p6-b200.48xlarge"], types, models, {}, rc)
    )
    assert not hasattr(rules, "version_key")


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        (
            "target_refusals",
            (["p5.48xlarge"], None, {}, {}, {}),
            "target_refusals: gpuforge_instance_types must be a mapping",
        ),
        ("target_refusals", ("p5.48xlarge", {}, {}, {}, {}), "target_refusals: the targets must be a list"),
        (
            "target_refusals",
            (["p5.48xlarge"], "types", {}, {}, {}),
            "gpuforge_instance_types must be a mapping",
        ),
        (
            "target_refusals",
            (["p5.48xlarge"], {"p5.48xlarge": {"gpus": "eight"}}, {}, {}, {}),
            "gpus is 'eight', not a whole number",
        ),
        (
            "target_refusals",
            (["p5.48xlarge"], {"p5.48xlarge": {}}, {}, {}, None),
            "gpuforge_versions must be a mapping",
        ),
        ("efa_targets", (["p5.48xlarge"], {"p5.48xlarge": {"efa_interfaces": "x"}}), "efa_interfaces is 'x'"),
        ("targets_nvswitch", ("p5.48xlarge", {}), "targets_nvswitch: the targets must be a list"),
        (
            "targets_needing_open_modules",
            (["p5.48xlarge"], {}, ["B200"]),
            "gpuforge_gpu_models must be a mapping",
        ),
        ("target_names", (5, [], "", {}), "target_names: instance types must be a list of names"),
        ("target_names", ("", [], "", ["p5.48xlarge"]), "gpuforge_instance_types must be a mapping"),
    ],
)
def test_the_target_filters_say_what_to_pass(name: str, args: tuple[Any, ...], message: str) -> None:
    """Malformed input is an AnsibleFilterError saying what to pass, never a TypeError or ValueError."""
    filters = sourcefile.load("target_types", "plugins/filter/target_types.py").FilterModule().filters()
    with pytest.raises(AnsibleFilterError, match=re.escape(message)):
        filters[name](*args)


def test_the_target_filters_are_the_one_implementation() -> None:
    """The roles' entry points hand their inputs to plugin_utils.targets unchanged."""
    filters = sourcefile.load("target_types", "plugins/filter/target_types.py").FilterModule().filters()
    data = instance_types.data()
    types, models = data["gpuforge_instance_types"], data["gpuforge_gpu_models"]
    names = ["p5.48xlarge", "g6e.48xlarge", "p6-b200.48xlarge"]
    assert filters["targets_nvswitch"](names, types) is rules.nvswitch(names, types) is True
    assert filters["targets_nvlink_subnet_manager"](["p5.48xlarge"], types) is False
    assert filters["efa_targets"]([*names, "g6.xlarge"], types) == rules.efa(names, types) == names
    assert filters["targets_needing_open_modules"](names, types, models) == ["p6-b200.48xlarge"]
    assert filters["target_names"]("", ["p5.48xlarge"], "g5.2xlarge", types) == ["p5.48xlarge"]
    refused = filters["target_refusals"](
        ["p6-b200.48xlarge"], types, models, {}, _pins(**OLD_PINS).components
    )
    assert refused == rules.problems("p6-b200.48xlarge", types, models, _pins(**OLD_PINS).components)
    assert len(refused) == 4


def test_no_role_keeps_a_jinja_copy_of_the_target_or_range_decisions() -> None:
    """The decisions live in plugins/plugin_utils only: no role computes them in Jinja or publishes
    them as play-wide facts, and gpuforge_common has no entry point for the NCCL range."""
    assert not (REPO / "roles/gpuforge_common/tasks/ofi_nccl_range.yml").exists()
    gone = (
        "gpuforge_targets_nvswitch",
        "gpuforge_targets_nvlink_subnet_manager",
        "tasks_from: ofi_nccl_range",
    )
    for path in sorted((REPO / "roles").rglob("*.yml")):
        text = path.read_text()
        for name in gone:
            assert name not in text, f"{path.relative_to(REPO)} still uses {name}"
    rules_text = (REPO / "roles/gpuforge_common/tasks/targets.yml").read_text()
    assert "gpuforge.gpu.target_refusals" in rules_text and "{%" not in rules_text


def _versions_file(directory: Path, pins: dict[str, str]) -> Path:
    data = yaml.safe_load((REPO / "versions.yml").read_text())
    for name, version in pins.items():
        data["gpuforge_versions"][name]["version"] = version
        # A pin may not be below its floor (the version policy): these old pins come with their floors.
        data["gpuforge_versions"][name]["floor"] = version
    path = directory / "versions.yml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def ansible_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("targets")
    cases: dict[str, list[dict[str, Any]]] = {}
    for case, (builder, names, pins) in CASES.items():
        directory = out / case
        directory.mkdir()
        if case in RECORDED:
            (directory / "etc").mkdir()
            manifest = {
                "schema": 2,
                "versions_hash": "",
                "pins": {},
                "installed": {},
                "targets": RECORDED[case],
            }
            (directory / "etc" / "manifest.json").write_text(json.dumps(manifest))
        cases[case] = [
            {
                "ansible.builtin.include_role": {"name": "gpuforge.gpu.gpuforge_common"},
                "vars": {
                    "gpuforge_instance_type": builder,
                    "gpuforge_target_instance_types": names,
                    "gpuforge_common_versions_file": str(_versions_file(directory, pins)),
                    "gpuforge_common_config_dir": str(directory / "etc"),
                },
            },
            # nvidia_driver's own defaults, evaluated on what gpuforge_common published.
            {"ansible.builtin.include_vars": {"file": str(REPO / "roles/nvidia_driver/defaults/main.yml")}},
            record(
                case,
                {
                    "targets": "{{ gpuforge_targets }}",
                    "fabricmanager": "{{ nvidia_driver_fabricmanager_enabled | bool }}",
                    "nvlsm": "{{ nvidia_driver_nvlsm_enabled | bool }}",
                },
            ),
        ]
    return run_cases(out, cases, {"gpuforge_common_imds_enabled": False})


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_roles_take_each_decision_through_the_filters(ansible_results: dict[str, Any], case: str) -> None:
    result, expected = ansible_results[case], EXPECTED[case]
    if isinstance(expected, str):
        # Refused, naming the type, in the one implementation's words.
        assert isinstance(result, str), result
        assert expected in result, result
        return
    assert (result["targets"], result["fabricmanager"], result["nvlsm"]) == expected


@pytest.mark.slow
def test_a_g5_builder_baking_for_p5_installs_the_fabric_manager(ansible_results: dict[str, Any]) -> None:
    assert ansible_results["g5-builder-for-p5"]["fabricmanager"] is True
    assert ansible_results["g5-builder-for-g6e"]["fabricmanager"] is False
    assert ansible_results["b200-new-pins"]["nvlsm"] is True
    # A converge on a node of a p5 image keeps the image's targets (and so its fabric manager).
    assert ansible_results["g5-node-of-a-p5-image"]["targets"] == RECORDED["g5-node-of-a-p5-image"]
    assert ansible_results["g5-node-of-a-p5-image"]["fabricmanager"] is True
    # The words are the one implementation's (plugin_utils.targets.refusal), as the CLI says them.
    assert "unknown instance type 'p9.fake'" in ansible_results["unknown"]
    assert "'p6e-gb200.36xlarge' is not supported: arm64" in ansible_results["unsupported"]
    assert "p6-b200.48xlarge: the pinned driver 535.261.03" in ansible_results["b200-old-pins"]
