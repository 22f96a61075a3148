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

REPO = Path(__file__).resolve().parents[1]
ROLE = REPO / "roles" / "nccl_tuning"


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


def node(instance_type: str, **versions: str) -> dict[str, Any]:
    efa = instance_types.get(instance_type).efa_interfaces
    return {
        "efa_interfaces": efa,
        "transport": "ofi" if efa else "socket",
        "kernel": "6.8.0-1015-aws",
        "libfabric": "1.22.0amzn4.0",
        "aws_ofi_nccl": "1.13.2",
        **versions,
    }


@pytest.mark.parametrize(
    "instance_type",
    [
        "p5.48xlarge",
        "p5e.48xlarge",
        "p5en.48xlarge",
        "p4d.24xlarge",
        "p4de.24xlarge",
        "g5.48xlarge",
        "g6.12xlarge",
    ],
)
def test_current_software_on_efa_types(instance_type: str) -> None:
    """With today's pins an EFA instance gets the provider and NCCL basics, and no stale workaround."""
    chosen = FILTER.nccl_tuning_select(candidates(), node(instance_type))
    assert chosen["applied"] == {"FI_PROVIDER": "efa", "NCCL_SOCKET_IFNAME": "ens5", "NCCL_DEBUG": "WARN"}
    reasons = {item["name"]: item["reason"] for item in chosen["left_out"]}
    assert "kernel 6.8.0-1015-aws is not below 5.15" in reasons["FI_EFA_FORK_SAFE"]
    assert "aws_ofi_nccl 1.13.2 is not below 1.7" in reasons["FI_EFA_USE_DEVICE_RDMA"]
    for name in ("NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_IB_QPS_PER_CONNECTION"):
        assert "ib transport" in reasons[name] and "uses ofi" in reasons[name]


def test_instance_without_efa_gets_no_libfabric_settings() -> None:
    """A head node without EFA keeps only the NCCL socket settings."""
    chosen = FILTER.nccl_tuning_select(candidates(), node("c5n.large"))
    assert not any(name.startswith("FI_") for name in chosen["applied"])
    assert chosen["applied"]["NCCL_SOCKET_IFNAME"] == "ens5"
    reasons = {item["name"]: item["reason"] for item in chosen["left_out"]}
    assert reasons["FI_PROVIDER"] == "the instance type has no EFA interface"


def test_old_kernel_needs_fork_safety() -> None:
    """Kernels before 5.15 still need FI_EFA_FORK_SAFE."""
    chosen = FILTER.nccl_tuning_select(candidates(), node("p4d.24xlarge", kernel="5.10.215-203.850.amzn2"))
    assert chosen["applied"]["FI_EFA_FORK_SAFE"] == "1"


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
