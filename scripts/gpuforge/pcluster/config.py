"""Read, write and patch ParallelCluster 3 cluster configs (YAML) and find the AMIs they reference.

The AMI pipeline imports these functions: `set_custom_ami` to roll a new golden AMI into a config and
`custom_amis` so that pruning never deregisters an AMI a config still uses.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from gpuforge.amiid import check_ami_id, is_ami_id
from gpuforge.errors import UserError

LOG = logging.getLogger(__name__)


def load_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """Parse a YAML file that must hold a mapping; a missing file, bad YAML or other shape is a user error."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UserError(f"{what} {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{what} {path} must be a YAML mapping")
    return data


# Keys only a cluster spec has (gpuforge.pcluster.generate's required fields), never a cluster config.
_SPEC_KEYS = {"head_node", "queues"}


def refuse_spec(data: dict[str, Any], path: Path) -> None:
    """A cluster spec where a cluster config is wanted: say so, and how to write the config from it."""
    if "Scheduling" not in data and "HeadNode" not in data and _SPEC_KEYS & set(map(str, data)):
        raise UserError(
            f"{path} is a cluster spec (head_node, queues), not a ParallelCluster cluster config: write the "
            f"config with `gpuforge cluster-config generate {path} -o cluster.yaml` and pass cluster.yaml"
        )


def load_config(path: Path) -> dict[str, Any]:
    """Parse a cluster config file (Region, Image, HeadNode, Scheduling, ...)."""
    data = load_yaml_mapping(path, "cluster config")
    refuse_spec(data, path)
    return data


def _round_trip() -> Any:
    from ruamel.yaml import YAML

    yaml_rt = YAML(typ="rt")
    yaml_rt.preserve_quotes = True
    # ParallelCluster's documentation and `cluster-config generate` indent lists under their key.
    yaml_rt.indent(mapping=2, sequence=4, offset=2)
    yaml_rt.width = 4096
    return yaml_rt


def load_document(path: Path) -> dict[str, Any]:
    """A cluster config as an editable document: writing it back keeps comments, key order and quoting."""
    from ruamel.yaml.error import YAMLError

    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"cannot read cluster config {path}: {exc.strerror}") from None
    try:
        data = _round_trip().load(text)
    except YAMLError as exc:
        raise UserError(f"cluster config {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"cluster config {path} must be a YAML mapping")
    refuse_spec(data, path)
    return data


def plain(value: Any) -> Any:
    """A document (or part of one) as plain dicts, lists and scalars, for checks that expect those."""
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, int | bool) else k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    for kind in (int, float, str):
        if isinstance(value, kind):
            return kind(value)
    return value


def document_text(document: dict[str, Any]) -> str:
    """A document from load_document rendered back, comments and quoting as they were."""
    import io

    out = io.StringIO()
    _round_trip().dump(document, out)
    return out.getvalue()


def dump_document(document: dict[str, Any], path: Path) -> None:
    """Write a document from load_document atomically, comments and quoting as they were."""
    _write_atomically(document_text(document), path)


def to_yaml(config: dict[str, Any]) -> str:
    """Render a config as block YAML in its own key order (ParallelCluster's documented order)."""
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False, allow_unicode=True)


def dump_config(config: dict[str, Any], path: Path) -> None:
    """Write a generated config atomically (plain YAML; edits of existing files use dump_document)."""
    _write_atomically(to_yaml(config), path)


def _write_atomically(text: str, path: Path) -> None:
    """Write text so that a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _items(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, list):
        yield from (item for item in value if isinstance(item, dict))


def _queues(config: dict[str, Any]) -> list[dict[str, Any]]:
    return list(_items(_mapping(config.get("Scheduling")).get("SlurmQueues")))


def _image_holders(config: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every section that may carry an Image.CustomAmi: cluster, head node, each queue, each login pool."""
    yield config
    yield _mapping(config.get("HeadNode"))
    yield from _queues(config)
    yield from _items(_mapping(config.get("LoginNodes")).get("Pools"))


def custom_amis(config: dict[str, Any]) -> set[str]:
    """Every AMI id the config references; tolerates partial configs, since prune reads arbitrary ones."""
    found: set[str] = set()
    for holder in _image_holders(config):
        ami = _mapping(holder.get("Image")).get("CustomAmi")
        if isinstance(ami, str) and ami:
            found.add(ami)
    return found


def image_shape_errors(config: dict[str, Any]) -> list[str]:
    """Where an image may be named, what does not have ParallelCluster's shape (empty when all do).

    `custom_amis` skips what it cannot read; a caller that must not miss an image (prune) checks this
    first, so that e.g. `Image: ami-...` (a string, not a mapping) is an error rather than nothing.
    """
    errors: list[str] = []

    def mapping(value: Any, path: str) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            errors.append(f"{path} must be a mapping, not {type(value).__name__} {value!r}")
            return {}
        return value

    def items(value: Any, path: str) -> list[tuple[str, dict[str, Any]]]:
        if value is None:
            return []
        if not isinstance(value, list):
            errors.append(f"{path} must be a list, not {type(value).__name__}")
            return []
        return [(f"{path}[{i}]", mapping(item, f"{path}[{i}]")) for i, item in enumerate(value)]

    holders = [("", config), ("HeadNode.", mapping(config.get("HeadNode"), "HeadNode"))]
    scheduling = mapping(config.get("Scheduling"), "Scheduling")
    holders += [
        (f"{path}.", queue) for path, queue in items(scheduling.get("SlurmQueues"), "Scheduling.SlurmQueues")
    ]
    login = mapping(config.get("LoginNodes"), "LoginNodes")
    holders += [(f"{path}.", pool) for path, pool in items(login.get("Pools"), "LoginNodes.Pools")]
    for prefix, holder in holders:
        image = mapping(holder.get("Image"), f"{prefix}Image")
        ami = image.get("CustomAmi")
        if ami is not None and not is_ami_id(ami):
            errors.append(f"{prefix}Image.CustomAmi {ami!r} is not an AMI id")
    return errors


# ParallelCluster's QueueUpdateStrategy values (aws-parallelcluster 3.16.1,
# pcluster/config/cluster_config.py QueueUpdateStrategy). gpuforge writes DRAIN where a config sets
# none: nodes of a queue with a new image are replaced as their jobs end, and no job is killed.
QUEUE_UPDATE_STRATEGIES = ("DRAIN", "TERMINATE", "COMPUTE_FLEET_STOP")
DEFAULT_QUEUE_UPDATE_STRATEGY = "DRAIN"


def _set_cluster_ami(patched: dict[str, Any], ami_id: str, os: str | None) -> None:
    image = patched.get("Image")
    if image is None:
        image = patched["Image"] = {}
    elif not isinstance(image, dict):
        raise UserError("the config's Image must be a mapping (Os, CustomAmi)")
    image["CustomAmi"] = ami_id
    if os is not None:
        image["Os"] = os
    # A node group's own Image.CustomAmi wins over the cluster-wide one; say so rather than skip it.
    pinned = [f"queue {q.get('Name')}" for q in _queues(patched) if custom_amis({"Image": q.get("Image")})]
    if custom_amis({"Image": _mapping(patched.get("HeadNode")).get("Image")}):
        pinned.insert(0, "the head node")
    if pinned:
        LOG.warning("%s keep their own Image.CustomAmi (queues: use --queue)", ", ".join(pinned))


def _set_strategy(patched: dict[str, Any], strategy: str | None) -> None:
    """Scheduling.SlurmSettings.QueueUpdateStrategy: strategy if given, else the config's, else DRAIN."""
    if strategy is not None and strategy not in QUEUE_UPDATE_STRATEGIES:
        raise UserError(
            f"unknown QueueUpdateStrategy {strategy!r}; choose one of {', '.join(QUEUE_UPDATE_STRATEGIES)}"
        )
    scheduling = patched.get("Scheduling")
    if not isinstance(scheduling, dict):
        raise UserError("the config's Scheduling must be a mapping (Scheduler, SlurmQueues)")
    settings = scheduling.get("SlurmSettings")
    if settings is None:
        settings = {}
        keys = list(scheduling)
        # Before SlurmQueues, where ParallelCluster's documentation puts it; a plain dict appends.
        at = keys.index("SlurmQueues") if "SlurmQueues" in keys else len(keys)
        if hasattr(scheduling, "insert"):
            scheduling.insert(at, "SlurmSettings", settings)
        else:
            scheduling["SlurmSettings"] = settings
    elif not isinstance(settings, dict):
        raise UserError("the config's Scheduling.SlurmSettings must be a mapping")
    if strategy is not None:
        settings["QueueUpdateStrategy"] = strategy
    elif not settings.get("QueueUpdateStrategy"):
        settings["QueueUpdateStrategy"] = DEFAULT_QUEUE_UPDATE_STRATEGY


def set_queue_update_strategy(config: dict[str, Any], strategy: str) -> None:
    """Write Scheduling.SlurmSettings.QueueUpdateStrategy in place (gpuforge roll's revision route)."""
    _set_strategy(config, strategy)


def set_custom_ami(
    config: dict[str, Any],
    ami_id: str,
    queues: Sequence[str] | None = None,
    *,
    cluster_wide: bool = False,
    queue_update_strategy: str | None = None,
    os: str | None = None,
) -> dict[str, Any]:
    """Return a copy of config whose Slurm queues (all, or the named ones) use ami_id.

    Only a queue's Image.CustomAmi can change on a running cluster (update policy QUEUE_UPDATE_STRATEGY;
    the cluster-wide Image.CustomAmi is UNSUPPORTED: aws-parallelcluster 3.16.1,
    pcluster/schemas/cluster_schema.py QueueImageSchema / ImageSchema), and only with a
    QueueUpdateStrategy or a stopped fleet, so the copy also carries Scheduling.SlurmSettings.
    QueueUpdateStrategy (queue_update_strategy, else the config's own, else DRAIN).

    cluster_wide=True sets the cluster-wide Image.CustomAmi (and Image.Os to os, when given) instead:
    for a cluster not created yet. A document from load_document stays one: the copy keeps its
    comments, order and quoting.
    """
    check_ami_id(ami_id)
    if isinstance(queues, str):
        raise TypeError("queues must be a sequence of queue names, not a string")
    patched = copy.deepcopy(config)
    if cluster_wide:
        if queues is not None:
            raise UserError("give queues or the cluster-wide image, not both")
        _set_cluster_ami(patched, ami_id, os)
        return patched
    by_name = {str(q.get("Name")): q for q in _queues(patched)}
    if queues is None:
        queues = list(by_name)
        if not queues:
            raise UserError("the config has no Slurm queue (Scheduling.SlurmQueues) to give the image")
    elif not queues:
        raise UserError("no queue named: give at least one queue, or none for every queue")
    unknown = [name for name in queues if name not in by_name]
    if unknown:
        known = ", ".join(str(name) for name in by_name) or "none"
        raise UserError(f"unknown queue(s) {', '.join(unknown)}; the config's Slurm queues are: {known}")
    for name in queues:
        queue = by_name[name]
        image = queue.get("Image")
        if image is None:
            image = queue["Image"] = {}
        elif not isinstance(image, dict):
            raise UserError(f"Scheduling.SlurmQueues {name}: Image must be a mapping (CustomAmi)")
        image["CustomAmi"] = ami_id
    _set_strategy(patched, queue_update_strategy)
    return patched
