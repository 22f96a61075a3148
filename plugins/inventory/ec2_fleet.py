"""Ansible inventory gpuforge.gpu.ec2_fleet: running ParallelCluster fleets, built for large fleets.

It builds the groups inventory/aws_ec2.yml builds with amazon.aws.aws_ec2 (tests/test_inventory.py
compares both on one moto fleet), but keeps only the host variables the roles and playbooks read,
computes groups in Python instead of compiling Jinja expressions per host, and caches the reduced
host records instead of EC2's whole answer (a p5 with 32 EFA interfaces describes itself in ~40 KB).
docs/performance.md has the figures (bench/inventory.py).
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: ec2_fleet
author: gpuforge (@gpuforge)
short_description: Running ParallelCluster fleets on EC2, grouped for the gpuforge roles
description:
  - Lists the running EC2 instances that carry the ParallelCluster tag C(parallelcluster:cluster-name),
    in one or more regions, with boto3 paginators and botocore's retry modes.
  - Groups every host as inventory/aws_ec2.yml does with amazon.aws.aws_ec2 (C(aws_ec2), C(cluster_<name>),
    C(node_type_<type>), C(queue_<name>), C(compute_resource_<name>), C(instance_type_<type>), C(az_<zone>),
    C(head_node), C(compute), C(gpu) and C(gpuforge_lab)).
  - Sets only the host variables the roles and playbooks read - C(ansible_host) (the private IP),
    C(gpuforge_cluster_name), C(gpuforge_node_type), C(gpuforge_queue), C(gpuforge_compute_resource),
    C(gpuforge_instance_type), C(gpuforge_node_name), C(aws_image_id), C(aws_instance_id) and C(aws_region) -
    and caches those records (not EC2's whole answer) in Ansible's inventory cache.
  - The inventory file's name must end with C(ec2_fleet.yml) or C(ec2_fleet.yaml).
  - An unreachable endpoint, missing credentials or a refused call end in one line naming the cause.
  - The caller needs C(ec2:DescribeInstances) in each region (the pipeline's IAM policy does not cover
    inventories, which operators run).
extends_documentation_fragment:
  - inventory_cache
requirements:
  - boto3
options:
  plugin:
    description: The name of this plugin; marks the file as its configuration.
    required: true
    type: str
    choices: [gpuforge.gpu.ec2_fleet]
  regions:
    description:
      - The regions to list. Without it, C(AWS_REGION), else C(AWS_DEFAULT_REGION), else C(us-east-1).
    type: list
    elements: str
    default: []
    # Ansible takes the last variable of this list that is set.
    env:
      - name: AWS_DEFAULT_REGION
      - name: AWS_REGION
  cluster_names:
    description:
      - Only these ParallelCluster clusters (their C(parallelcluster:cluster-name) tag).
      - Empty lists every cluster.
    type: list
    elements: str
    default: []
  profile:
    description: The AWS profile whose credentials are used; without it, boto3's default chain.
    type: str
    env:
      - name: AWS_PROFILE
  endpoint_url:
    description:
      - The EC2 endpoint, for an emulator or a VPC endpoint; without it, the region's public endpoint.
      - From the environment, the first set of C(AWS_ENDPOINT_URL_EC2), C(AWS_ENDPOINT_URL) and C(AWS_URL).
    type: str
    # Ansible takes the last variable of this list that is set.
    env:
      - name: AWS_URL
      - name: AWS_ENDPOINT_URL
      - name: AWS_ENDPOINT_URL_EC2
  retry_mode:
    description: botocore's retry mode; C(adaptive) also limits the client's own request rate when throttled.
    type: str
    choices: [standard, adaptive]
    default: adaptive
  max_attempts:
    description: Attempts per API call, the first included (botocore's C(max_attempts)).
    type: int
    default: 10
  connect_timeout:
    description: Seconds to wait for a connection to the endpoint.
    type: int
    default: 10
  read_timeout:
    description: Seconds to wait for one page of the answer.
    type: int
    default: 60
  page_size:
    description: Instances per describe_instances page (EC2 allows 5 to 1000).
    type: int
    default: 1000
"""

EXAMPLES = r"""
# inventory/ec2_fleet.yml: every running ParallelCluster node in the environment's region,
# cached for five minutes (--flush-cache forces a fresh answer).
plugin: gpuforge.gpu.ec2_fleet
cache: true
cache_plugin: ansible.builtin.jsonfile
cache_timeout: 300
cache_prefix: ec2_fleet

# Two regions, one cluster, throttled API: fewer attempts, standard retries.
# plugin: gpuforge.gpu.ec2_fleet
# regions: [us-east-1, us-west-2]
# cluster_names: [training]
# retry_mode: standard
# max_attempts: 5
"""

import re
from collections.abc import Iterator, Mapping
from typing import Any

from ansible.errors import AnsibleParserError
from ansible.plugins.inventory import BaseInventoryPlugin, Cacheable
from ansible.utils.unsafe_proxy import wrap_var

CLUSTER_TAG = "parallelcluster:cluster-name"
# ParallelCluster's tags (the same keys inventory/aws_ec2.yml reads) -> the record's fields.
TAGS = {
    CLUSTER_TAG: "cluster",
    "parallelcluster:node-type": "node_type",
    "parallelcluster:queue-name": "queue",
    "parallelcluster:compute-resource-name": "compute_resource",
    "Name": "name_tag",
}
# The lab's marker tag (gpuforge-lab up); its hosts join the gpuforge_lab group.
LAB_TAG = "gpuforge:lab"
# inventory/aws_ec2.yml's `gpu` group: instance types matching this (p3-p6, g4-g6 families).
GPU_TYPE = re.compile(r"^(p[3-6]|g[4-6])")
# keyed group prefix -> record field, in inventory/aws_ec2.yml's order.
KEYED = (
    ("cluster", "cluster"),
    ("node_type", "node_type"),
    ("queue", "queue"),
    ("compute_resource", "compute_resource"),
    ("instance_type", "instance_type"),
    ("az", "az"),
)
Record = dict[str, Any]


def record(instance: Mapping[str, Any], region: str) -> Record | None:
    """The few fields of one described instance the inventory needs; None without a private name or IP."""
    name = instance.get("PrivateDnsName") or instance.get("PrivateIpAddress")
    if not name:
        return None
    tags = {t.get("Key"): t.get("Value", "") for t in instance.get("Tags") or []}
    rec: Record = {
        "host": name,
        "ip": instance.get("PrivateIpAddress"),
        "dns": instance.get("PrivateDnsName"),
        "instance_type": instance.get("InstanceType"),
        "az": (instance.get("Placement") or {}).get("AvailabilityZone"),
        "image_id": instance.get("ImageId"),
        "instance_id": instance.get("InstanceId"),
        "region": region,
        "lab": LAB_TAG in tags,
    }
    for key, field in TAGS.items():
        if key in tags:
            rec[field] = tags[key]
    return rec


def host_vars(rec: Record) -> dict[str, Any]:
    """The host variables, named as inventory/aws_ec2.yml's compose names them."""
    out: dict[str, Any] = {
        "gpuforge_instance_type": rec["instance_type"],
        "gpuforge_node_name": rec.get("name_tag") or rec["dns"],
        "aws_image_id": rec["image_id"],
        "aws_instance_id": rec["instance_id"],
        "aws_region": rec["region"],
    }
    if rec.get("ip"):
        out["ansible_host"] = rec["ip"]
    for field, var in (
        ("cluster", "gpuforge_cluster_name"),
        ("node_type", "gpuforge_node_type"),
        ("queue", "gpuforge_queue"),
        ("compute_resource", "gpuforge_compute_resource"),
    ):
        if field in rec:
            out[var] = rec[field]
    return out


def group_names(rec: Record) -> Iterator[str]:
    """Unsanitized names of the groups one host joins (as inventory/aws_ec2.yml's keyed_groups and groups)."""
    yield "aws_ec2"
    for prefix, field in KEYED:
        # keyed_groups skip an undefined or empty key.
        if rec.get(field):
            yield f"{prefix}_{rec[field]}"
    if rec.get("node_type") == "HeadNode":
        yield "head_node"
    if rec.get("node_type") == "Compute":
        yield "compute"
    if GPU_TYPE.match(rec.get("instance_type") or ""):
        yield "gpu"
    if rec.get("lab"):
        yield "gpuforge_lab"


def unparsed(value: str) -> str:
    """botocore's timestamp parser for the inventory's client: the text as sent, unparsed."""
    return value


def ec2_client(boto3: Any, region: str, profile: str | None, endpoint_url: str | None, config: Any) -> Any:
    """An EC2 client that leaves timestamps as EC2 sent them (the records read none).

    botocore turns every timestamp of an answer into a datetime with dateutil's general parser: a p5
    describes 32 interface attachment times, and at 1,000 such hosts that parsing was about 45% of
    the whole describe under cProfile (docs/performance.md). The AWS CLI keeps timestamps as sent the
    same way: set_parser_defaults(timestamp_parser=identity) in
    https://github.com/aws/aws-cli/blob/develop/awscli/customizations/scalarparse.py
    """
    import botocore.session

    core = botocore.session.get_session()
    core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=unparsed)
    session = boto3.session.Session(botocore_session=core, profile_name=profile)
    return session.client("ec2", region_name=region, endpoint_url=endpoint_url, config=config)


class InventoryModule(BaseInventoryPlugin, Cacheable):  # type: ignore[misc]
    NAME = "gpuforge.gpu.ec2_fleet"

    def verify_file(self, path: str) -> bool:
        return bool(super().verify_file(path)) and path.endswith(("ec2_fleet.yml", "ec2_fleet.yaml"))

    def parse(self, inventory: Any, loader: Any, path: str, cache: bool = True) -> None:
        super().parse(inventory, loader, path, cache)
        self._read_config_data(path)
        key = self.get_cache_key(path)
        use_cache = bool(self.get_option("cache"))
        records: list[Record] | None = None
        if use_cache and cache:
            try:
                records = self._cache[key]
            except KeyError:
                records = None
        if records is None:
            records = self._describe()
            if use_cache:
                self._cache[key] = records
        self._populate(records)

    def _regions(self) -> list[str]:
        regions = [r for r in self.get_option("regions") or [] if r]
        return regions or ["us-east-1"]

    def _describe(self) -> list[Record]:
        """Every running ParallelCluster instance of every region, reduced to its record."""
        try:
            import boto3
            from botocore.config import Config
            from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
        except ImportError as e:
            raise AnsibleParserError(f"gpuforge.gpu.ec2_fleet needs boto3 on the controller: {e}") from None
        config = Config(
            retries={"mode": self.get_option("retry_mode"), "max_attempts": self.get_option("max_attempts")},
            connect_timeout=self.get_option("connect_timeout"),
            read_timeout=self.get_option("read_timeout"),
            user_agent_extra="gpuforge-ec2-fleet",
        )
        filters = [
            {"Name": "instance-state-name", "Values": ["running"]},
            {"Name": "tag-key", "Values": [CLUSTER_TAG]},
        ]
        if self.get_option("cluster_names"):
            filters.append({"Name": f"tag:{CLUSTER_TAG}", "Values": list(self.get_option("cluster_names"))})
        records: list[Record] = []
        for region in self._regions():
            try:
                ec2 = ec2_client(
                    boto3, region, self.get_option("profile"), self.get_option("endpoint_url"), config
                )
                pages = ec2.get_paginator("describe_instances").paginate(
                    Filters=filters, PaginationConfig={"PageSize": self.get_option("page_size")}
                )
                for page in pages:
                    for reservation in page.get("Reservations", []):
                        for instance in reservation.get("Instances", []):
                            rec = record(instance, region)
                            if rec is not None:
                                records.append(rec)
            except NoCredentialsError:
                raise AnsibleParserError(
                    f"gpuforge.gpu.ec2_fleet: no AWS credentials for {region} "
                    "(set AWS_PROFILE or the AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY pair)"
                ) from None
            except ClientError as e:
                error = e.response.get("Error", {})
                raise AnsibleParserError(
                    f"gpuforge.gpu.ec2_fleet: describe_instances in {region} refused: "
                    f"{error.get('Code', 'error')}: {error.get('Message', '')}"
                ) from None
            except BotoCoreError as e:
                # EndpointConnectionError, ConnectTimeoutError, ProfileNotFound: their text names the cause.
                raise AnsibleParserError(f"gpuforge.gpu.ec2_fleet: {region}: {e}") from None
        return records

    def _populate(self, records: list[Record]) -> None:
        inventory = self.inventory
        # Hosts of one cluster, queue, type and zone join the same groups: sanitize, create and link
        # each distinct set once (5,000 hosts share a handful), not again for every host.
        groups_of: dict[tuple[Any, ...], list[str]] = {}
        for rec in records:
            name = rec["host"]
            inventory.add_host(name)
            host = inventory.hosts[name]
            # Values come from the cloud (tags anyone with ec2:CreateTags can set): never templated.
            # wrap_var untags them (on ansible-core 2.19, TrustedAsTemplate.untag), including any
            # trust tag a tampered cache file could carry. The names are this module's own valid
            # identifiers, so they go straight into the host's vars (Host.set_variable would only
            # validate them and InventoryData.set_variable also formats a debug line per call).
            host.vars.update({var: wrap_var(value) for var, value in host_vars(rec).items()})
            signature = (*(rec.get(field) for _prefix, field in KEYED), bool(rec.get("lab")))
            groups = groups_of.get(signature)
            if groups is None:
                groups = groups_of[signature] = [self._group(raw) for raw in group_names(rec)]
            for group in groups:
                inventory.add_host(name, group=group)

    def _group(self, raw: str) -> str:
        """The inventory group of one unsanitized name, created (as a child of all) on first use."""
        group: str = self.inventory.add_group(self._sanitize_group_name(raw))
        self.inventory.add_child("all", group)
        return group
