"""Which network NCCL really used, read from the NCCL_DEBUG=INFO lines of a job log.

NCCL names the transport it chose in one line per communicator, `NCCL INFO Using network <name>`
(NVIDIA/nccl src/init.cc); the aws-ofi-nccl plugin calls itself "AWS Libfabric" (up to 1.13)
or "Libfabric" (aws/aws-ofi-nccl src/nccl_ofi_interface_nvidia.cpp) and logs its version and
libfabric provider (`NET/OFI Initializing aws-ofi-nccl 1.16.3`, older `NET/OFI Using
aws-ofi-nccl 1.5.0aws`; `NET/OFI Selected provider is efa, fabric is efa-direct (found 32
nics)`, older `Selected Provider is efa (found 4 nics)`; src/nccl_ofi_net.cpp). NCCL's
built-in fallbacks are "Socket" (kernel TCP) and "IB" (verbs). Channel lines
(`... via NET/Socket/0`) name the network too and serve when the "Using network" line is absent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_USING_NETWORK_RE = re.compile(r"NCCL INFO Using network (.+?)\s*$")
_VIA_NET_RE = re.compile(r"NCCL INFO .* via NET/([A-Za-z][A-Za-z ]*?)/\d")
_OFI_VERSION_RE = re.compile(r"NET/OFI (?:Initializing|Using) aws-ofi-nccl (\S+)")
_OFI_PROVIDER_RE = re.compile(r"NET/OFI Selected [Pp]rovider is ([^,\s(]+)")
# Init line of recent NCCL releases: "comm 0x... rank 0 nRanks 24 nNodes 3 localRanks 8 localRank 0 MNNVL 0".
_NNODES_RE = re.compile(r"NCCL INFO .*\bnNodes (\d+)")
_NCCL_VERSION_RE = re.compile(r"NCCL version (\d+\.\d+\.\d+\S*)")
# nccl-tests 2.17+ banner: "# nccl-tests version 2.17.6 nccl-headers=22602 nccl-library=22602".
_TESTS_LIBRARY_RE = re.compile(r"nccl-tests version \S+ nccl-headers=\d+ nccl-library=(\d+)")

SOCKET = "Socket"
OFI_NAMES = frozenset({"AWS Libfabric", "Libfabric", "OFI"})


@dataclass
class Network:
    """What the INFO lines of one run say about its transport; empty when NCCL_DEBUG was off."""

    networks: set[str] = field(default_factory=set)
    ofi_version: str | None = None
    providers: set[str] = field(default_factory=set)
    nccl_version: str | None = None
    nodes: int | None = None
    info_lines: int = 0

    def observe(self, line: str) -> None:
        """Take in one log line (launcher prefix already stripped)."""
        if match := _NCCL_VERSION_RE.search(line):
            self.nccl_version = self.nccl_version or match.group(1)
        elif match := _TESTS_LIBRARY_RE.search(line):
            self.nccl_version = self.nccl_version or _version_from_code(int(match.group(1)))
        if "NCCL INFO" not in line:
            return
        self.info_lines += 1
        if match := _USING_NETWORK_RE.search(line):
            self.networks.add(match.group(1))
        elif match := _VIA_NET_RE.search(line):
            self.networks.add(match.group(1).strip())
        elif match := _OFI_VERSION_RE.search(line):
            self.ofi_version = match.group(1)
        elif match := _OFI_PROVIDER_RE.search(line):
            self.providers.add(match.group(1))
        elif match := _NNODES_RE.search(line):
            self.nodes = max(self.nodes or 0, int(match.group(1)))

    @property
    def uses_socket(self) -> bool:
        return SOCKET in self.networks

    @property
    def uses_ofi(self) -> bool:
        return bool(self.networks & OFI_NAMES)

    @property
    def non_efa_providers(self) -> list[str]:
        """libfabric providers other than efa (e.g. tcp;ofi_rxm): the plugin loaded but not on EFA."""
        return sorted(p for p in self.providers if p != "efa")

    def describe(self) -> str:
        """One line naming the transport, as the report prints it."""
        if not self.networks and not self.providers:
            if self.info_lines:
                return "not named in the NCCL INFO lines present (run with NCCL_DEBUG=INFO from the start)"
            return "unknown: no NCCL INFO lines (run with NCCL_DEBUG=INFO to see it)"
        parts = []
        for name in sorted(self.networks):
            if name in OFI_NAMES:
                plugin = f"OFI plugin ({name}"
                plugin += f", aws-ofi-nccl {self.ofi_version}" if self.ofi_version else ""
                plugin += f", provider {'/'.join(sorted(self.providers))}" if self.providers else ""
                parts.append(plugin + ")")
            elif name == SOCKET:
                parts.append("Socket (NCCL's TCP fallback: no EFA/RDMA)")
            else:
                parts.append(name)
        if not self.networks:
            parts.append(f"OFI plugin, provider {'/'.join(sorted(self.providers))}")
        return "; ".join(parts)


def _version_from_code(code: int) -> str:
    """NCCL_VERSION_CODE (major*10000 + minor*100 + patch since 2.9) as "2.26.2"."""
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
