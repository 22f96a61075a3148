"""Verifier for the stack roles (efa, nccl, aws_ofi_nccl, pytorch) on a lab host: real state only.

The EFA installer the host ran is the signed TEST FIXTURE from tests/fixtures/artifacts (it records
what it was asked to do) and torch is the TEST DOUBLE of the pinned CUDA wheel
(gpuforge_lab.artifacts.torchdouble: its identity, no CUDA kernels); everything else is real: Debian's RDMA
packages, NVIDIA's NCCL library. The host has no GPU and no EFA device.
"""

from __future__ import annotations

import json

import pytest

from gpuforge import versions

testinfra_hosts = ["all"]

PINS = versions.load()


def test_efa_fixture_installer_ran_once_with_the_role_flags(host):
    """The verified fixture installer ran exactly once (idempotence and check mode did not rerun it)."""
    record = json.loads(host.file("/opt/amazon/efa-fixture-install.json").content_string)
    assert record["fixture"] is True
    assert record["version"] == PINS.version("efa_installer")
    assert record["runs"] == 1
    assert record["skip_kmod"] is True  # the role's default (auto): a lab host is a container
    assert record["no_verify"] is True  # no EFA device on the host
    assert record["skip_limit_conf"] is True  # the role writes the memlock limit itself
    assert record["args"].split()[0] == "-y"


def test_efa_installed_packages_reports_the_pin(host):
    """The installer's own record carries the pinned version the role's skip probe reads."""
    first = host.file("/opt/amazon/efa_installed_packages").content_string.splitlines()[0]
    assert first == f"# EFA installer version: {PINS.version('efa_installer')}"


def test_efa_scratch_directory_was_removed(host):
    """Download and extraction happened in a scratch directory that is gone afterwards."""
    leftovers = host.run("find /var/tmp -maxdepth 1 -name 'gpuforge-efa-*'")
    assert leftovers.rc == 0
    assert leftovers.stdout.strip() == ""


@pytest.mark.parametrize(
    "path",
    [
        "/etc/sysctl.d/99-gpuforge-efa.conf",
        "/etc/security/limits.d/99-gpuforge-efa.conf",
        "/etc/ld.so.conf.d/gpuforge-nccl.conf",
        "/etc/ld.so.conf.d/gpuforge-aws-ofi-nccl.conf",
        # The hash-pinned requirement pip installed NCCL from (Debian: the wheel method).
        "/opt/gpuforge/nccl/requirements.txt",
        "/etc/gpuforge/aws_ofi_nccl.json",
        "/etc/gpuforge/pytorch.json",
        "/opt/amazon/efa_installed_packages",
    ],
)
def test_managed_files_are_root_owned_0644(host, path):
    """Configuration and records the roles write are root-owned and world-readable, not writable."""
    managed = host.file(path)
    assert managed.is_file
    assert managed.user == "root"
    assert managed.group == "root"
    assert managed.mode == 0o644


@pytest.mark.parametrize("path", ["/etc/gpuforge", "/opt/gpuforge/nccl", "/opt/gpuforge/nccl/lib"])
def test_managed_directories_are_root_owned_0755(host, path):
    """Directories the linker and the records live in: nobody but root may add files to them."""
    directory = host.file(path)
    assert directory.is_directory
    assert (directory.user, directory.group) == ("root", "root")
    assert directory.mode == 0o755


def test_ptrace_scope_persisted_and_live_value(host):
    """ptrace_scope=0 is persisted; the live value is checked where the kernel exposes it."""
    conf = host.file("/etc/sysctl.d/99-gpuforge-efa.conf").content_string
    assert "kernel.yama.ptrace_scope = 0" in conf.splitlines()
    live = host.file("/proc/sys/kernel/yama/ptrace_scope")
    if not live.exists:
        pytest.skip("no Yama ptrace_scope in this lab container: live sysctl check skipped")
    assert host.check_output("cat /proc/sys/kernel/yama/ptrace_scope").strip() == "0"


@pytest.mark.parametrize("kind", ["soft", "hard"])
def test_memlock_limit_file(host, kind):
    """Every user gets an unlimited memlock limit (EFA pins its buffers)."""
    lines = [
        line.split()
        for line in host.file("/etc/security/limits.d/99-gpuforge-efa.conf").content_string.splitlines()
    ]
    assert ["*", kind, "memlock", "unlimited"] in lines


def test_memlock_is_unlimited_for_a_login_session(host):
    """pam_limits gives a fresh login session of an ordinary user an unlimited memlock limit."""
    with host.sudo():
        if host.run("sh -c 'ulimit -H -l unlimited'").rc != 0:
            pytest.skip(
                "the lab container lacks CAP_SYS_RESOURCE: memlock cannot be raised, live check skipped"
            )
        assert host.check_output("su -l admin -s /bin/bash -c 'ulimit -l'").strip() == "unlimited"


@pytest.mark.parametrize("package", ["rdma-core", "ibverbs-providers", "libfabric1", "libfabric-bin"])
def test_debian_rdma_packages_installed(host, package):
    """The lab's stand-in for the installer's libfabric and rdma-core are real Debian packages."""
    assert host.package(package).is_installed


@pytest.mark.parametrize("library", ["libfabric.so.1", "libefa.so.1", "libibverbs.so.1", "libnccl.so.2"])
def test_libraries_in_linker_cache(host, library):
    """ldconfig -p lists every library the stack provides."""
    cache = host.check_output("/sbin/ldconfig -p")
    assert any(line.strip().startswith(library + " ") for line in cache.splitlines())


def test_nccl_library_reports_the_pinned_version(host):
    """Loading libnccl.so.2 by soname and calling ncclGetVersion returns the NCCL pin (no GPU needed)."""
    script = (
        "import ctypes; lib = ctypes.CDLL('libnccl.so.2'); v = ctypes.c_int(); "
        "assert lib.ncclGetVersion(ctypes.byref(v)) == 0; "
        "print(f'{v.value // 10000}.{v.value // 100 % 100}.{v.value % 100}')"
    )
    assert host.check_output(f'python3 -c "{script}"').strip() == PINS.version("nccl")


def test_aws_ofi_nccl_uses_the_bundled_plugin(host):
    """The installer's (stand-in) plugin is the pinned release, so it is registered, not rebuilt."""
    pin = PINS.version("aws_ofi_nccl")
    lib_dir = f"/opt/amazon/ofi-nccl/lib/{host.system_info.arch}-linux-gnu"
    record = json.loads(host.file("/etc/gpuforge/aws_ofi_nccl.json").content_string)
    assert record == {
        "version": pin,
        "source": "bundled",
        "lib_dir": lib_dir,
        "bundled_version": pin,
        "reason": None,
    }
    conf = host.file("/etc/ld.so.conf.d/gpuforge-aws-ofi-nccl.conf")
    assert conf.mode == 0o644 and conf.user == "root"
    assert lib_dir in conf.content_string.splitlines()
    cache = host.check_output("/sbin/ldconfig -p")
    assert f"=> {lib_dir}/libnccl-net.so" in cache
    assert not host.file("/opt/aws-ofi-nccl").exists


def test_torch_imports_at_the_production_pin_with_its_nccl(host):
    """The venv's torch is versions.yml's release and CUDA build (the TEST DOUBLE of that wheel), and
    the role recorded the CUDA release and the pinned NCCL it reports; no GPU is available."""
    pytorch = PINS.components["pytorch"]
    pinned = f"{pytorch['version']}+{pytorch['cuda_build']}"
    out = host.check_output('/opt/gpuforge/pytorch/bin/python -c "import torch; print(torch.__version__)"')
    assert out.strip() == pinned
    record = json.loads(host.file("/etc/gpuforge/pytorch.json").content_string)
    assert record["torch"] == pinned
    assert record["cuda_build"] == f"{int(pytorch['cuda_build'][2:-1])}.{pytorch['cuda_build'][-1]}"
    assert record["nccl"] == PINS.version("nccl")
    assert record["cuda_available"] is False
