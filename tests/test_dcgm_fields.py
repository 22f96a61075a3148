"""Every DCGM field gpuforge's exporter collectors name is a field DCGM knows.

dcgm-exporter skips a collector line whose field name it cannot resolve, so a misspelt or retired
name would drop a metric silently. The names DCGM knows are recorded from NVIDIA/go-dcgm (the
library dcgm-exporter resolves them with) at a named tag: tests/fixtures/dcgm/go-dcgm-v1.4611.0-fields.csv,
its current names and its deprecated aliases (versions.yml dcgm_exporter says which renames the
exporter made since).
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from localplay import REPO

KNOWN = REPO / "tests/fixtures/dcgm/go-dcgm-v1.4611.0-fields.csv"
COLLECTORS = [
    REPO / "roles/dcgm/templates/etc/dcgm-exporter/default-counters.csv.j2",
    REPO / "observability/dcgm-exporter/counters.csv",
]


def known_fields() -> dict[str, tuple[int, str]]:
    rows = [line for line in KNOWN.read_text().splitlines() if not line.startswith("#")]
    return {row["name"]: (int(row["id"]), row["map"]) for row in csv.DictReader(rows)}


def collector_fields(path: Path) -> list[str]:
    """The field column of a dcgm-exporter collectors file (comments and template lines skipped)."""
    names = []
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text or text.startswith(("#", "{%", "{{")):
            continue
        names.append(text.split(",")[0].strip())
    return names


def test_the_recorded_list_is_whole() -> None:
    """The record holds both of go-dcgm's maps at that tag (661 current names, 362 aliases)."""
    fields = known_fields()
    current = {name: fid for name, (fid, kind) in fields.items() if kind == "current"}
    assert len(current) == 661 and len(fields) - len(current) == 362
    # An alias resolves to the id its current name has (the exporter's collectors still use aliases).
    assert fields["DCGM_FI_DEV_GPU_UTIL"] == (203, "legacy")
    assert fields["DCGM_FI_DRIVER_VERSION"] == (1, "legacy")


@pytest.mark.parametrize("path", COLLECTORS, ids=lambda p: p.name)
def test_every_collector_field_is_a_known_dcgm_field(path: Path) -> None:
    names = collector_fields(path)
    assert len(names) >= 10, names
    unknown = sorted(set(names) - set(known_fields()))
    assert not unknown, f"{path.relative_to(REPO)} names fields go-dcgm v1.4611.0 does not know: {unknown}"
