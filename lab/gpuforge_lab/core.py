"""`lab up` / `lab down` / `lab status`: orchestrate rootfs, network, hosts, proxy and moto."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuforge import instance_types
from gpuforge.errors import ExternalError, UserError
from gpuforge_lab import ec2, host, images, network, rootfs, state, system
from gpuforge_lab.moto import MotoServer, port_in_use
from gpuforge_lab.state import HostState, LabState

log = logging.getLogger(__name__)

MAX_NODES = 64


@dataclass(frozen=True)
class LabSpec:
    name: str
    nodes: int
    cluster_name: str = "lab"
    head_type: str = "c5n.large"
    compute_type: str = "p5.48xlarge"
    queue: str = "gpu"
    moto_port: int | None = 5000  # None: no emulated EC2 (Molecule only needs hosts).
    image: str | None = None  # A lab image (`gpuforge-lab image`) to boot from instead of the rootfs.


def _plan_hosts(spec: LabSpec, prefix: str) -> list[HostState]:
    hosts = []
    head_ip = f"{prefix}.10"
    # ParallelCluster keeps EC2's ip-a-b-c-d name on the head node and names compute nodes
    # after their Slurm node (<queue>-st-<compute-resource>-<n>); the lab does the same.
    hosts.append(
        HostState(
            name="ip-" + head_ip.replace(".", "-"), ip=head_ip, role="HeadNode", instance_type=spec.head_type
        )
    )
    resource = spec.compute_type.replace(".", "-")
    for number in range(1, spec.nodes):
        hosts.append(
            HostState(
                name=f"{spec.queue}-st-{resource}-{number}",
                ip=f"{prefix}.{10 + number}",
                role="Compute",
                instance_type=spec.compute_type,
                queue=spec.queue,
                compute_resource=resource,
            )
        )
    return hosts


def _validate(spec: LabSpec) -> None:
    state.validate_name(spec.name)
    if not 1 <= spec.nodes <= MAX_NODES:
        raise UserError(f"--nodes must be between 1 and {MAX_NODES}, got {spec.nodes}")
    instance_types.get(spec.head_type)
    instance_types.get(spec.compute_type)
    if spec.image is not None:
        images.rootfs(spec.image)


def _alive(lab: LabState) -> bool:
    return any(system.pid_alive(h.pid, h.netns) for h in lab.hosts) or system.pid_alive(
        lab.moto_pid, "motoserver"
    )


def up(spec: LabSpec) -> LabState:
    system.require_root_and_tools()
    _validate(spec)
    with state.locked(spec.name):
        existing = state.load(spec.name)
        if existing is not None:
            if _alive(existing):
                raise UserError(
                    f"lab {spec.name!r} is already up with {len(existing.hosts)} hosts; "
                    f"run `gpuforge-lab down --name {spec.name}` first"
                )
            raise UserError(
                f"lab {spec.name!r} has state from an earlier run that is no longer running; "
                f"clean it with `gpuforge-lab down --name {spec.name}`"
            )
        if spec.moto_port is not None and port_in_use(spec.moto_port):
            raise UserError(
                f"port {spec.moto_port} on 127.0.0.1 is already in use, so moto cannot start; "
                "stop what holds it or pass --moto-port PORT"
            )
        system.raise_kernel_limits()
        with rootfs.locked():
            lower = images.rootfs(spec.image) if spec.image else rootfs.ensure_rootfs_unlocked()
        # Labs come up in parallel (Molecule scenarios, benchmarks); only picking a free subnet
        # and recording it must not interleave.
        with state.locked():
            index = state.allocate_index()
            prefix = f"10.213.{index}"
            directory = state.lab_root() / spec.name
            lab = LabState(
                name=spec.name,
                index=index,
                cluster_name=spec.cluster_name,
                subnet_prefix=prefix,
                bridge=network.bridge_name(index),
                ssh_user=rootfs.SSH_USER,
                ssh_key=str(directory / "ssh" / "id_ed25519"),
                hosts=_plan_hosts(spec, prefix),
                image=spec.image,
            )
            state.save(lab)
        try:
            _bring_up(lab, lower, spec.moto_port)
        except BaseException:
            log.error("lab up failed; tearing down what was created")
            _tear_down(lab)
            raise
        return lab


def _bring_up(lab: LabState, lower: Path, moto_port: int | None) -> None:
    key = Path(lab.ssh_key)
    key.parent.mkdir(parents=True, exist_ok=True)
    if not key.exists():
        system.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"gpuforge-lab-{lab.name}", "-f", str(key)]
        )
    public_key = key.with_suffix(".pub").read_text()
    network.create_bridge(lab.bridge, lab.gateway)
    lab.proxy_port = host.PROXY_PORT
    lab.proxy_pid = _start_proxy(lab)
    for number, node in enumerate(lab.hosts):
        node.netns = f"gpuforge-{lab.name}-{number}"
        node.veth = network.veth_name(lab.index, number)
        network.create_host_link(node.netns, node.veth, lab.bridge, node.ip)
        root = host.mount_overlay(lab, node, lower)
        host.personalise(lab, node, root, public_key)
        node.pid = host.boot(lab, node, root)
        state.save(lab)
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda n: host.wait_ssh(lab, n), lab.hosts))
    if moto_port is not None:
        server = MotoServer(port=moto_port, log_path=lab.directory / "logs" / "moto.log")
        server.start()
        lab.moto_port = moto_port
        lab.moto_pid = server.process.pid if server.process else None
        state.save(lab)
        with _env(server.env()):
            ec2.register(lab)
            ec2.store_munge_key(lab)
        lab.artifacts_pid = _start_artifacts(lab)
    state.save(lab)


def _start_artifacts(lab: LabState) -> int:
    """Serve the lab's stand-ins for vendor downloads on the bridge (test fixtures, named so).

    The real EFA installer and PyTorch's CUDA wheels cannot be reached from the lab; a signed
    fixture installer (throwaway key) and PyTorch's CPU wheel, when this machine has it, can.
    """
    wheels = (
        sorted(Path("/opt/wheels").glob("torch-*+cpu-cp311-*.whl")) if Path("/opt/wheels").is_dir() else []
    )
    fixtures = "gpuforge_lab.artifacts.fixtures"
    build = [sys.executable, "-m", fixtures, "build", "--out", str(lab.artifacts_dir)]
    for wheel in wheels[-1:]:
        build += ["--wheel", str(wheel)]
    system.run(build)
    state_file = lab.directory / "artifacts-server.json"
    proc = _spawn(
        lab,
        "artifacts",
        "gpuforge_lab.artifacts.server",
        "--root",
        str(lab.artifacts_dir),
        "--lab",
        lab.name,
        "--state-file",
        str(state_file),
    )
    deadline = time.monotonic() + 30
    while not state_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            log_tail = (lab.directory / "logs" / "artifacts.log").read_text(errors="replace")[-400:]
            raise ExternalError(f"the lab artifact server did not start: {log_tail.strip() or 'no output'}")
        time.sleep(0.1)
    return proc.pid


def _spawn(lab: LabState, name: str, module: str, *args: str) -> subprocess.Popen[bytes]:
    """Start one of the lab's Python services detached, logging to logs/<name>.log."""
    log_path = lab.directory / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start_proxy(lab: LabState) -> int:
    cache = state.cache_root() / "packages"
    proc = _spawn(
        lab,
        "proxy",
        "gpuforge_lab.aptproxy",
        "--listen",
        lab.gateway,
        "--port",
        str(lab.proxy_port),
        "--cache",
        str(cache),
    )
    return proc.pid


def down(name: str) -> bool:
    """Remove every process, mount, namespace and file of the lab; False if there was none."""
    system.require_root_and_tools()
    state.validate_name(name)
    with state.locked(name):
        lab = state.load(name)
        if lab is None:
            return False
        _tear_down(lab)
        return True


def _tear_down(lab: LabState) -> None:
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda n: host.stop(lab, n), lab.hosts))
    for node in lab.hosts:
        if node.netns:
            network.delete_host_link(node.netns, node.veth)
    system.stop_process(lab.moto_pid, "motoserver")
    system.stop_process(lab.proxy_pid, "aptproxy")
    system.stop_process(lab.artifacts_pid, "gpuforge_lab.artifacts.server")
    network.delete_bridge(lab.bridge)
    shutil.rmtree(lab.directory, ignore_errors=True)


def _lower(lab: LabState) -> Path:
    """The read-only tree under every host of the lab."""
    return images.rootfs(lab.image) if lab.image else rootfs.rootfs_path()


def save_image(name: str, host_name: str, image: str) -> images.ImageInfo:
    """Stop one host of the lab and keep its whole tree as lab image `image`."""
    system.require_root_and_tools()
    state.validate_name(name)
    images.validate_name(image)
    with state.locked(name):
        lab = state.load(name)
        if lab is None:
            raise UserError(f"lab {name!r} is not up; start it with `gpuforge-lab up --name {name}`")
        matches = [h for h in lab.hosts if host_name in (h.name, h.ip, h.instance_id)]
        if not matches:
            hosts = ", ".join(h.name for h in lab.hosts)
            raise UserError(f"no host {host_name!r} in lab {name!r}; hosts: {hosts}")
        with state.locked("images"):
            return images.capture(lab, matches[0], image, _lower(lab))


def remove_image(image: str) -> None:
    """Delete a lab image unless a lab that is up boots from it."""
    system.require_root_and_tools()
    images.validate_name(image)
    with state.locked("images"):
        users = [
            lab.name
            for lab in (state.load(path.parent.name) for path in state.lab_root().glob("*/state.json"))
            if lab is not None and lab.image == image
        ]
        if users:
            raise UserError(
                f"lab image {image!r} is in use by lab(s) {', '.join(sorted(users))}; bring them down first"
            )
        images.remove(image)


def status(name: str) -> dict[str, Any]:
    state.validate_name(name)
    lab = state.load(name)
    if lab is None:
        raise UserError(f"lab {name!r} is not up; start it with `gpuforge-lab up --name {name}`")
    hosts = []
    for node in lab.hosts:
        running = system.pid_alive(node.pid, node.netns)
        hosts.append({**node.__dict__, "running": running, "ssh": running and host.ssh_ok(lab, node)})
    return {
        **lab.to_json(),
        "hosts": hosts,
        "state_file": str(state.state_path(name)),
        "moto_running": system.pid_alive(lab.moto_pid, "motoserver"),
        "proxy_running": system.pid_alive(lab.proxy_pid, "aptproxy"),
        "moto_url": lab.moto_url,
    }


def env_exports(name: str) -> dict[str, str]:
    """Environment for running Ansible and the CLI against this lab (see `gpuforge-lab env`)."""
    lab = state.load(state.validate_name(name))
    if lab is None:
        raise UserError(f"lab {name!r} is not up; start it with `gpuforge-lab up --name {name}`")
    values = {
        "GPUFORGE_LAB": lab.name,
        "ANSIBLE_PRIVATE_KEY_FILE": lab.ssh_key,
        "ANSIBLE_REMOTE_USER": lab.ssh_user,
        "GPUFORGE_CLUSTER_NAME": lab.cluster_name,
        # Each lab (and each incarnation of it) gets its own inventory cache, never a stale one.
        "ANSIBLE_INVENTORY_CACHE_CONNECTION": str(lab.directory / "inventory-cache"),
        # Facts too: lab hosts reuse addresses (and so inventory names) across incarnations.
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(lab.directory / "fact-cache"),
    }
    if lab.artifacts_pid:
        values["GPUFORGE_LAB_ARTIFACTS"] = str(lab.artifacts_dir)
    if lab.moto_url:
        values.update(MotoServer(port=lab.moto_port or 0, log_path=Path("/dev/null")).env())
    return values
