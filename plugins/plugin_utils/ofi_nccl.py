"""Which NCCL releases may run beside an aws-ofi-nccl release (data/aws_ofi_nccl.yml), once.

The roles ask it through the filter gpuforge.gpu.ofi_nccl_range (plugins/filter/ofi_nccl_range.py): the
aws_ofi_nccl role about the release it adopted or built, the nccl role about an installed NCCL and the
one it installs. Which release is in use (release_in_use) is decided here too, for both roles
(the filter gpuforge.gpu.ofi_nccl_release_in_use).

The range of a plugin release is its own row of the table; a release without a row gets the row of
the newest release older than it, with a note asking for its row (a newer plugin is assumed to work
with at least the NCCL its predecessor was tested with, never with more); a release older than every
row has no range, so no NCCL counts as compatible with it.

`rows` is gpuforge_aws_ofi_nccl_releases as the file loads (its releases quoted, so keys are strings):
release -> {nccl_min, nccl_tested_max}.
Nothing here imports Ansible or YAML.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

# Releases compare as the version policy compares them (numbers as numbers, no Debian epoch).
from ansible_collections.gpuforge.gpu.plugins.plugin_utils.policy import compare, version_key

TABLE_KEY = "gpuforge_aws_ofi_nccl_releases"


@dataclass(frozen=True)
class NcclRange:
    """The NCCL range that applies to one plugin release."""

    plugin: str  # the release asked about
    row: str  # the table row used ('' when none applies)
    nccl_min: str
    nccl_tested_max: str

    @property
    def note(self) -> str:
        """Why the range is not the release's own ('' when it is)."""
        if not self.row:
            return (
                f"aws-ofi-nccl {self.plugin} is older than every release in data/aws_ofi_nccl.yml: "
                "no NCCL range is known for it"
            )
        if compare(self.row, self.plugin) != 0:
            return (
                f"aws-ofi-nccl {self.plugin} has no row in data/aws_ofi_nccl.yml: using the range of "
                f"{self.row} (NCCL {self.nccl_min} to {self.nccl_tested_max}); "
                "add its row from its RELEASENOTES.md"
            )
        return ""

    def check(self, nccl: str) -> str:
        """Why `nccl` is outside the range ('' when it is inside, or when no NCCL is given)."""
        if not nccl.strip():
            return ""
        if not self.row:
            return f"no tested NCCL range is known for aws-ofi-nccl {self.plugin}"
        if compare(nccl, self.nccl_min) < 0:
            return f"older than {self.nccl_min}, the oldest NCCL aws-ofi-nccl {self.plugin} supports"
        if compare(nccl, self.nccl_tested_max) > 0:
            return (
                f"newer than {self.nccl_tested_max}, "
                f"the newest NCCL aws-ofi-nccl {self.plugin} is tested with"
            )
        return ""

    def describe(self, nccl: str = "") -> dict[str, str]:
        """The range, its note and why `nccl` is outside it ('outside'), as one mapping for a play."""
        return {**asdict(self), "note": self.note, "outside": self.check(nccl)}


def rows_of(data: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """The table in data/aws_ofi_nccl.yml's parsed content, with every release and bound a string;
    ValueError, saying what to fix, when it is empty or a row is not {nccl_min, nccl_tested_max}."""
    rows = data.get(TABLE_KEY)
    if not isinstance(rows, Mapping) or not rows:
        raise ValueError(
            f"{TABLE_KEY} must be a non-empty mapping of aws-ofi-nccl release -> "
            f"{{{', '.join(BOUNDS)}}} (data/aws_ofi_nccl.yml), got {_kind(rows)}"
        )
    return {str(release): _row(str(release), row) for release, row in rows.items()}


# The bounds every row gives (data/aws_ofi_nccl.yml, from each release's RELEASENOTES.md).
BOUNDS = ("nccl_min", "nccl_tested_max")


def _kind(value: Any) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {value!r}"


def _row(release: str, row: Any) -> dict[str, str]:
    """One release's row with its bounds as strings; ValueError naming the release and what is missing."""
    if not isinstance(row, Mapping):
        raise ValueError(
            f"{TABLE_KEY}[{release!r}] must be a mapping with {' and '.join(BOUNDS)}, got {_kind(row)}"
        )
    missing = [bound for bound in BOUNDS if not str(row.get(bound) or "").strip()]
    if missing:
        raise ValueError(
            f"{TABLE_KEY}[{release!r}] has no {' and no '.join(missing)}: "
            "add them from that release's RELEASENOTES.md"
        )
    return {str(k): str(v) for k, v in row.items()}


def nccl_range(plugin: str, rows: Mapping[str, Mapping[str, Any]]) -> NcclRange:
    """The NCCL range for plugin release `plugin` (see the module docstring)."""
    plugin = str(plugin or "").strip()
    older = [release for release in rows if compare(release, plugin) <= 0]
    if not plugin or not older:
        return NcclRange(plugin=plugin, row="", nccl_min="", nccl_tested_max="")
    row = max(older, key=version_key)
    return NcclRange(
        plugin=plugin,
        row=row,
        nccl_min=str(rows[row]["nccl_min"]),
        nccl_tested_max=str(rows[row]["nccl_tested_max"]),
    )


def release_in_use(
    pin: str,
    *,
    chosen: str = "",
    decision: Mapping[str, Any] | None = None,
    record: Mapping[str, Any] | None = None,
) -> str:
    """The aws-ofi-nccl release NCCL runs beside: the first of
    - `chosen`: a release the user named (the nccl role's nccl_plugin_version);
    - `decision`: the aws_ofi_nccl role's entry in the node record of this run
      (gpuforge_reality.aws_ofi_nccl): the adopted bundle's release, or the pin it builds; a refusal
      names none;
    - `record`: its record of an earlier run (/etc/gpuforge/aws_ofi_nccl.json), unless that run
      skipped the plugin (then no plugin is in use and the record's version is only the pin it wanted);
    - `pin`: versions.yml's aws_ofi_nccl.version.
    ValueError when the decision or the record is not a mapping.
    """
    for name, given in (("decision", decision), ("record", record)):
        if given is not None and not isinstance(given, Mapping):
            raise ValueError(f"{name} must be a mapping (or empty), got {_kind(given)}")
    decided = decision or {}
    recorded = record or {}
    candidates = (
        chosen,
        "" if decided.get("action") == "refuse" else decided.get("version"),
        "" if recorded.get("source") == "skipped" else recorded.get("version"),
        pin,
    )
    return next((text for text in (str(c or "").strip() for c in candidates) if text), "")
