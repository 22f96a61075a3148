"""Build (once) and cache the Debian root filesystem every lab host boots from.

Hosts share this tree read-only as the lower layer of an overlay mount, so creating a host
costs a mount and a boot (about a second), not a debootstrap (about a minute).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
from pathlib import Path

from gpuforge_lab import state, system
from gpuforge_lab.state import cache_root

log = logging.getLogger(__name__)

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
SSH_USER = "admin"  # Debian's cloud images use "admin"; ParallelCluster's Ubuntu images use "ubuntu".
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "python3-apt",
    "sudo",
    "iproute2",
    "iputils-ping",
    "ca-certificates",
    "gnupg",
    "procps",
    "kmod",
    "curl",
    "xz-utils",
    "less",
)
# Bump when the customisation below changes, so cached trees are rebuilt.
_RECIPE_VERSION = "3"

SOURCES = f"""\
deb {MIRROR} {SUITE} main contrib non-free non-free-firmware
deb {MIRROR} {SUITE}-updates main contrib non-free non-free-firmware
deb http://deb.debian.org/debian-security {SUITE}-security main contrib non-free non-free-firmware
"""
SSHD_CONFIG = """\
# The gpuforge lab: keys only, no DNS lookups (the lab has no resolver).
PasswordAuthentication no
KbdInteractiveAuthentication no
UseDNS no
"""
# Timers that would take the apt lock at random moments and make runs flaky.
_MASKED_UNITS = ("apt-daily.timer", "apt-daily-upgrade.timer", "e2scrub_all.timer", "fstrim.timer")
# systemd generators with nothing to do in a container (disk partitions, encrypted, verity and
# integrity volumes, hibernation, offline updates, the kernel command line, rc.local), disabled
# as systemd.generator(7) allows. Every boot and every `systemctl daemon-reload` runs them all:
# in a sampled CI run the generators were 4.5 % of all CPU demand.
_MASKED_GENERATORS = (
    "systemd-cryptsetup-generator",
    "systemd-debug-generator",
    "systemd-gpt-auto-generator",
    "systemd-hibernate-resume-generator",
    "systemd-integritysetup-generator",
    "systemd-rc-local-generator",
    "systemd-run-generator",
    "systemd-system-update-generator",
    "systemd-veritysetup-generator",
)


def recipe_key() -> str:
    text = "|".join(
        [SUITE, MIRROR, *PACKAGES, SOURCES, SSHD_CONFIG, *_MASKED_UNITS, *_MASKED_GENERATORS, _RECIPE_VERSION]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def rootfs_path() -> Path:
    return cache_root() / "rootfs" / f"{SUITE}-{recipe_key()}"


def locked() -> contextlib.AbstractContextManager[None]:
    """The lock every builder and reader of the cached trees takes (labs, prebuilds, image saves)."""
    return state.locked("rootfs")


def ensure_rootfs() -> Path:
    """Return the cached tree, building it first if this recipe was never built here."""
    with locked():
        return ensure_rootfs_unlocked()


def ensure_rootfs_unlocked() -> Path:
    """ensure_rootfs for a caller that already holds locked()."""
    final = rootfs_path()
    if (final / ".gpuforge-complete").exists():
        return final
    tmp = final.with_name(final.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the lab rootfs with debootstrap (once; cached in %s)", final)
    system.run(
        ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(tmp), MIRROR]
    )
    _customise(tmp)
    (tmp / ".gpuforge-complete").write_text(recipe_key() + "\n")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def _customise(root: Path) -> None:
    (root / "etc/apt/sources.list").write_text(SOURCES)
    (root / "etc/ssh/sshd_config.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/ssh/sshd_config.d/gpuforge-lab.conf").write_text(SSHD_CONFIG)
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()  # Every host gets its own keys at creation.
    (root / "etc/machine-id").write_text("")
    system.run(
        [
            "chroot",
            str(root),
            "useradd",
            "--create-home",
            "--shell",
            "/bin/bash",
            "--groups",
            "sudo",
            SSH_USER,
        ]
    )
    sudoers = root / "etc/sudoers.d/90-gpuforge-lab"
    sudoers.write_text(f"{SSH_USER} ALL=(ALL) NOPASSWD:ALL\n")
    sudoers.chmod(0o440)
    for link in [root / "etc/systemd/system" / unit for unit in _MASKED_UNITS] + [
        root / "etc/systemd/system-generators" / generator for generator in _MASKED_GENERATORS
    ]:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    system.run(["chroot", str(root), "apt-get", "clean"])


if __name__ == "__main__":
    # `make lab-rootfs`: build the tree ahead of the first lab (CI builds it while pip installs
    # the virtualenv). The standard library only, so it runs before the virtualenv exists.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_rootfs())
