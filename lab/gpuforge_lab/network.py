"""The lab network: one Linux bridge per lab, one network namespace + veth pair per host.

Hosts get only a connected /24 route and no default route, so the only places they can
reach are each other and the control host's bridge address (where the package proxy listens).
"""

from __future__ import annotations

from pathlib import Path

from gpuforge_lab import system


def bridge_name(index: int) -> str:
    return f"gf{index}br"


def veth_name(index: int, host_number: int) -> str:
    return f"gf{index}v{host_number}"  # Interface names are limited to 15 characters.


def create_bridge(name: str, gateway: str) -> None:
    if Path(f"/sys/class/net/{name}").exists():
        system.run(["ip", "link", "del", name])
    system.run(["ip", "link", "add", name, "type", "bridge"])
    system.run(["ip", "addr", "add", f"{gateway}/24", "dev", name])
    system.run(["ip", "link", "set", name, "up"])


def delete_bridge(name: str) -> None:
    if Path(f"/sys/class/net/{name}").exists():
        system.run(["ip", "link", "del", name])


def create_host_link(netns: str, veth: str, bridge: str, ip: str) -> None:
    if Path(f"/run/netns/{netns}").exists():
        delete_host_link(netns, veth)
    system.run(["ip", "netns", "add", netns])
    system.run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns])
    system.run(["ip", "link", "set", veth, "master", bridge, "up"])
    system.run(["ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", "eth0"])
    system.run(["ip", "-n", netns, "link", "set", "eth0", "up"])
    system.run(["ip", "-n", netns, "link", "set", "lo", "up"])


def delete_host_link(netns: str, veth: str) -> None:
    if Path(f"/sys/class/net/{veth}").exists():
        system.run(["ip", "link", "del", veth])
    if Path(f"/run/netns/{netns}").exists():
        system.run(["ip", "netns", "del", netns])
