"""A small typed wrapper around the packer binary.

python-packer (the 2016 wrapper the design names) takes a single template *file*, so it cannot drive
an HCL2 template directory, and its `inspect` breaks on Python 3 (bytes/str); see docs/ami-pipeline.md.
This wrapper runs packer with -machine-readable, streams progress to the user while it runs, keeps the
raw log, and stages the template directory so Packer 1.6 (no required_plugins) and modern Packer
(required_plugins in plugins.pkr.hcl.modern) both work from the same files.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, TextIO

from gpuforge import paths
from gpuforge.errors import ExternalError, UserError

LOG = logging.getLogger(__name__)

MODERN_PLUGINS_FILE = "plugins.pkr.hcl.modern"
# Settings of the amazon-ebs source that only modern Packer takes, and the line of gpuforge.pkr.hcl they
# replace when staged for it.
MODERN_SOURCE_FILE = "amazon-ebs.pkr.hcl.modern"
MAIN_TEMPLATE = "gpuforge.pkr.hcl"
MODERN_MARKER = "  # gpuforge:modern-packer-settings\n"
# The oldest Packer the modern staging runs on: plugins.pkr.hcl.modern says
# `required_version = ">= 1.10.0"`, so an older Packer stops at `packer init`. 1.10 is the first release
# that bundles no plugins (hashicorp/packer CHANGELOG.md, "1.10.0 (December 5, 2023)", GH-12660): the
# amazon and ansible plugins then come only from required_plugins at the pinned ranges, never from a
# bundled copy of another release. required_plugins and `packer init` arrived in 1.7 (CHANGELOG "1.7.0"),
# which is where the legacy staging ends.
MODERN_MIN = (1, 10, 0)
LEGACY_MAX = (1, 7, 0)  # exclusive: Packer 1.6 (Debian 12's package) takes the legacy staging
_VERSION_RE = re.compile(r"(\d+)\.(\d+)\.(\d+)")
# Where boto3 sends EC2 calls when told to (the AWS SDKs' service-specific endpoint first, then the global
# one: https://docs.aws.amazon.com/sdkref/latest/guide/feature-ss-endpoints.html). The tests and the lab
# point these at moto on loopback (gpuforge_lab.moto.MotoServer.env); a production bake sets neither.
EC2_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_EC2", "AWS_ENDPOINT_URL")
# How long Packer gets to clean up (terminate its builder, delete its key pair and security group)
# after gpuforge interrupts a build, before it is killed.
CLEANUP_TIMEOUT_S = 600.0

# The amazon-ebs builder's report of the instance it launched, as `ui.Message("Instance ID: i-...")`
# in StepRunSourceInstance (Packer 1.6 builder/amazon/common/step_run_source_instance.go, and
# waitForInstanceReadiness in packer-plugin-amazon). -machine-readable prints it as
# `<time>,,ui,message,    amazon-ebs.gpu: Instance ID: i-0123...`: TargetedUI indents a message by
# the width of "==>" and prefixes the build name, and the target field stays empty.
_INSTANCE_ID_RE = re.compile(r"^\s+(?P<build>[\w.-]+): Instance ID: (?P<id>i-[0-9a-f]{8,17})$")


def template_dir() -> Path:
    return paths.packer_dir()


@dataclass(frozen=True)
class MachineLine:
    """One line of `packer -machine-readable`: timestamp,target,type,data..."""

    timestamp: int
    target: str
    kind: str
    data: tuple[str, ...]

    @classmethod
    def parse(cls, line: str) -> MachineLine | None:
        parts = line.rstrip("\n").split(",")
        if len(parts) < 3 or not parts[0].isdigit():
            return None
        # Packer escapes commas and newlines inside fields.
        data = tuple(
            p.replace("%!(PACKER_COMMA)", ",").replace("\\n", "\n").replace("\\r", "") for p in parts[3:]
        )
        return cls(int(parts[0]), parts[1], parts[2], data)


def launched_instance(line: MachineLine, build: str) -> str | None:
    """The id of the EC2 instance that `build` (e.g. "amazon-ebs.gpu") says it launched, if line says so."""
    if line.kind != "ui" or len(line.data) < 2 or line.data[0] != "message":
        return None
    match = _INSTANCE_ID_RE.match(line.data[1].rstrip())
    if match is None or match["build"] != build:
        return None
    return match["id"]


@dataclass
class Progress:
    """Turns machine-readable lines into human progress on a stream, with elapsed time."""

    out: TextIO = field(default_factory=lambda: sys.stderr)
    started: float = field(default_factory=time.monotonic)
    errors: list[str] = field(default_factory=list)
    artifacts: dict[str, list[str]] = field(default_factory=dict)

    def __call__(self, line: MachineLine) -> None:
        if line.kind == "ui" and len(line.data) >= 2:
            level, message = line.data[0], line.data[1].rstrip()
            if level == "error":
                self.errors.append(message)
            if message:
                self._say(message)
        elif line.kind == "artifact" and len(line.data) >= 3 and line.data[1] == "id":
            self.artifacts.setdefault(line.target, []).append(line.data[2])
            self._say(f"artifact from {line.target}: {line.data[2]}")
        elif line.kind == "error" and line.data:
            self.errors.append(line.data[0])
            self._say(f"error: {line.data[0]}")

    def _say(self, message: str) -> None:
        elapsed = int(time.monotonic() - self.started)
        stamp = f"[{elapsed // 60:3d}m{elapsed % 60:02d}s]"
        for text in message.splitlines() or [""]:
            print(f"{stamp} {text}", file=self.out, flush=True)


@dataclass(frozen=True)
class Packer:
    """The packer executable (found on PATH, or $GPUFORGE_PACKER)."""

    executable: str

    @classmethod
    def find(cls) -> Packer:
        exe = os.environ.get("GPUFORGE_PACKER") or shutil.which("packer")
        if not exe:
            raise UserError(
                "packer is not installed: apt-get install packer (Debian/Ubuntu) or install "
                "HashiCorp's Packer >= 1.10, or set GPUFORGE_PACKER to its path"
            )
        return cls(exe)

    @cached_property
    def version(self) -> tuple[int, int, int]:
        out = self._run(["version"]).stdout
        match = _VERSION_RE.search(out)
        if not match:
            raise ExternalError(f"cannot tell the version of {self.executable} from {out!r}")
        major, minor, patch = (int(g) for g in match.groups())
        return major, minor, patch

    @property
    def modern(self) -> bool:
        """True for Packer >= MODERN_MIN, False for Packer 1.6; any release in between is refused, since
        it can run neither staging (it rejects the plugin file's required_version, and the legacy one
        would bake with the plugins it bundles)."""
        version = self.version
        if version >= MODERN_MIN:
            return True
        if version < LEGACY_MAX:
            return False
        found = ".".join(map(str, version))
        raise UserError(
            f"packer {found} ({self.executable}) is not supported: use Packer >= "
            f"{'.'.join(map(str, MODERN_MIN))} (packer/plugins.pkr.hcl.modern requires it) or Debian 12's "
            "packer 1.6; set GPUFORGE_PACKER to pick the binary"
        )

    def stage(self, source: Path, work: Path) -> Path:
        """Copy the templates into work/templates; with modern Packer add the plugin requirements and the
        amazon-ebs settings Packer 1.6 rejects (IMDSv2-only builder and image)."""
        staged = stage_templates(source, work / "templates", modern=self.modern)
        if self.modern:
            self._run(["init", str(staged)], check=True)
        return staged

    def build(
        self,
        templates: Path,
        var_file: Path,
        log_path: Path,
        only: Sequence[str] = (),
        on_line: Callable[[MachineLine], None] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> int:
        """Run `packer build`, streaming each machine-readable line to on_line; return its exit status.

        If on_line raises, Packer is interrupted as Ctrl-C would (so it still cleans up what it created),
        and the exception propagates once Packer has exited.
        """
        args = [
            self.executable,
            "build",
            "-machine-readable",
            "-color=false",
            "-on-error=cleanup",
            f"-var-file={var_file}",
            *_only(only),
            str(templates),
        ]
        LOG.debug("running %s", " ".join(args))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as log:
            try:
                proc = subprocess.Popen(
                    args,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env={**os.environ, **(env or {}), "PACKER_NO_COLOR": "1", "CHECKPOINT_DISABLE": "1"},
                )
            except OSError as exc:
                raise ExternalError(f"cannot run {self.executable}: {exc}") from exc
            assert proc.stdout is not None
            try:
                for raw in proc.stdout:
                    log.write(raw)
                    log.flush()
                    parsed = MachineLine.parse(raw)
                    if on_line is not None and parsed is not None:
                        on_line(parsed)
            except BaseException as exc:
                # Ctrl-C at a terminal has already reached Packer (same process group); anything else
                # (on_line refusing the build) has not.
                _interrupt(proc, log, signal_packer=not isinstance(exc, KeyboardInterrupt))
                raise
            return proc.wait()

    def _run(self, args: list[str], check: bool = False) -> subprocess.CompletedProcess[str]:
        try:
            result = subprocess.run(
                [self.executable, *args],
                capture_output=True,
                text=True,
                check=False,
                env={**os.environ, "CHECKPOINT_DISABLE": "1"},
            )
        except OSError as exc:
            raise ExternalError(f"cannot run {self.executable}: {exc}") from exc
        if check and result.returncode != 0:
            raise ExternalError(f"packer {args[0]} failed:\n{(result.stdout + result.stderr).strip()}")
        return result


def ec2_endpoint(environ: Mapping[str, str] | None = None) -> str:
    """The EC2 endpoint URL the environment names (EC2_ENDPOINT_VARIABLES), or "" for AWS's own."""
    env = os.environ if environ is None else environ
    return next((env[name] for name in EC2_ENDPOINT_VARIABLES if env.get(name)), "")


def emulated_ec2(environ: Mapping[str, str] | None = None) -> bool:
    """True when EC2 calls go to an emulator on this machine (an endpoint on a loopback address)."""
    host = urllib.parse.urlsplit(ec2_endpoint(environ)).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_for_aws(packer: Packer, environ: Mapping[str, str] | None = None) -> None:
    """Refuse a Packer older than MODERN_MIN for a bake on AWS (not a lab host's, `gpuforge-lab bake`).

    The pipeline policy lets Packer modify, copy, tag and clean up only images that carry the bake's
    gpuforge:build-id, which the amazon plugin puts on the image with CreateImage itself (run_tags,
    packer-plugin-amazon v1.8.2 builder/ebs/step_create_ami.go:72-88). Packer 1.6 tags the image only at its
    last step (hashicorp/packer v1.6.6 builder/amazon/ebs/step_create_ami.go:47-51 and StepCreateTags), so on
    real AWS its ModifyImageAttribute, CopyImage, CreateTags and its cleanup are denied
    (tests/test_iam_policy.py, PACKER_1_6_DENIED). Against an emulator, which enforces no IAM (moto in the
    tests), Packer 1.6 stays usable.
    """
    if packer.modern:
        return
    found = ".".join(map(str, packer.version))
    if emulated_ec2(environ):
        LOG.info("packer %s against the EC2 emulator at %s (refused on AWS)", found, ec2_endpoint(environ))
        return
    raise UserError(
        f"packer {found} ({packer.executable}) cannot bake on AWS: the pipeline policy needs the build id "
        "(gpuforge:build-id) on the image from CreateImage on, and Packer before "
        f"{'.'.join(map(str, MODERN_MIN))} tags the image only at its last step, so its image calls and its "
        f"cleanup are denied. Install Packer >= {'.'.join(map(str, MODERN_MIN))} (set GPUFORGE_PACKER to "
        "its path); Packer 1.6 serves only `gpuforge-lab bake` and an EC2 emulator on loopback "
        f"({' or '.join(EC2_ENDPOINT_VARIABLES)})"
    )


def stage_templates(source: Path, staged: Path, modern: bool) -> Path:
    """The template directory a Packer generation can run: for Packer >= 1.7 with plugins.pkr.hcl and the
    modern-only source settings in place of MODERN_MARKER; for Packer 1.6 the templates as they are."""
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    for template in sorted(source.glob("*.pkr.hcl")):
        shutil.copy2(template, staged / template.name)
    if modern:
        shutil.copy2(source / MODERN_PLUGINS_FILE, staged / "plugins.pkr.hcl")
        main = staged / MAIN_TEMPLATE
        text = main.read_text()
        if text.count(MODERN_MARKER) != 1:
            raise ExternalError(f"{source / MAIN_TEMPLATE} must hold the line {MODERN_MARKER.strip()!r} once")
        main.write_text(text.replace(MODERN_MARKER, (source / MODERN_SOURCE_FILE).read_text()))
    return staged


def _interrupt(proc: subprocess.Popen[str], log: TextIO, signal_packer: bool = True) -> None:
    """Stop a running `packer build` and wait for it, keeping its remaining output in the log.

    SIGINT, not SIGTERM: on an interrupt Packer cancels the build and still runs every step's cleanup
    (terminate the builder, delete its temporary key pair and security group). A Packer that does not
    finish within CLEANUP_TIMEOUT_S is killed, and the log says so.
    """
    if signal_packer and proc.poll() is None:
        LOG.warning("interrupting packer (pid %d); it cleans up what it created", proc.pid)
        proc.send_signal(signal.SIGINT)
    killer = threading.Timer(CLEANUP_TIMEOUT_S, proc.kill)
    killer.start()
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            log.write(raw)
        status = proc.wait()
    finally:
        killer.cancel()
    if status == -signal.SIGKILL:
        log.write(f"gpuforge: killed packer after {CLEANUP_TIMEOUT_S:.0f} s of cleanup\n")
    log.flush()


def _only(only: Sequence[str]) -> list[str]:
    return [f"-only={','.join(only)}"] if only else []


def write_var_file(path: Path, variables: Mapping[str, Any]) -> Path:
    """Variables go in a JSON var file: map keys with colons need no HCL quoting and nothing shows in ps."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(variables), indent=2, sort_keys=True) + "\n")
    return path
