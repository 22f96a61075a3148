"""Bad inputs to the stack roles (efa, nccl, aws_ofi_nccl, pytorch) fail early with a clear message.

One check-mode play on the control host includes each role with one bad input inside block/rescue
and collects the failure messages. Check mode and the failures in each role's validate step mean
nothing on the control host changes; IMDS is disabled so no request leaves loopback.
"""

from __future__ import annotations

from typing import Any

import pytest

from localplay import run_cases

pytestmark = pytest.mark.slow

# case id -> (role, variables, text the failure message must contain)
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "efa-latest": ("efa", {"efa_installer_version": "latest"}, '"latest" is not an EFA installer release'),
    "efa-unpinned-sha256": (
        "efa",
        {"efa_installer_sha256": ""},
        "No valid sha256 is pinned for the EFA installer",
    ),
    "efa-bad-fingerprint": (
        "efa",
        {"efa_installer_sha256": "a" * 64, "efa_installer_gpg_fingerprint": "DD2D3CCC"},
        "must be the 40-hex-digit fingerprint",
    ),
    "efa-bad-flag": (
        "efa",
        {"efa_installer_sha256": "a" * 64, "efa_installer_extra_flags": ["; rm -rf /"]},
        "is not an efa_installer.sh option",
    ),
    "nccl-range": ("nccl", {"nccl_version": ">=2.21"}, "must be exact releases such as 2.21.5"),
    "ofi-version": ("aws_ofi_nccl", {"aws_ofi_nccl_version": "1.13.x"}, "is not an aws-ofi-nccl release"),
    "ofi-source": ("aws_ofi_nccl", {"aws_ofi_nccl_source": "sideways"}, "aws_ofi_nccl_source must be one of"),
    "ofi-short-sha512": (
        "aws_ofi_nccl",
        {"aws_ofi_nccl_source_sha512": "ab" * 32},
        "Pin exactly one hash of the aws-ofi-nccl 1.21.1 source tarball",
    ),
    "ofi-two-hashes": (
        "aws_ofi_nccl",
        {"aws_ofi_nccl_source_sha256": "a" * 64},
        "Pin exactly one hash of the aws-ofi-nccl 1.21.1 source tarball",
    ),
    "ofi-bundled-missing": (
        "aws_ofi_nccl",
        {"aws_ofi_nccl_source": "bundled", "aws_ofi_nccl_bundled_prefix": "/nonexistent/ofi-nccl"},
        "aws_ofi_nccl_source is 'bundled' but /nonexistent/ofi-nccl holds no plugin",
    ),
    "pytorch-latest": ("pytorch", {"pytorch_version": "latest"}, "must be an exact release such as 2.5.1"),
    "pytorch-wrong-wheel": (
        "pytorch",
        {
            "pytorch_version": "2.13.0",
            "pytorch_cuda_build": "cpu",
            "pytorch_wheel_url": "http://127.0.0.1:1/torch-2.12.0+cpu-cp311-cp311-linux_x86_64.whl",
            "pytorch_wheel_sha256": "b" * 64,
        },
        "pytorch_wheel_url must name torch 2.13.0+cpu",
    ),
}


@pytest.fixture(scope="module")
def messages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cases = {
        case: [{"ansible.builtin.include_role": {"name": f"gpuforge.gpu.{role}"}, "vars": variables}]
        for case, (role, variables, _) in CASES.items()
    }
    play_vars = {"gpuforge_instance_type": "p5.48xlarge", "gpuforge_common_imds_enabled": False}
    return run_cases(tmp_path_factory.mktemp("validate"), cases, play_vars)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_with_a_clear_message(messages: dict[str, str], case: str) -> None:
    """The role stopped on this input, and its message names what to fix."""
    assert case in messages, f"{case} did not fail; collected: {sorted(messages)}"
    assert CASES[case][2] in messages[case]
