"""Give a cluster config a new image the way a running cluster can take it, checked before it is written.

`gpuforge publish --cluster-config` and `gpuforge cluster-config set-ami` both come here: the Slurm queues
get the image (gpuforge.pcluster.config.set_custom_ami), the result must pass ParallelCluster's schema,
the image must suit every node group that launches from it (OS, root volume: validate.image_errors), and
ParallelCluster's own update check (gpuforge.pcluster.update) must accept the change, unless the
cluster-wide image of a cluster not created yet was asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuforge.errors import UserError
from gpuforge.pcluster import config as pcluster_config
from gpuforge.pcluster import update
from gpuforge.pcluster.validate import AmiFacts, image_errors, image_facts, validate

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConfigChange:
    """How to give a config the image (see gpuforge.pcluster.config.set_custom_ami)."""

    queues: Sequence[str] | None = None  # None: every Slurm queue
    cluster_wide: bool = False  # the cluster-wide Image.CustomAmi, for a cluster not created yet
    queue_update_strategy: str | None = None  # None: the config's own, else DRAIN
    fleet_stopped: bool = False  # judge the update as with a stopped compute fleet


@dataclass(frozen=True)
class Patched:
    document: dict[str, Any]  # still a round-trip document when given one
    plan: update.Plan


def image_for(ami_id: str, region: str | None, force: bool, target: str) -> AmiFacts | None:
    """The image checked as one a ParallelCluster config may take (gpuforge.fitness), and its OS and root
    volume size; `force` turns the fitness findings into warnings."""
    # Imported here: only the image route reads images from EC2 (boto3).
    from gpuforge import fitness

    fitness.require(ami_id, region, flavor=None, for_pcluster=True, force=force, target=target)
    return image_facts(ami_id, region, force)


def patch(
    document: dict[str, Any], ami_id: str, facts: AmiFacts | None, change: ConfigChange, source: str
) -> Patched:
    """document with ami_id, or a UserError naming source and each reason it cannot take it."""
    patched = pcluster_config.set_custom_ami(
        document,
        ami_id,
        change.queues,
        cluster_wide=change.cluster_wide,
        queue_update_strategy=change.queue_update_strategy,
        os=facts.os if facts is not None else None,
    )
    new = pcluster_config.plain(patched)
    validate(new)
    problems = image_errors(new, {ami_id: facts}) if facts is not None else []
    if problems:
        raise UserError(f"{source} cannot take image {ami_id}:\n  " + "\n  ".join(problems))
    plan = update.plan(pcluster_config.plain(document), new, fleet_running=not change.fleet_stopped)
    if not plan.accepted:
        text = "\n".join(plan.lines())
        if not change.cluster_wide:
            raise UserError(f"{source}: {text}")
        LOG.warning("%s: fine for a cluster not created yet (--cluster-wide), but %s", source, text)
    return Patched(patched, plan)
