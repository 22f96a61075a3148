"""The local artifact server and its signed TEST FIXTURES (no lab needed: loopback only)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gpuforge import versions
from gpuforge.errors import UserError
from gpuforge_lab.artifacts import fixtures, server

needs_gpg = pytest.mark.skipif(
    shutil.which("gpg") is None or shutil.which("gpgv") is None, reason="needs gnupg"
)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 (loopback test server)
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def test_server_serves_exact_files_only(tmp_path: Path) -> None:
    """Files come back byte for byte; a missing file and a directory listing are 404s."""
    (tmp_path / "efa").mkdir()
    payload = bytes(range(256)) * 40
    (tmp_path / "efa" / "blob.bin").write_bytes(payload)
    with server.serving(tmp_path) as srv:
        assert srv.url.startswith("http://127.0.0.1:")
        assert _get(f"{srv.url}/efa/blob.bin") == (200, payload)
        assert _get(f"{srv.url}/efa/missing.bin")[0] == 404
        assert _get(f"{srv.url}/efa/")[0] == 404


def test_server_does_not_escape_its_root(tmp_path: Path) -> None:
    """A ../ path cannot reach files outside the served directory."""
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret.txt").write_text("outside")
    with server.serving(root) as srv:
        status, body = _get(f"{srv.url}/../secret.txt")
        assert body != b"outside"
        assert status == 404


# The wildcard addresses are the inputs being refused, never bound.
@pytest.mark.parametrize("address", ["0.0.0.0", "10.0.0.5", "192.168.1.1", "::"])  # noqa: S104
def test_server_refuses_non_lab_addresses(tmp_path: Path, address: str) -> None:
    """Only loopback or a lab gateway may be bound; anything else is a UserError naming the rule."""
    with pytest.raises(UserError, match="only loopback or a lab bridge gateway"):
        server.ArtifactServer(tmp_path, address, 0, allowed={"10.213.9.1"})


def test_server_accepts_a_lab_gateway_by_rule() -> None:
    """check_address passes an allowed lab gateway through and rejects a neighbour on the same subnet."""
    assert server.check_address("10.213.9.1", allowed={"10.213.9.1"}) == "10.213.9.1"
    with pytest.raises(UserError):
        server.check_address("10.213.9.10", allowed={"10.213.9.1"})


@pytest.mark.parametrize("text", ["127.0.0.1", "127.0.0.1:http", "127.0.0.1:70000", ":"])
def test_parse_listen_rejects_bad_input(text: str) -> None:
    with pytest.raises(UserError, match="IP:PORT"):
        server.parse_listen(text)


def test_server_cli_refuses_wildcard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command line exits 2 with a clear message instead of binding 0.0.0.0."""
    assert server.main(["--root", str(tmp_path), "--listen", "0.0.0.0:0"]) == 2
    assert "refusing to listen on 0.0.0.0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> fixtures.Fixtures:
    if shutil.which("gpg") is None:
        pytest.skip("needs gnupg")
    wheel = tmp_path_factory.mktemp("wheel") / "demo-1.0-py3-none-any.whl"
    wheel.write_bytes(b"TEST FIXTURE wheel")
    return fixtures.build(tmp_path_factory.mktemp("fx"), "9.8.7", [wheel])


def _gpgv(keyfile: Path, sig: Path, data: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    keyring = tmp_path / "ring.gpg"
    with keyfile.open("rb") as src, keyring.open("wb") as dst:
        subprocess.run(["gpg", "--batch", "--dearmor"], stdin=src, stdout=dst, check=True)
    return subprocess.run(
        ["gpgv", "--status-fd", "1", "--keyring", str(keyring), str(sig), str(data)],
        capture_output=True,
        text=True,
        check=False,
    )


@needs_gpg
def test_fixture_tarball_holds_the_stand_in_installer(built: fixtures.Fixtures) -> None:
    """The tarball has the real layout (aws-efa-installer/efa_installer.sh) with the version filled in."""
    tarball = Path(built.root) / "efa" / built.efa_tarball
    assert built.efa_tarball == "aws-efa-installer-9.8.7.tar.gz"
    assert fixtures.sha256_file(tarball) == built.efa_sha256
    with tarfile.open(tarball) as tar:
        member = tar.getmember("aws-efa-installer/efa_installer.sh")
        assert member.mode & 0o111
        script = tar.extractfile(member).read().decode()  # type: ignore[union-attr]
    assert 'version="9.8.7"' in script
    assert "TEST FIXTURE" in script


@needs_gpg
def test_fixture_ofi_source_tarball_builds_the_pinned_banner(
    built: fixtures.Fixtures, tmp_path: Path
) -> None:
    """The stand-in aws-ofi-nccl source sits at the release asset's path, pinned by its sha512, and
    its configure, make and make install (as the aws_ofi_nccl role runs them) put a library with
    the pin's banner at PREFIX/lib/libnccl-net.so; configure refuses a CUDA home without cuda.h."""
    pin = versions.load().version("aws_ofi_nccl")
    assert built.ofi_version == pin
    assert built.ofi_tarball == f"ofi/v{pin}/aws-ofi-nccl-{pin}.tar.gz"
    tarball = Path(built.root) / built.ofi_tarball
    assert hashlib.sha512(tarball.read_bytes()).hexdigest() == built.ofi_sha512
    assert json.loads((Path(built.root) / "fixture.json").read_text())["ofi_sha512"] == built.ofi_sha512
    with tarfile.open(tarball) as tar:
        assert {member.name.split("/")[0] for member in tar.getmembers()} == {f"aws-ofi-nccl-{pin}"}
        tar.extractall(tmp_path, filter="data")
    source, cuda, prefix = tmp_path / f"aws-ofi-nccl-{pin}", tmp_path / "cuda", tmp_path / "prefix"
    refused = subprocess.run(
        ["./configure", f"--prefix={prefix}", f"--with-cuda={cuda}"],
        cwd=source,
        capture_output=True,
        text=True,
        check=False,
    )
    assert refused.returncode != 0
    assert f"CUDA headers not found under {cuda}" in refused.stderr
    (cuda / "include").mkdir(parents=True)
    (cuda / "include" / "cuda.h").write_text("/* TEST FIXTURE */\n")
    flags = [
        "--with-libfabric=/opt/amazon/efa",
        f"--with-cuda={cuda}",
        "--enable-platform-aws",
        "--disable-tests",
    ]
    for command in (["./configure", f"--prefix={prefix}", *flags], ["make", "-j", "2"], ["make", "install"]):
        subprocess.run(command, cwd=source, check=True, capture_output=True)
    library = (prefix / "lib" / "libnccl-net.so").read_bytes()
    assert library.startswith(b"\x7fELF")
    assert f"Initializing aws-ofi-nccl {pin} (gpuforge TEST FIXTURE".encode() in library


@needs_gpg
def test_fixture_signatures(built: fixtures.Fixtures, tmp_path: Path) -> None:
    """Good: VALIDSIG by the fixture key. Bad-sig: BADSIG. Wrong key: signed by a different fingerprint."""
    root = Path(built.root)
    name = built.efa_tarball
    good = _gpgv(root / "efa/aws-efa-installer.key", root / f"efa/{name}.sig", root / f"efa/{name}", tmp_path)
    assert good.returncode == 0
    assert f"VALIDSIG {built.efa_key_fingerprint}" in good.stdout
    bad = _gpgv(
        root / "efa-badsig/aws-efa-installer.key",
        root / f"efa-badsig/{name}.sig",
        root / f"efa-badsig/{name}",
        tmp_path,
    )
    assert bad.returncode != 0
    assert "BADSIG" in bad.stdout
    impostor = _gpgv(
        root / "efa-wrongkey/aws-efa-installer.key",
        root / f"efa-wrongkey/{name}.sig",
        root / f"efa-wrongkey/{name}",
        tmp_path,
    )
    assert built.impostor_fingerprint != built.efa_key_fingerprint
    assert f"VALIDSIG {built.impostor_fingerprint}" in impostor.stdout
    assert built.efa_key_fingerprint not in impostor.stdout


@needs_gpg
def test_fixture_record_and_wheels(built: fixtures.Fixtures) -> None:
    """fixture.json matches what was built; wheels are linked under wheels/ with their sha256."""
    record = json.loads((Path(built.root) / "fixture.json").read_text())
    assert record["efa_sha256"] == built.efa_sha256
    assert record["efa_key_fingerprint"] == built.efa_key_fingerprint
    wheel = Path(built.root) / "wheels" / "demo-1.0-py3-none-any.whl"
    assert wheel.read_bytes() == b"TEST FIXTURE wheel"
    assert record["wheels"] == {"demo-1.0-py3-none-any.whl": fixtures.sha256_file(wheel)}
    assert "TEST FIXTURE" in fixtures.FIXTURE_UID


def test_lab_gateways_come_from_lab_state_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The allowed non-loopback addresses are exactly the gateways of labs with a state file."""
    monkeypatch.setenv("GPUFORGE_LAB_DIR", str(tmp_path))
    assert server.lab_gateways() == set()
    for name, prefix in (("alpha", "10.213.7"), ("beta", "10.213.8")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.json").write_text(json.dumps({"subnet_prefix": prefix}))
    assert server.lab_gateways() == {"10.213.7.1", "10.213.8.1"}
    assert server.check_address("10.213.8.1") == "10.213.8.1"


def test_server_cli_names_a_lab_that_is_not_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--lab for a lab without state exits 2 and says how to start it."""
    monkeypatch.setenv("GPUFORGE_LAB_DIR", str(tmp_path))
    assert server.main(["--root", str(tmp_path), "--lab", "nolab"]) == 2
    assert "lab 'nolab' is not up" in capsys.readouterr().err
