"""Ansible filter gpuforge.gpu.nvidia_driver_packages: the apt packages of one NVIDIA driver release in
NVIDIA's CUDA repository for Ubuntu, named as that repository names them for the release's branch.

NVIDIA renamed its Ubuntu packages twice, and asking apt for a name the repository does not carry
for the branch fails (or, for a virtual name, cannot be pinned):

- Fabric manager, NSCQ and NVSDM lose the branch suffix from R580 on: `nvidia-fabricmanager`,
  `libnvidia-nscq`, `libnvsdm` at the driver's release; `nvidia-fabricmanager-580` is only a virtual
  package there ("Package nvidia-fabricmanager-580 is a virtual package provided by:
  nvidia-fabricmanager 580.65.06-1 / E: Version '580.65.06-1' for 'nvidia-fabricmanager-580' was not
  found", NVIDIA/gpu-driver-container PR #451; its ubuntu22.04/install.sh and ubuntu24.04/install.sh
  install the unversioned names for DRIVER_BRANCH >= 580 since commit 78fa4ac, "add driver 580.65.06").
  libnvsdm exists from R570 on (gpu-driver-container dc7857e) and for amd64 only.
- The driver's own packages lose the branch suffix from R590 on: `nvidia-headless-no-dkms-open`,
  `nvidia-dkms-open`, `nvidia-utils`, `libnvidia-compute`, ... (gpu-driver-container
  ubuntu26.04/install.sh at 06a208c, lines 56-95, which installs only >= 595 and pins the release with
  `nvidia-driver-pinning-<version>`, the package the repository carries from R590 on to lock the
  driver, fabric manager, NSCQ and IMEX to one release).

Ubuntu's own archive keeps the suffixes (`nvidia-fabricmanager-595`, depending on the -server driver
flavor): gpuforge installs from NVIDIA's repository only, so those names are never produced here.
"""

from __future__ import annotations

import re
from typing import Any

from ansible.errors import AnsibleFilterError

# The first branch whose fabric manager, NSCQ and NVSDM packages carry no branch suffix.
UNSUFFIXED_FABRIC_FROM = 580
# The first branch whose driver packages carry no branch suffix (and which has a pinning package).
UNSUFFIXED_DRIVER_FROM = 590
# The first branch with libnvsdm (the NVSwitch device monitoring library of NVLink 5 systems).
NVSDM_FROM = 570

_VERSION = re.compile(r"^(?P<branch>[0-9]{3})[.][0-9]{2,3}([.][0-9]{2,3})?$")


def nvidia_driver_packages(
    version: Any,
    kernel_module: str = "open",
    kernel: str = "",
    fabricmanager: bool = False,
    nvsdm: bool = False,
) -> dict[str, Any]:
    """The packages of driver `version` (e.g. "595.91.07") in NVIDIA's CUDA repository for Ubuntu.

    Returns {"probe": the package whose installed version tells the driver release,
             "userspace": [...], "kernel_module": [...], "fabricmanager": [...]}, each entry
    "name=<version>-*" (NVIDIA's Debian revision varies: "-1", "-0ubuntu1"), plus "pinning": the
    pinning package from R590 on ("" before). `kernel` is the running kernel release for its headers.
    """
    match = _VERSION.match(str(version))
    if match is None:
        raise AnsibleFilterError(
            f"nvidia_driver_packages: {version!r} is not an NVIDIA driver release such as 595.91.07"
        )
    if kernel_module not in ("open", "proprietary"):
        raise AnsibleFilterError(
            f"nvidia_driver_packages: kernel_module is 'open' or 'proprietary', not {kernel_module!r}"
        )
    branch = int(match.group("branch"))
    pin = f"={version}-*"
    driver_suffix = "" if branch >= UNSUFFIXED_DRIVER_FROM else f"-{branch}"
    fabric_suffix = "" if branch >= UNSUFFIXED_FABRIC_FROM else f"-{branch}"
    flavor = "-open" if kernel_module == "open" else ""
    userspace = [
        # Headless: compute nodes run no X server.
        f"nvidia-headless-no-dkms{driver_suffix}{flavor}{pin}",
        f"nvidia-utils{driver_suffix}{pin}",
        f"nvidia-compute-utils{driver_suffix}{pin}",
        f"libnvidia-compute{driver_suffix}{pin}",
    ]
    pinning = f"nvidia-driver-pinning-{version}" if branch >= UNSUFFIXED_DRIVER_FROM else ""
    kernel_module_packages = [f"nvidia-dkms{driver_suffix}{flavor}{pin}"]
    if kernel:
        kernel_module_packages.insert(0, f"linux-headers-{kernel}")
    fabric: list[str] = []
    if fabricmanager:
        fabric = [f"nvidia-fabricmanager{fabric_suffix}{pin}", f"libnvidia-nscq{fabric_suffix}{pin}"]
        if nvsdm and branch >= NVSDM_FROM:
            fabric.append(f"libnvsdm{fabric_suffix}{pin}")
    return {
        "probe": f"nvidia-utils{driver_suffix}",
        "pinning": pinning,
        "userspace": ([pinning] if pinning else []) + userspace,
        "kernel_module": kernel_module_packages,
        "fabricmanager": fabric,
    }


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict[str, Any]:
        return {
            "nvidia_driver_packages": nvidia_driver_packages,
        }
