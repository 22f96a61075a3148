"""Options more than one command takes, registered and read in one place."""

from __future__ import annotations

import argparse

from gpuforge.pcluster.config import QUEUE_UPDATE_STRATEGIES
from gpuforge.pcluster.rollout import ConfigChange

CLUSTER_WIDE_HELP = (
    "set the cluster-wide Image.CustomAmi and Image.Os instead, for a cluster not created yet "
    "(pcluster update-cluster refuses that change on an existing cluster)"
)


def add_config_change(
    parser: argparse.ArgumentParser, queue_metavar: str, queue_help: str, strategy_help: str
) -> None:
    """How a config takes an image (`cluster-config set-ami`, `publish`, `bake`): read by config_change."""
    parser.add_argument("--queue", action="append", metavar=queue_metavar, help=queue_help)
    parser.add_argument("--cluster-wide", action="store_true", help=CLUSTER_WIDE_HELP)
    parser.add_argument("--queue-update-strategy", choices=QUEUE_UPDATE_STRATEGIES, help=strategy_help)
    parser.add_argument(
        "--fleet-stopped",
        action="store_true",
        help="judge the update as pcluster does with the compute fleet stopped (default: running)",
    )


def config_change(args: argparse.Namespace) -> ConfigChange:
    """The ConfigChange that add_config_change's options ask for."""
    return ConfigChange(
        queues=args.queue,
        cluster_wide=args.cluster_wide,
        queue_update_strategy=args.queue_update_strategy,
        fleet_stopped=args.fleet_stopped,
    )
