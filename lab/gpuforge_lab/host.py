"""One lab host: an overlay on the cached rootfs, booted by systemd-nspawn in its own netns.

systemd-nspawn gives each host a real systemd as PID 1 (services, handlers and
`systemctl` behave as on EC2), its own hostname and its own network namespace, and it works
without a Docker engine. The host's writable layer lives under the lab directory and is
removed by `lab down`.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from gpuforge.errors import ExternalError
from gpuforge_lab import cgroup, system
from gpuforge_lab.rootfs import SSH_USER
from gpuforge_lab.state import HostState, LabState

log = logging.getLogger(__name__)

PROXY_PORT = 3142

# systemd-nspawn processes this process started, by pid: a boot that fails reports their exit status.
_BOOTED: dict[int, subprocess.Popen[bytes]] = {}


def host_dir(lab: LabState, host: HostState) -> Path:
    return lab.directory / "hosts" / host.name


def _merged(lab: LabState, host: HostState) -> Path:
    return host_dir(lab, host) / "rootfs"


def mount_overlay(lab: LabState, host: HostState, lower: Path) -> Path:
    base = host_dir(lab, host)
    upper, work, merged = base / "upper", base / "work", base / "rootfs"
    for path in (upper, work, merged):
        path.mkdir(parents=True, exist_ok=True)
    if not system.is_mounted(merged):
        system.run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"lowerdir={lower},upperdir={upper},workdir={work}",
                str(merged),
            ]
        )
    return merged


def _uid_gid(root: Path, user: str) -> tuple[int, int]:
    for line in (root / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == user:
            return int(fields[2]), int(fields[3])
    raise ExternalError(f"user {user} missing from the lab rootfs; rebuild it (delete the rootfs cache)")


def personalise(lab: LabState, host: HostState, root: Path, public_key: str) -> None:
    """Write what makes this host itself: name, identity, keys, peers, package proxy."""
    (root / "etc/hostname").write_text(host.name + "\n")
    peers = "\n".join(f"{h.ip}\t{h.name}" for h in lab.hosts)
    (root / "etc/hosts").write_text(
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{host.name}\n{lab.gateway}\tgpuforge-control\n{peers}\n"
    )
    machine_id = root / "etc/machine-id"
    if not machine_id.read_text().strip():
        machine_id.write_text(uuid.uuid4().hex + "\n")
    host_key = root / "etc/ssh/ssh_host_ed25519_key"
    if not host_key.exists():
        # One host key is all sshd needs: ed25519 takes milliseconds, where `ssh-keygen -A`'s RSA
        # key took about 0.35 s of CPU on every boot of a host from a sanitized image.
        system.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{host.name}", "-f", str(host_key)]
        )
    home = root / "home" / SSH_USER
    ssh_dir = home / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    keys = ssh_dir / "authorized_keys"
    keys.write_text(public_key)
    keys.chmod(0o600)
    uid, gid = _uid_gid(root, SSH_USER)
    for path in (ssh_dir, keys):
        shutil.chown(path, uid, gid)
    proxy = f"http://{lab.gateway}:{PROXY_PORT}"
    (root / "etc/apt/apt.conf.d/01gpuforge-lab-proxy").write_text(
        "// The lab reaches Debian only through the control host's caching proxy.\n"
        f'Acquire::http::Proxy "{proxy}";\n'
    )
    (root / "etc/pip.conf").write_text(f"[global]\nproxy = {proxy}\n")
    trust_local_cas(root)


LOCAL_CA_DIR = Path("/usr/local/share/ca-certificates")


def trust_local_cas(root: Path) -> None:
    """Trust the CAs the control host trusts locally (its HTTPS egress to PyPI presents them).

    They go where update-ca-certificates keeps them and into the bundle OpenSSL and pip read,
    so HTTPS through the lab proxy verifies as it does on the control host.
    """
    local = sorted(LOCAL_CA_DIR.glob("*.crt")) if LOCAL_CA_DIR.is_dir() else []
    if not local:
        return
    target_dir = root / LOCAL_CA_DIR.relative_to("/")
    target_dir.mkdir(parents=True, exist_ok=True)
    bundle = root / "etc/ssl/certs/ca-certificates.crt"
    text = bundle.read_text() if bundle.exists() else ""
    for cert in local:
        pem = cert.read_text()
        shutil.copyfile(cert, target_dir / cert.name)
        if pem.strip() not in text:
            text = text.rstrip("\n") + "\n" + pem.strip() + "\n"
    bundle.write_text(text)


def boot(lab: LabState, host: HostState, root: Path) -> int:
    log_path = lab.directory / "logs" / f"{host.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # A cgroup of its own, so this host's systemd never shares its tree with another host's.
    cgroup.remove([Path(d) for d in host.cgroups])  # what a killed earlier boot left
    dirs = cgroup.create(host.netns)
    host.cgroups = [str(d) for d in dirs]
    nspawn = [
        "systemd-nspawn",
        "--boot",
        f"--directory={root}",
        f"--machine={host.netns}",
        f"--hostname={host.name}",
        f"--network-namespace-path=/run/netns/{host.netns}",
        "--register=no",
        "--keep-unit",
        "--console=passive",
        "--resolv-conf=off",
        "--timezone=off",
        "--link-journal=no",
    ]
    with log_path.open("ab") as out:
        proc = subprocess.Popen(
            cgroup.enter_command(dirs, nspawn),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _BOOTED[proc.pid] = proc
    return proc.pid


def ssh_options(key: str, connect_timeout: int = 2) -> list[str]:
    """ssh/scp options for lab hosts: the lab's key, no prompts, no known_hosts (hosts are throwaway)."""
    return [
        "-i",
        key,
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
        "-o",
        f"ConnectTimeout={connect_timeout}",
    ]


def ssh_command(lab: LabState, host: HostState, *remote: str, connect_timeout: int = 2) -> list[str]:
    return ["ssh", *ssh_options(lab.ssh_key, connect_timeout), f"{lab.ssh_user}@{host.ip}", *remote]


def ssh_ok(lab: LabState, host: HostState) -> bool:
    return _ssh_try(lab, host) == ""


def _ssh_try(lab: LabState, host: HostState) -> str:
    """'' when `ssh host true` works, else what ssh said (or why it did not answer)."""
    try:
        result = subprocess.run(
            ssh_command(lab, host, "true"), capture_output=True, text=True, check=False, timeout=15
        )
    except subprocess.TimeoutExpired:
        return "ssh did not return within 15s"
    if result.returncode == 0:
        return ""
    return result.stderr.strip() or f"ssh exited {result.returncode}"


def _log_tail(lab: LabState, host: HostState, lines: int = 8) -> list[str]:
    log_path = lab.directory / "logs" / f"{host.name}.log"
    return log_path.read_text(errors="replace").strip().splitlines()[-lines:] if log_path.exists() else []


# What a host that booted but never let us in was doing, read from inside its namespaces.
_DIAGNOSE = (
    "systemctl is-system-running; systemctl list-jobs --no-pager --no-legend | head -n 12; "
    "systemctl --failed --no-pager --no-legend; systemctl status --no-pager -n 5 ssh.service; "
    "ls -l /run/nologin /etc/nologin 2>&1; ip -brief address"
)


def init_pid(host: HostState) -> str | None:
    """The pid of the host's own systemd (systemd-nspawn's child); None when it has none."""
    try:
        children = Path(f"/proc/{host.pid}/task/{host.pid}/children").read_text().split()
    except OSError:
        return None
    return children[0] if children else None


def inside(init: str) -> list[str]:
    """The command prefix that runs a command in the namespaces of the host whose init is `init`."""
    return ["nsenter", "--target", init, "--mount", "--uts", "--ipc", "--net", "--pid", "--"]


def diagnose(host: HostState) -> str:
    """The container's own view of why it may not accept SSH ('' when it cannot be entered)."""
    init = init_pid(host)
    if init is None:
        return ""
    try:
        result = subprocess.run(
            [*inside(init), "sh", "-c", _DIAGNOSE], capture_output=True, text=True, check=False, timeout=30
        )
    except subprocess.TimeoutExpired:
        return "(the diagnosis inside the host did not finish within 30s)"
    return (result.stdout + result.stderr).strip()


def wait_ssh(lab: LabState, host: HostState, timeout: float = 240.0) -> None:
    # A boot takes seconds on an idle machine; the generous limit is for a loaded CI runner.
    deadline = time.monotonic() + timeout
    said = "no SSH attempt made"
    while time.monotonic() < deadline:
        proc = _BOOTED.get(host.pid or 0)
        # For a boot of this process, its own handle is the authority; /proc is for the others.
        exited = proc.poll() is not None if proc is not None else not system.pid_alive(host.pid, host.netns)
        if exited:
            status = f" (systemd-nspawn exit status {proc.returncode})" if proc is not None else ""
            raise ExternalError(
                f"host {host.name} stopped while booting{status}: "
                + (" | ".join(_log_tail(lab, host)) or "no output")
            )
        said = _ssh_try(lab, host)
        if not said:
            return
        time.sleep(0.3)
    # The lab is torn down after this error, so everything needed to explain it goes into it.
    raise ExternalError(
        f"host {host.name} ({host.ip}) did not accept SSH within {timeout:.0f}s; last ssh said: {said}\n"
        f"its console (last lines): " + " | ".join(_log_tail(lab, host, 15)) + "\n"
        f"inside it:\n{diagnose(host) or '(could not enter it)'}"
    )


def stop(lab: LabState, host: HostState) -> None:
    system.stop_process(host.pid, host.netns)
    merged = _merged(lab, host)
    # If systemd-nspawn itself was killed, the container lives on without it: end whatever
    # still runs in this host's network namespace.
    if host.netns:
        system.kill_in_netns(host.netns)
    cgroup.remove([Path(d) for d in host.cgroups])
    if system.is_mounted(merged):
        result = system.run(["umount", str(merged)], check=False)
        if result.returncode != 0:
            system.run(["umount", "--lazy", str(merged)])
