"""The CLI's hint for the lab names the lab `make demo` starts (issue 34, R11): `gpuforge-lab env` alone
means the lab named default, which `make demo` never makes."""

from __future__ import annotations

import re
from pathlib import Path

from gpuforge import aws

REPO = Path(__file__).resolve().parents[1]


def test_the_credentials_hint_names_the_demo_lab() -> None:
    match = re.search(r"DEMO_LAB \?= (\S+)", (REPO / "Makefile").read_text())
    assert match is not None
    assert f'eval "$(gpuforge-lab env --name {match.group(1)})"' in aws.CREDENTIALS_HINT
    assert 'eval "$(gpuforge-lab env)"' not in aws.CREDENTIALS_HINT
