"""The nccl_tuning role's setting selection (plugins/filter/nccl_tuning.py, the collection's filter plugin).

The candidates are the role's real defaults; only the node description (instance type and
probed versions) varies, so these tests check the rules the role ships, not a copy of them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from gpuforge import instance_types
from localplay import record, run_cases

REPO = Path(__file__).resolve().parents[1]
ROLE = REPO / "roles" / "nccl_tuning"
INSTANCE_TYPES = yaml.safe_load((REPO / "data" / "instance_types.yml").read_text())["gpuforge_instance_types"]


def _load_filter() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "nccl_tuning_filter", REPO / "plugins" / "filter" / "nccl_tuning.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FILTER = _load_filter()


def candidates(**values: str) -> list[dict[str, Any]]:
    """The role's candidate list with its Jinja values replaced by concrete ones."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    concrete = {
        "NCCL_SOCKET_IFNAME": "ens5",
        "NCCL_DEBUG": "WARN",
        "NCCL_TOPO_DUMP_FILE": "",
        "NCCL_IB_TIMEOUT": "22",
        "NCCL_IB_RETRY_CNT": "7",
        "NCCL_IB_QPS_PER_CONNECTION": "4",
        **values,
    }
    out = []
    for candidate in defaults["nccl_tuning_candidates"]:
        item = dict(candidate)
        if "{{" in str(item["value"]):
            item["value"] = concrete[item["name"]]
        out.append(item)
    return out


def node(instance_type: str, **versions: Any) -> dict[str, Any]:
    """The node the role describes to the filter (tasks/configure.yml), from data/instance_types.yml."""
    facts = instance_types.get(instance_type)
    return {
        "efa_interfaces": facts.efa_interfaces,
        "transport": "ofi" if facts.efa_interfaces else "socket",
        "kernel": "6.8.0-1015-aws",
        "libfabric": "2.6.0amzn1.0",
        "aws_ofi_nccl": "1.21.1",
        "instance_type": instance_type,
        "plugin_env": dict(facts.aws_ofi_nccl.env) if facts.aws_ofi_nccl else {},
        "plugin_overrides": [],
        **versions,
    }


def extra(**env: str) -> list[dict[str, Any]]:
    """nccl_tuning_extra_env as the role passes it: after the candidates, without conditions."""
    return [{"name": name, "value": value} for name, value in env.items()]


@pytest.mark.parametrize(
    "instance_type",
    [
        "p5.48xlarge",
        "p5e.48xlarge",
        "p5en.48xlarge",
        "p4d.24xlarge",
        "p4de.24xlarge",
        "p6-b200.48xlarge",
        "g5.48xlarge",
        "g6.12xlarge",
        "g6e.48xlarge",
    ],
)
def test_current_software_on_efa_types(instance_type: str) -> None:
    """With today's pins an EFA instance gets only the NCCL basics: no stale workaround, and nothing
    the plugin sets itself (FI_PROVIDER and NCCL_PROTO only for plugins up to 1.5, efa-env-var.md)."""
    chosen = FILTER.nccl_tuning_select(candidates(), node(instance_type))
    assert chosen["applied"] == {"NCCL_SOCKET_IFNAME": "ens5", "NCCL_DEBUG": "WARN"}
    reasons = {item["name"]: item["reason"] for item in chosen["left_out"]}
    assert "aws_ofi_nccl 1.21.1 is not below 1.6" in reasons["FI_PROVIDER"]
    assert "aws_ofi_nccl 1.21.1 is not below 1.7" in reasons["FI_EFA_USE_DEVICE_RDMA"]
    assert "aws_ofi_nccl 1.21.1 is not below 1.6" in reasons["NCCL_PROTO"]
    for name in ("NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_IB_QPS_PER_CONNECTION"):
        assert "ib transport" in reasons[name] and "uses ofi" in reasons[name]


def test_fork_safety_is_left_to_the_plugin() -> None:
    """FI_EFA_FORK_SAFE is no candidate, whatever the kernel: every plugin since about v1.2 sets it
    itself (efa-env-var.md: "Not needed anymore"; PlatformAWS::init)."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    assert "FI_EFA_FORK_SAFE" not in {c["name"] for c in defaults["nccl_tuning_candidates"]}
    chosen = FILTER.nccl_tuning_select(candidates(), node("p4d.24xlarge", kernel="5.10.215-203.850.amzn2"))
    assert "FI_EFA_FORK_SAFE" not in chosen["applied"]


def test_instance_without_efa_gets_no_libfabric_settings() -> None:
    """A head node without EFA keeps only the NCCL socket settings."""
    chosen = FILTER.nccl_tuning_select(candidates(), node("c5n.large", aws_ofi_nccl="1.5.0"))
    assert not any(name.startswith("FI_") for name in chosen["applied"])
    assert chosen["applied"]["NCCL_SOCKET_IFNAME"] == "ens5"
    reasons = {item["name"]: item["reason"] for item in chosen["left_out"]}
    assert reasons["FI_PROVIDER"] == "the instance type has no EFA interface"


# What the plugin sets itself per type (data/instance_types.yml aws_ofi_nccl.env), as read in
# aws-ofi-nccl v1.21.1 src/platform-aws.cpp platform_data_map.
PLUGIN_SETS = {
    "p5.48xlarge": {
        "NCCL_BUFFSIZE": "8388608",
        "NCCL_P2P_NET_CHUNKSIZE": "524288",
        "NCCL_NVLSTREE_MAX_CHUNKSIZE": "524288",
        "NCCL_NVLS_CHUNKSIZE": "524288",
        "NCCL_NET_FORCE_FLUSH": "0",
    },
    "p4d.24xlarge": {"NCCL_BUFFSIZE": "8388608", "NCCL_P2P_NET_CHUNKSIZE": "524288"},
    "p5en.48xlarge": {
        "NCCL_BUFFSIZE": "8388608",
        "NCCL_P2P_NET_CHUNKSIZE": "524288",
        "NCCL_NVLSTREE_MAX_CHUNKSIZE": "524288",
        "NCCL_NVLS_CHUNKSIZE": "524288",
        "NCCL_NET_FORCE_FLUSH": "0",
        "NCCL_NETDEVS_POLICY": "max:1",
    },
    # No platform entry of its own: the plugin sets nothing per type.
    "g6e.48xlarge": {},
}


@pytest.mark.parametrize("instance_type", list(PLUGIN_SETS))
def test_plugin_settings_per_type_come_from_the_data_file(instance_type: str) -> None:
    facts = instance_types.get(instance_type).aws_ofi_nccl
    assert (dict(facts.env) if facts else {}) == PLUGIN_SETS[instance_type]


def test_group_override_of_a_plugin_setting_is_left_to_the_plugin() -> None:
    """A group's NCCL_BUFFSIZE on a p5 would replace the plugin's own value: left out, with the reason."""
    chosen = FILTER.nccl_tuning_select(
        candidates() + extra(NCCL_BUFFSIZE="4194304", NCCL_MIN_NCHANNELS="8"), node("p5.48xlarge")
    )
    assert "NCCL_BUFFSIZE" not in chosen["applied"]
    assert chosen["applied"]["NCCL_MIN_NCHANNELS"] == "8"
    reasons = {item["name"]: item["reason"] for item in chosen["left_out"]}
    assert "plugin sets it itself on p5.48xlarge (NCCL_BUFFSIZE=8388608" in reasons["NCCL_BUFFSIZE"]
    assert "nccl_tuning_plugin_overrides" in reasons["NCCL_BUFFSIZE"]


def test_listed_override_and_types_without_the_plugin_setting_keep_the_value() -> None:
    """Listed in nccl_tuning_plugin_overrides, or on a type where the plugin sets nothing (g6e), or
    where NCCL does not go through the plugin, the group's value is written."""
    env = extra(NCCL_BUFFSIZE="4194304")
    on_purpose = FILTER.nccl_tuning_select(
        candidates() + env, node("p5.48xlarge", plugin_overrides=["NCCL_BUFFSIZE"])
    )
    g6e = FILTER.nccl_tuning_select(candidates() + env, node("g6e.48xlarge"))
    ib = FILTER.nccl_tuning_select(candidates() + env, {**node("p5.48xlarge"), "transport": "ib"})
    for chosen in (on_purpose, g6e, ib):
        assert chosen["applied"]["NCCL_BUFFSIZE"] == "4194304"


@pytest.mark.parametrize(
    ("libfabric", "aws_ofi_nccl", "rdma", "proto"),
    [
        ("1.16.1", "1.13.2", True, False),
        ("1.19.0", "1.6.0", True, False),
        ("1.19.0", "1.5.0", True, True),
        ("1.19.0", "1.7.3", False, False),
        ("", "1.13.2", False, False),
    ],
)
def test_version_gated_workarounds(libfabric: str, aws_ofi_nccl: str, rdma: bool, proto: bool) -> None:
    """Device RDMA and the simple protocol come back only for the old versions that needed them."""
    chosen = FILTER.nccl_tuning_select(
        candidates(), node("p5.48xlarge", libfabric=libfabric, aws_ofi_nccl=aws_ofi_nccl)
    )
    assert ("FI_EFA_USE_DEVICE_RDMA" in chosen["applied"]) is rdma
    assert ("NCCL_PROTO" in chosen["applied"]) is proto


def test_ib_transport_gets_ib_settings() -> None:
    """On a fabric where NCCL uses its own verbs transport, the NCCL_IB_* settings are written."""
    chosen = FILTER.nccl_tuning_select(candidates(), {**node("c5n.large"), "transport": "ib"})
    assert chosen["applied"]["NCCL_IB_TIMEOUT"] == "22"
    assert chosen["applied"]["NCCL_IB_QPS_PER_CONNECTION"] == "4"


def test_empty_value_is_left_out_and_set_value_kept() -> None:
    """NCCL_TOPO_DUMP_FILE is written only when a path is configured."""
    off = FILTER.nccl_tuning_select(candidates(), node("p5.48xlarge"))
    on = FILTER.nccl_tuning_select(candidates(NCCL_TOPO_DUMP_FILE="/var/tmp/topo.xml"), node("p5.48xlarge"))
    assert "NCCL_TOPO_DUMP_FILE" not in off["applied"]
    assert on["applied"]["NCCL_TOPO_DUMP_FILE"] == "/var/tmp/topo.xml"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1.22.0amzn4.0", (1, 22, 0)),
        ("v1.13.2-aws", (1, 13, 2)),
        ("6.8.0-1015-aws", (6, 8, 0)),
        ("", None),
        ("unknown", None),
    ],
)
def test_parse_version(text: str, expected: tuple[int, ...] | None) -> None:
    """Only the leading dotted number of a version string counts."""
    assert FILTER.parse_version(text) == expected


@pytest.mark.parametrize(
    ("found", "bound", "below"),
    [
        ("1.17.0", "1.18", True),
        ("1.18.0", "1.18", False),  # trailing zeros name the same release
        ("1.22.0amzn4.0", "1.22.0", False),
        ("1.18.0~rc1", "1.18", True),  # a Debian pre-release is older than its release
        ("v1.5.0-aws", "1.6", True),
        ("1:1.7.0", "1.7", False),  # a Debian epoch is no part of the release
        ("unknown", "1.6", None),
        ("", "1.6", None),
    ],
)
def test_bounds_compare_as_the_version_policy_compares(found: str, bound: str, below: bool | None) -> None:
    """_below is policy.compare's order (it padded number lists and read no pre-release or epoch)."""
    assert FILTER._below(found, bound) is below


# The files the role writes (tasks/configure.yml and its templates, as shipped) for four types, with
# the same group override everywhere: NCCL_BUFFSIZE, which the plugin sets itself on p4d/p5/p6-b200.
RENDERED_TYPES = ("p5.48xlarge", "p6-b200.48xlarge", "p4d.24xlarge", "g6e.48xlarge")
GROUP_ENV = {"NCCL_BUFFSIZE": "4194304"}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("nccl-tuning-rendered")
    # The tasks file runs outside its role: Ansible finds the role's templates next to the play.
    (root / "templates").symlink_to(ROLE / "templates")
    cases: dict[str, list[dict[str, Any]]] = {}
    for name in RENDERED_TYPES:
        out = root / name
        cases[name] = [
            {
                "ansible.builtin.include_tasks": str(ROLE / "tasks" / "configure.yml"),
                "vars": {
                    "gpuforge_instance_type": name,
                    "gpuforge_instance": INSTANCE_TYPES[name],
                    "nccl_tuning_env_file": str(out / "gpuforge" / "nccl.env"),
                    "nccl_tuning_conf_file": str(out / "nccl.conf"),
                    "nccl_tuning_profile_file": str(out / "gpuforge-nccl.sh"),
                    "nccl_tuning_socket_ifname": "ens5",
                    "nccl_tuning_extra_env": GROUP_ENV,
                    "_nccl_tuning_versions": {"kernel": "6.8.0-1015-aws", "libfabric": "2.6.0amzn1.0"},
                },
            },
            record(name, "{{ _nccl_tuning_selected.left_out }}"),
        ]
    # The role's defaults and the pins, as the role would have them (include_vars: no gpuforge_common run).
    loaders = [
        {"ansible.builtin.include_vars": str(ROLE / "defaults" / "main.yml")},
        {"ansible.builtin.include_vars": str(REPO / "versions.yml")},
    ]
    play = run_cases(root, {"load": loaders, **cases}, {"gpuforge_common_imds_enabled": False}, check=False)
    return {"root": root, "left_out": play}


def _settings(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


@pytest.mark.parametrize("instance_type", RENDERED_TYPES)
def test_rendered_env_file_leaves_plugin_settings_to_the_plugin(
    rendered: dict[str, Any], instance_type: str
) -> None:
    """nccl.env holds the NCCL basics, never a value the plugin sets itself on the type (the group's
    NCCL_BUFFSIZE is written only on g6e, where the plugin has no platform entry), and none of the
    removed or bounded settings (FI_EFA_FORK_SAFE, FI_PROVIDER, NCCL_PROTO) with today's plugin."""
    out = rendered["root"] / instance_type
    env = _settings(out / "gpuforge" / "nccl.env")
    plugin_env = (INSTANCE_TYPES[instance_type].get("aws_ofi_nccl") or {}).get("env", {})
    expected = {"NCCL_SOCKET_IFNAME": "ens5", "NCCL_DEBUG": "WARN"}
    if "NCCL_BUFFSIZE" not in plugin_env:
        expected.update(GROUP_ENV)
    assert env == expected
    assert not set(env) & set(plugin_env)
    # nccl.conf: the NCCL_* settings of the same selection.
    assert _settings(out / "nccl.conf") == expected
    reasons = {item["name"]: item["reason"] for item in rendered["left_out"][instance_type]}
    if plugin_env:
        assert f"plugin sets it itself on {instance_type}" in reasons["NCCL_BUFFSIZE"]
