"""Parse the manifest Packer's manifest post-processor writes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuforge.errors import ExternalError


@dataclass(frozen=True)
class Artifact:
    """One build of the last Packer run: its source and the images it produced per region."""

    name: str
    builder_type: str
    images: dict[str, str]  # region -> AMI id; empty for the null (lab) source
    custom_data: dict[str, str]
    build_time: int


def last_run(path: Path) -> list[Artifact]:
    """The artifacts of the newest run in a manifest; Packer appends runs, keyed by packer_run_uuid."""
    try:
        data: Any = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExternalError(f"packer wrote no manifest at {path}; the build did not finish") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ExternalError(f"cannot read packer manifest {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("builds"), list):
        raise ExternalError(f"packer manifest {path} has no 'builds' list")
    run = data.get("last_run_uuid")
    artifacts = []
    for build in data["builds"]:
        if not isinstance(build, dict) or build.get("packer_run_uuid") != run:
            continue
        artifacts.append(
            Artifact(
                name=str(build.get("name", "")),
                builder_type=str(build.get("builder_type", "")),
                images=parse_artifact_id(str(build.get("artifact_id", ""))),
                custom_data={str(k): str(v) for k, v in (build.get("custom_data") or {}).items()},
                build_time=int(build.get("build_time", 0)),
            )
        )
    if not artifacts:
        raise ExternalError(f"packer manifest {path} lists no build for its last run {run!r}")
    return artifacts


def parse_artifact_id(artifact_id: str) -> dict[str, str]:
    """amazon-ebs writes 'us-east-1:ami-1,eu-west-1:ami-2'; other builders write something without ':ami-'."""
    images: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in artifact_id.split(","))):
        region, sep, ami = part.partition(":")
        if sep and ami.startswith("ami-"):
            images[region] = ami
    return images


def image_in(artifacts: list[Artifact], region: str) -> str:
    """The one AMI the run registered in region."""
    found = [a.images[region] for a in artifacts if region in a.images]
    if len(found) != 1:
        raise ExternalError(
            f"expected one AMI in {region} from the packer run, the manifest lists {found or 'none'}"
        )
    return found[0]
