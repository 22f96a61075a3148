"""Placement groups (and CopyImage's TagSpecifications) for moto: test-double extensions, since moto 5
does not implement them.

gpuforge's lab and tests need cluster placement groups (EFA fleets live in one), and moto
answers CreatePlacementGroup with NotImplementedError. This module adds Create/Describe/
DeletePlacementGroup to moto's EC2 responses, backed by a per-region dict on the EC2 backend,
and makes RunInstances record Placement.GroupName on the instance (moto drops it). It is only
ever imported into the moto_server process (see motoserver.py), never into production code.
"""

from __future__ import annotations

import itertools
from typing import Any

from moto.core.responses import ActionResult
from moto.ec2.exceptions import EC2ClientError, InvalidParameterValue
from moto.ec2.models import EC2Backend
from moto.ec2.models.elastic_network_interfaces import Attachment
from moto.ec2.models.instances import Instance
from moto.ec2.responses import EC2Response

_STRATEGIES = {"cluster", "spread", "partition"}
_ids = itertools.count(1)


class _DuplicateGroupError(EC2ClientError):
    def __init__(self, name: str) -> None:
        super().__init__("InvalidPlacementGroup.Duplicate", f"The placement group '{name}' already exists.")


class _UnknownGroupError(EC2ClientError):
    def __init__(self, name: str) -> None:
        super().__init__("InvalidPlacementGroup.Unknown", f"The placement group '{name}' is unknown.")


def _groups(backend: EC2Backend) -> dict[str, dict[str, Any]]:
    if not hasattr(backend, "gpuforge_placement_groups"):
        backend.gpuforge_placement_groups = {}  # type: ignore[attr-defined]
    groups: dict[str, dict[str, Any]] = backend.gpuforge_placement_groups  # type: ignore[attr-defined]
    return groups


def create_placement_group(self: EC2Response) -> ActionResult:
    name = self._get_param("GroupName")
    strategy = self._get_param("Strategy", "cluster")
    if strategy not in _STRATEGIES:
        raise InvalidParameterValue(f"Invalid placement group strategy: {strategy}")
    self.error_on_dryrun()
    groups = _groups(self.ec2_backend)
    if name in groups:
        raise _DuplicateGroupError(name)
    tags = self._parse_tag_specification().get("placement-group", {})
    group_id = f"pg-{next(_ids):017x}"
    groups[name] = {
        "GroupName": name,
        "GroupId": group_id,
        "GroupArn": f"arn:aws:ec2:{self.region}:{self.current_account}:placement-group/{name}",
        "Strategy": strategy,
        "State": "available",
        "PartitionCount": int(self._get_param("PartitionCount", 0) or 0) or None,
        "Tags": [{"Key": k, "Value": v} for k, v in tags.items()],
    }
    return ActionResult({"PlacementGroup": groups[name]})


def describe_placement_groups(self: EC2Response) -> ActionResult:
    names = self._get_param("GroupNames", [])
    ids = self._get_param("GroupIds", [])
    groups = _groups(self.ec2_backend)
    for name in names:
        if name not in groups:
            raise _UnknownGroupError(name)
    selected = [
        g
        for g in groups.values()
        if (not names or g["GroupName"] in names) and (not ids or g["GroupId"] in ids)
    ]
    return ActionResult({"PlacementGroups": selected})


def delete_placement_group(self: EC2Response) -> ActionResult:
    name = self._get_param("GroupName")
    self.error_on_dryrun()
    if _groups(self.ec2_backend).pop(name, None) is None:
        raise _UnknownGroupError(name)
    return ActionResult({})


_original_run_instances = EC2Response.run_instances


def run_instances(self: EC2Response) -> ActionResult:
    group_name = self._get_param("Placement.GroupName")
    if group_name and group_name not in _groups(self.ec2_backend):
        raise _UnknownGroupError(group_name)
    before = {i.id for i in self.ec2_backend.all_instances()}
    result = _original_run_instances(self)
    if group_name:
        for instance in self.ec2_backend.all_instances():
            if instance.id not in before:
                instance.placement.group_name = group_name
    return result


_original_copy_image = EC2Response.copy_image


def copy_image(self: EC2Response) -> ActionResult:
    """CopyImage with TagSpecifications: EC2 tags the new image and its new snapshots (Amazon EC2 API
    Reference, CopyImage); moto drops them."""
    result = _original_copy_image(self)
    tags = self._parse_tag_specification()
    created: dict[str, str] = result.result  # type: ignore[assignment]
    image = self.ec2_backend.amis[created["ImageId"]]
    image.add_tags(tags.get("image", {}))
    image.ebs_snapshot.add_tags(tags.get("snapshot", {}))
    return result


_original_prep_nics = Instance.prep_nics
_original_attachment_init = Attachment.__init__


def prep_nics(self: Instance, nic_spec: list[dict[str, Any]], *args: Any, **kwargs: Any) -> None:
    """Keep InterfaceType (efa) and attach one ENI per network card, as EC2 does on p4d/p5.

    moto keys an instance's NICs by device index alone, so a second network card's
    DeviceIndex-0 interface would replace the first; extra cards get their own slot here.
    """
    first_card = [n for n in nic_spec if int(n.get("NetworkCardIndex", 0) or 0) == 0]
    other_cards = [n for n in nic_spec if int(n.get("NetworkCardIndex", 0) or 0) > 0]
    _original_prep_nics(self, first_card, *args, **kwargs)
    for spec in first_card:
        nic = self.nics.get(int(spec.get("DeviceIndex", 0)))
        if nic is not None:
            nic.interface_type = spec.get("InterfaceType", "interface")
            nic.network_card_index = 0  # type: ignore[attr-defined]
    for spec in other_cards:
        card = int(spec["NetworkCardIndex"])
        device_index = int(spec.get("DeviceIndex", 1))
        subnet = self.ec2_backend.get_subnet(spec.get("SubnetId") or self.subnet_id)
        nic = self.ec2_backend.create_network_interface(
            subnet,
            spec.get("PrivateIpAddress"),
            device_index=device_index,
            group_ids=spec.get("Groups") or [],
        )
        nic.interface_type = spec.get("InterfaceType", "interface")
        nic.network_card_index = card
        self.attach_eni(nic, 1000 * card + device_index)
        nic.device_index = device_index


def attachment_init(self: Attachment, eni: Any) -> None:
    _original_attachment_init(self, eni)
    self.network_card_index = getattr(eni, "network_card_index", 0)


def install() -> None:
    """Patch moto's EC2 responses in this process."""
    EC2Response.create_placement_group = create_placement_group  # type: ignore[attr-defined]
    EC2Response.describe_placement_groups = describe_placement_groups  # type: ignore[attr-defined]
    EC2Response.delete_placement_group = delete_placement_group  # type: ignore[attr-defined]
    EC2Response.run_instances = run_instances  # type: ignore[method-assign,assignment]
    EC2Response.copy_image = copy_image  # type: ignore[method-assign,assignment]
    Instance.prep_nics = prep_nics  # type: ignore[method-assign]
    Attachment.__init__ = attachment_init  # type: ignore[method-assign]
