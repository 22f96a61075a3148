"""Build the artifact server's TEST FIXTURES: a fake EFA installer tarball, signed.

    python -m gpuforge_lab.artifacts.fixtures build --out DIR [--efa-version V] [--wheel PATH ...]

The tarball wraps tests/fixtures/artifacts/efa/aws-efa-installer/ (a stand-in installer that
records what it was asked to do and puts a stand-in aws-ofi-nccl library, compiled here from
ofi-nccl-standin.c, where the real one bundles its plugin) under the real download's name, and
is signed with a throwaway GnuPG key generated here, in a temporary home that is deleted
afterwards. No real key or secret is involved. The layout mirrors https://efa-installer.amazonaws.com:

    efa/aws-efa-installer-V.tar.gz, .sig, aws-efa-installer.key    good fixture
    efa-badsig/ ...                                                  signature over other bytes
    efa-wrongkey/ ...                                                signed by a second, unpinned key
    wheels/NAME.whl                                                  links to the given wheels
    test-doubles/torch-V+BUILD-...whl                                TEST DOUBLE of the pinned PyTorch wheel
    fixture.json                                                     hashes and the key fingerprint

and, mirroring https://github.com/aws/aws-ofi-nccl/releases/download, a stand-in source tarball of
the pinned aws-ofi-nccl release for the aws_ofi_nccl role's build (tests/fixtures/artifacts/ofi/:
a configure script and a Makefile that compile ofi-nccl-standin.c at that version):

    ofi/vV/aws-ofi-nccl-V.tar.gz                                     its sha512 in fixture.json

and, mirroring https://github.com/NVIDIA/nccl-tests/archive/refs/tags, a stand-in source archive of the
pinned nccl-tests release for the nccl_tests role's build (tests/fixtures/artifacts/nccl-tests/: a
Makefile taking nccl-tests' MPI, MPI_HOME, CUDA_HOME and NCCL_HOME that compiles a C program printing
all_reduce_perf's output format; lab hosts have no CUDA compiler):

    nccl-tests/vV.tar.gz                                             its sha256 in fixture.json
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpuforge import versions
from gpuforge.errors import ExternalError, UserError
from gpuforge_lab import checkout
from gpuforge_lab.artifacts import torchdouble

FIXTURE_UID = "gpuforge TEST FIXTURE signing key (not an AWS key) <test-fixture@gpuforge.invalid>"
IMPOSTOR_UID = "gpuforge TEST FIXTURE impostor key (must be refused) <impostor@gpuforge.invalid>"


def fixture_source() -> Path:
    return checkout.fixtures_dir() / "efa" / "aws-efa-installer"


def plugin_source() -> Path:
    return checkout.fixtures_dir() / "efa" / "ofi-nccl-standin.c"


def ofi_source() -> Path:
    return checkout.fixtures_dir() / "ofi" / "aws-ofi-nccl"


def nccl_tests_source() -> Path:
    return checkout.fixtures_dir() / "nccl-tests" / "nccl-tests"


@dataclass
class Fixtures:
    root: str
    efa_version: str
    bundled_aws_ofi_nccl: str
    efa_tarball: str
    efa_sha256: str
    efa_key_fingerprint: str
    impostor_fingerprint: str
    ofi_version: str
    ofi_tarball: str  # relative to root
    ofi_sha512: str
    nccl_tests_version: str = ""
    nccl_tests_tarball: str = ""  # relative to root
    nccl_tests_sha256: str = ""
    wheels: dict[str, str] = field(default_factory=dict)  # file name -> sha256
    # The PyTorch wheel TEST DOUBLE with versions.yml's identity (gpuforge_lab.artifacts.torchdouble):
    # file (under test-doubles/) and sha256, what the lab's pytorch_wheel_url and _sha256 point at.
    torch_double: dict[str, str] = field(default_factory=dict)


def sha256_file(path: Path) -> str:
    return _digest_file(path, "sha256")


def sha512_file(path: Path) -> str:
    return _digest_file(path, "sha512")


def _digest_file(path: Path, algorithm: str) -> str:
    digest = hashlib.new(algorithm)
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class _ThrowawayGpg:
    """A GnuPG home in a temporary directory with one freshly generated signing key."""

    def __init__(self, uid: str):
        if shutil.which("gpg") is None:
            raise ExternalError("gpg is not installed; apt-get install gnupg")
        # Short path: gpg-agent's socket path must fit in sun_path.
        self.home = Path(tempfile.mkdtemp(prefix="gf-gpg-"))
        self.home.chmod(0o700)
        self._run("--quick-generate-key", uid, "ed25519", "sign", "2d")
        listing = self._run("--with-colons", "--list-keys", uid)
        self.fingerprint = next(
            line.split(":")[9] for line in listing.splitlines() if line.startswith("fpr:")
        )

    def _run(self, *args: str, stdin: bytes | None = None) -> str:
        cmd = [
            "gpg",
            "--homedir",
            str(self.home),
            "--batch",
            "--pinentry-mode",
            "loopback",
            "--passphrase",
            "",
            "--no-tty",
            *args,
        ]
        result = subprocess.run(cmd, input=stdin, capture_output=True, check=False)
        if result.returncode != 0:
            raise ExternalError(f"{' '.join(cmd[:2])} ... {args[0]} failed: {result.stderr.decode().strip()}")
        return result.stdout.decode()

    def export(self, dest: Path) -> None:
        dest.write_text(self._run("--armor", "--export", self.fingerprint))

    def sign(self, data: Path, dest: Path) -> None:
        dest.unlink(missing_ok=True)
        self._run("--local-user", self.fingerprint, "--output", str(dest), "--detach-sign", str(data))

    def close(self) -> None:
        subprocess.run(
            ["gpgconf", "--homedir", str(self.home), "--kill", "gpg-agent"], capture_output=True, check=False
        )
        shutil.rmtree(self.home, ignore_errors=True)


def standin_plugin(version: str, workdir: Path) -> bytes:
    """Compile the stand-in plugin library (an ELF shared object ldconfig accepts) for `version`."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise ExternalError("building the EFA installer fixture needs a C compiler (apt-get install gcc)")
    out = workdir / "libnccl-net.so"
    result = subprocess.run(
        [
            compiler,
            "-shared",
            "-fPIC",
            "-O2",
            "-Wl,-soname,libnccl-net.so",
            f'-DOFI_NCCL_VERSION="{version}"',
            "-o",
            str(out),
            str(plugin_source()),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise ExternalError(f"compiling the stand-in aws-ofi-nccl plugin failed: {result.stderr.strip()}")
    return out.read_bytes()


def _tarball(dest: Path, top: str, members: Sequence[tuple[str, bytes, int]]) -> None:
    """A gzipped tarball of `members` under the directory `top`, with fixed metadata."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w:gz") as tar:
        for name, data, mode in members:
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))


def _ofi_source_tarball(dest: Path, version: str) -> None:
    """The stand-in aws-ofi-nccl source under the release tarball's top-level directory: its
    configure and make build ofi-nccl-standin.c with `version` in the plugin's banner."""
    members = [
        (
            path.name,
            path.read_bytes().replace(b"@OFI_NCCL_VERSION@", version.encode()),
            path.stat().st_mode & 0o777,
        )
        for path in sorted(ofi_source().iterdir())
    ]
    members.append((plugin_source().name, plugin_source().read_bytes(), 0o644))
    _tarball(dest, f"aws-ofi-nccl-{version}", members)


def nccl_tests_source_tarball(dest: Path, version: str) -> None:
    """The stand-in nccl-tests source under the tag archive's top-level directory (nccl-tests-V):
    its Makefile builds all_reduce_perf-standin.c, which prints `version` in its banner."""
    members = [
        (
            path.name,
            path.read_bytes().replace(b"@NCCL_TESTS_VERSION@", version.encode()),
            path.stat().st_mode & 0o777,
        )
        for path in sorted(nccl_tests_source().iterdir())
    ]
    _tarball(dest, f"nccl-tests-{version}", members)


def _installer_tarball(dest: Path, version: str, plugin: bytes) -> None:
    """The stand-in installer under the real tarball's top-level directory, with fixed metadata."""
    members = [
        (
            path.name,
            path.read_bytes().replace(b"@EFA_VERSION@", version.encode()),
            path.stat().st_mode & 0o777,
        )
        for path in sorted(fixture_source().iterdir())
    ]
    members.append(("libnccl-net.so", plugin, 0o755))
    _tarball(dest, "aws-efa-installer", members)


def build(
    out: Path,
    efa_version: str,
    wheels: Sequence[Path] = (),
    bundled_aws_ofi_nccl: str | None = None,
    aws_ofi_nccl: str | None = None,
) -> Fixtures:
    """Write the fixtures under `out`; the stand-in installer bundles a stand-in plugin at
    `bundled_aws_ofi_nccl` (default: what versions.yml says the pinned installer bundles), the
    stand-in source tarball builds one at `aws_ofi_nccl` (default: the aws_ofi_nccl pin)."""
    out.mkdir(parents=True, exist_ok=True)
    pins = versions.load()
    ofi_version = bundled_aws_ofi_nccl or str(pins.components["efa_installer"]["bundled_aws_ofi_nccl"])
    source_version = aws_ofi_nccl or pins.version("aws_ofi_nccl")
    ofi_tarball = f"ofi/v{source_version}/aws-ofi-nccl-{source_version}.tar.gz"
    _ofi_source_tarball(out / ofi_tarball, source_version)
    nccl_tests_version = pins.version("nccl_tests")
    nccl_tests_tarball = f"nccl-tests/v{nccl_tests_version}.tar.gz"
    nccl_tests_source_tarball(out / nccl_tests_tarball, nccl_tests_version)
    name = f"aws-efa-installer-{efa_version}.tar.gz"
    good, badsig, wrongkey = out / "efa", out / "efa-badsig", out / "efa-wrongkey"
    for directory in (good, badsig, wrongkey):
        directory.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpuforge-fixture-") as work:
        plugin = standin_plugin(ofi_version, Path(work))
    _installer_tarball(good / name, efa_version, plugin)
    for directory in (badsig, wrongkey):
        shutil.copyfile(good / name, directory / name)

    signer, impostor = _ThrowawayGpg(FIXTURE_UID), _ThrowawayGpg(IMPOSTOR_UID)
    try:
        signer.export(good / "aws-efa-installer.key")
        signer.sign(good / name, good / f"{name}.sig")
        # A good key whose signature covers other bytes: gpgv reports BADSIG.
        shutil.copyfile(good / "aws-efa-installer.key", badsig / "aws-efa-installer.key")
        other = badsig / "other-bytes"
        other.write_bytes(b"TEST FIXTURE: not the tarball\n")
        signer.sign(other, badsig / f"{name}.sig")
        other.unlink()
        # A valid signature by a key that is not the pinned one.
        impostor.export(wrongkey / "aws-efa-installer.key")
        impostor.sign(wrongkey / name, wrongkey / f"{name}.sig")
        fixtures = Fixtures(
            root=str(out.resolve()),
            efa_version=efa_version,
            bundled_aws_ofi_nccl=ofi_version,
            efa_tarball=name,
            efa_sha256=sha256_file(good / name),
            efa_key_fingerprint=signer.fingerprint,
            impostor_fingerprint=impostor.fingerprint,
            ofi_version=source_version,
            ofi_tarball=ofi_tarball,
            ofi_sha512=sha512_file(out / ofi_tarball),
            nccl_tests_version=nccl_tests_version,
            nccl_tests_tarball=nccl_tests_tarball,
            nccl_tests_sha256=sha256_file(out / nccl_tests_tarball),
        )
    finally:
        signer.close()
        impostor.close()

    if wheels:
        (out / "wheels").mkdir(exist_ok=True)
    for wheel in wheels:
        if not wheel.is_file():
            raise UserError(f"wheel {wheel} does not exist")
        link = out / "wheels" / wheel.name
        link.unlink(missing_ok=True)
        link.symlink_to(wheel.resolve())
        fixtures.wheels[wheel.name] = sha256_file(wheel)
    double = torchdouble.build(out / torchdouble.DIRECTORY, torchdouble.pinned(pins))
    fixtures.torch_double = {"file": double.name, "sha256": sha256_file(double)}
    (out / "fixture.json").write_text(json.dumps(asdict(fixtures), indent=2) + "\n")
    return fixtures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuforge_lab.artifacts.fixtures",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="action", required=True)
    p_build = sub.add_parser("build", help="write the signed fixtures and fixture.json")
    p_build.add_argument("--out", required=True, type=Path)
    p_build.add_argument("--efa-version", help="default: the efa_installer pin in versions.yml")
    p_build.add_argument(
        "--wheel", action="append", type=Path, default=[], help="a wheel to serve (repeatable)"
    )
    args = parser.parse_args(argv)
    try:
        version = args.efa_version or versions.load().version("efa_installer")
        fixtures = build(args.out, version, args.wheel)
    except (UserError, ExternalError) as exc:
        print(f"gpuforge: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps(asdict(fixtures), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
