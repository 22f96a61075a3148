"""`gpuforge-lab ...`: the local lab of real hosts plus an emulated EC2, a gpuforge checkout's test double.

`gpuforge-lab bake` bakes a lab host with the product's own bake (gpuforge.ami.bake.bake_host), given the
host as a plain SSH target; nothing of the product imports this package.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuforge import __version__
from gpuforge import cli as product_cli
from gpuforge.ami import bake as product_bake
from gpuforge.cliargs import positive_int
from gpuforge.commands import ami as ami_cli
from gpuforge.errors import ExternalError, UserError
from gpuforge_lab import core, host, images, state

LOG = logging.getLogger(__name__)
PROG = "gpuforge-lab"
DEFAULT_NAME = os.environ.get("GPUFORGE_LAB", "default")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    product_cli.add_verbose(parser)
    register(parser.add_subparsers(dest="lab_command", required=True, metavar="ACTION"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return product_cli.run(build_parser().parse_args(argv), prog=PROG)


def register(lab_sub: Any) -> None:

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = lab_sub.add_parser(name, help=help_text)
        parser.add_argument(
            "--name", default=DEFAULT_NAME, help="lab name (default: %(default)s, or $GPUFORGE_LAB)"
        )
        return parser

    p_up = add("up", "create the hosts, the package proxy and moto, and register the hosts as EC2 instances")
    p_up.add_argument(
        "--nodes", type=positive_int, default=3, help="hosts: 1 head node + N-1 compute (default 3)"
    )
    p_up.add_argument("--moto-port", type=positive_int, default=5000, help="loopback port for moto_server")
    p_up.add_argument("--no-ec2", action="store_true", help="hosts only, no moto (what Molecule uses)")
    p_up.add_argument("--cluster-name", default="lab", help="value of the parallelcluster:cluster-name tag")
    p_up.add_argument(
        "--compute-type", default="p5.48xlarge", help="instance type recorded for compute nodes"
    )
    p_up.add_argument(
        "--image", help="boot every host from this lab image (see `lab image list`) instead of plain Debian"
    )
    p_up.add_argument("--json", action="store_true", help="print the lab state as JSON")
    p_up.set_defaults(handler=_up)

    p_down = add("down", "stop and remove every host, mount, namespace and process of the lab")
    p_down.set_defaults(handler=_down)

    p_status = add("status", "show hosts, their reachability and the emulated AWS endpoint")
    p_status.add_argument("--json", action="store_true")
    p_status.set_defaults(handler=_status)

    p_env = add(
        "env", 'print shell exports for Ansible/boto3 against the lab: eval "$(gpuforge-lab env --name NAME)"'
    )
    p_env.set_defaults(handler=_env)

    _register_images(lab_sub, add)

    p_ssh = add("ssh", "open SSH to a lab host, or run a command there")
    p_ssh.add_argument("host", help="host name or IP (see lab status)")
    p_ssh.add_argument("remote", nargs=argparse.REMAINDER, help="command to run")
    p_ssh.set_defaults(handler=_ssh)

    p_bake = lab_sub.add_parser(
        "bake", help="bake a lab host with the same Packer build as an AMI (null source over SSH)"
    )
    p_bake.add_argument("--lab", default="bake", help="lab name (default: %(default)s)")
    ami_cli.add_host_bake_arguments(p_bake)
    p_bake.add_argument("--host", help="lab host name or IP (default: the first)")
    p_bake.add_argument(
        "--save-image",
        metavar="NAME",
        help=f"keep the baked host as lab image NAME (`{PROG} up --image NAME`)",
    )
    p_bake.set_defaults(handler=_bake)


def bake_target(lab_name: str, host_name: str | None = None) -> product_bake.HostTarget:
    """The lab host to bake as the plain SSH target the product's bake takes, from the lab's status."""
    info = core.status(lab_name)
    hosts = info.get("hosts", [])
    candidates = [h for h in hosts if host_name in (None, h.get("name"), h.get("ip"))]
    if not candidates:
        names = ", ".join(str(h.get("name")) for h in hosts) or "none"
        raise UserError(f"lab {lab_name!r} has no host {host_name!r}; its hosts are: {names}")
    chosen = candidates[0]
    if not chosen.get("ssh"):
        raise ExternalError(
            f"lab host {chosen.get('name')} ({chosen.get('ip')}) does not answer SSH; "
            f"see `{PROG} status --name {lab_name}`"
        )
    return product_bake.HostTarget(
        host=str(chosen["ip"]),
        user=str(info["ssh_user"]),
        private_key_file=Path(str(info["ssh_key"])),
        name=str(chosen["name"]),
    )


def _bake(args: argparse.Namespace) -> int:
    target = bake_target(args.lab, args.host)
    if args.save_image:
        images.require_new(args.save_image)
    run_dir = product_bake.bake_host(ami_cli.host_bake_options(args), target)
    if args.save_image:
        # The lab's "register image": the sanitized host becomes the tree new hosts boot from.
        info = core.save_image(args.lab, target.name, args.save_image)
        LOG.info("saved lab image %s (%d MiB)", info.name, info.size_bytes // 2**20)
    print(run_dir)
    return 0


def _up(args: argparse.Namespace) -> int:
    spec = core.LabSpec(
        name=args.name,
        nodes=args.nodes,
        cluster_name=args.cluster_name,
        compute_type=args.compute_type,
        moto_port=None if args.no_ec2 else args.moto_port,
        image=args.image,
    )
    lab = core.up(spec)
    if args.json:
        print(json.dumps(core.status(lab.name), indent=2))
    else:
        print(f"lab {lab.name!r} is up: {len(lab.hosts)} hosts on {lab.subnet_prefix}.0/24")
        _print_hosts(core.status(lab.name))
        print(f'next: eval "$(gpuforge-lab env --name {lab.name})" && ansible all -m ping')
    return 0


def _register_images(lab_sub: Any, add: Any) -> None:
    image = lab_sub.add_parser(
        "image", help="lab images: baked hosts kept to boot new hosts from (the lab's AMIs)"
    )
    image_sub = image.add_subparsers(dest="image_command", required=True, metavar="ACTION")
    p_save = image_sub.add_parser("save", help="stop a lab host and keep its whole disk as an image")
    p_save.add_argument(
        "--name", default=DEFAULT_NAME, help="lab name (default: %(default)s, or $GPUFORGE_LAB)"
    )
    p_save.add_argument("host", help="host name or IP (see lab status)")
    p_save.add_argument("image", help="image name (lower-case letters, digits, '.', '_', '-')")
    p_save.add_argument("--json", action="store_true")
    p_save.set_defaults(handler=_image_save)
    p_list = image_sub.add_parser("list", help="show the lab images on this machine")
    p_list.add_argument("--json", action="store_true")
    p_list.set_defaults(handler=_image_list)
    p_rm = image_sub.add_parser("rm", help="delete a lab image no running lab boots from")
    p_rm.add_argument("image")
    p_rm.set_defaults(handler=_image_rm)


def _image_save(args: argparse.Namespace) -> int:
    info = core.save_image(args.name, args.host, args.image)
    if args.json:
        print(json.dumps(info.to_json(), indent=2))
    else:
        print(
            f"image {info.name!r} saved from {info.source_host} ({info.size_bytes / 2**20:.0f} MiB, "
            f"{'sanitized' if info.sanitized else 'NOT sanitized'}); the host is stopped. "
            f"Boot hosts from it with `gpuforge-lab up --image {info.name}`"
        )
    return 0


def _image_list(args: argparse.Namespace) -> int:
    found = images.list_images()
    if args.json:
        print(json.dumps([info.to_json() for info in found], indent=2))
        return 0
    print(f"{'IMAGE':24} {'CREATED':21} {'SOURCE':36} {'MiB':>6} {'SANITIZED':9} VERSIONS")
    for info in found:
        source = f"{info.source_lab}/{info.source_host}"
        sanitized = "yes" if info.sanitized else "no"
        print(
            f"{info.name:24} {info.created:21} {source:36} {info.size_bytes / 2**20:6.0f} "
            f"{sanitized:9} {info.versions_hash[:12] or '-'}"
        )
    return 0


def _image_rm(args: argparse.Namespace) -> int:
    core.remove_image(args.image)
    print(f"image {args.image!r} removed")
    return 0


def _down(args: argparse.Namespace) -> int:
    if core.down(args.name):
        print(f"lab {args.name!r} is down")
    else:
        print(f"lab {args.name!r} was not up; nothing to do")
    return 0


def _print_hosts(info: dict[str, Any]) -> None:
    print(f"{'HOST':28} {'IP':14} {'ROLE':9} {'TYPE':14} {'INSTANCE':21} STATE")
    for node in info["hosts"]:
        health = "ssh-ok" if node["ssh"] else ("running" if node["running"] else "stopped")
        print(
            f"{node['name']:28} {node['ip']:14} {node['role']:9} {node['instance_type']:14} "
            f"{node['instance_id'] or '-':21} {health}"
        )
    if info["moto_url"]:
        print(f"emulated AWS (moto): {info['moto_url']} {'running' if info['moto_running'] else 'STOPPED'}")
    print(f"ssh: user {info['ssh_user']}, key {info['ssh_key']}; state: {info['state_file']}")


def _status(args: argparse.Namespace) -> int:
    info = core.status(args.name)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_hosts(info)
    healthy = all(n["ssh"] for n in info["hosts"]) and (info["moto_running"] or not info["moto_url"])
    return 0 if healthy else 1


def _env(args: argparse.Namespace) -> int:
    for key, value in core.env_exports(args.name).items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


def _ssh(args: argparse.Namespace) -> int:
    lab = state.load(state.validate_name(args.name))
    if lab is None:
        raise UserError(f"lab {args.name!r} is not up")
    matches = [h for h in lab.hosts if args.host in (h.name, h.ip, h.instance_id)]
    if not matches:
        raise UserError(
            f"no host {args.host!r} in lab {args.name!r}; hosts: {', '.join(h.name for h in lab.hosts)}"
        )
    cmd = host.ssh_command(lab, matches[0], *args.remote, connect_timeout=5)
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)  # noqa: S606 (replace this process with ssh, like `ssh` itself)


if __name__ == "__main__":
    sys.exit(main())
