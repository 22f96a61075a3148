"""The real packer binary against packer/: fmt, validate (both flavors, bad inputs), the sanitize step,
and the machine-readable output and manifest formats our wrapper parses.

CI installs Debian's `packer` package (1.6.6). packer runs under `unshare -n` where possible, so it
cannot reach any network (validate contacts no AWS endpoint either way).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuforge import versions
from gpuforge.ami import manifest as packer_manifest
from gpuforge.ami.packer import (
    MODERN_PLUGINS_FILE,
    MachineLine,
    Packer,
    Progress,
    stage_templates,
    write_var_file,
)

REPO = Path(__file__).resolve().parents[1]
PACKER_DIR = REPO / "packer"
SANITIZE = PACKER_DIR / "scripts" / "sanitize.sh"

needs_packer = pytest.mark.skipif(
    shutil.which("packer") is None, reason="packer binary absent (CI installs it: apt-get install packer)"
)


def _offline(cmd: list[str]) -> list[str]:
    """Run cmd in a network namespace of its own when we may (root), so it cannot reach any network."""
    if os.geteuid() == 0 and shutil.which("unshare"):
        return ["unshare", "-n", *cmd]
    return cmd


def _packer_env() -> dict[str, str]:
    # The ansible provisioner runs `ansible-playbook --version` during validate: use the venv's.
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["CHECKPOINT_DISABLE"] = "1"
    return env


@pytest.fixture
def staged(tmp_path: Path) -> Path:
    return Packer.find().stage(PACKER_DIR, tmp_path)


def _validate(staged: Path, tmp_path: Path, **overrides: object) -> subprocess.CompletedProcess[str]:
    variables = {
        "repo_root": str(REPO),
        "source_ami": "ami-0123456789abcdef0",
        "image_tags": versions.load().image_tags(),
        "manifest_path": str(tmp_path / "manifest.json"),
        # Session Manager (the default ssh_interface) needs the builder's instance profile.
        "iam_instance_profile": "gpuforge-builder-us-east-1",
        **overrides,
    }
    variables = {k: v for k, v in variables.items() if v is not None}
    var_file = write_var_file(tmp_path / "vars.json", variables)
    cmd = _offline([Packer.find().executable, "validate", f"-var-file={var_file}", str(staged)])
    return subprocess.run(cmd, capture_output=True, text=True, env=_packer_env(), check=False)


@needs_packer
def test_templates_are_packer_fmt_clean(tmp_path: Path) -> None:
    result = subprocess.run(
        ["packer", "fmt", "-check", "-diff", str(PACKER_DIR)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The modern-only plugin file is HCL too; fmt checks it under a .pkr.hcl name.
    copy = tmp_path / "plugins.pkr.hcl"
    shutil.copy(PACKER_DIR / MODERN_PLUGINS_FILE, copy)
    result = subprocess.run(["packer", "fmt", "-check", "-diff", str(copy)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_packer
def test_staging_keeps_plugin_requirements_out_for_packer_1_6(staged: Path) -> None:
    names = sorted(p.name for p in staged.iterdir())
    assert names == sorted(p.name for p in PACKER_DIR.glob("*.pkr.hcl"))
    if Packer.find().modern:
        pytest.skip("modern packer: the plugin file is staged on purpose")
    assert "plugins.pkr.hcl" not in names


@needs_packer
@pytest.mark.skipif(
    not (REPO / "playbooks" / "bake.yml").is_file(),
    reason="playbooks/bake.yml (the bake playbook, another issue) is not in the checkout yet",
)
@pytest.mark.parametrize("flavor", ["dlami", "pcluster"])
def test_packer_validate_accepts_both_flavors(staged: Path, tmp_path: Path, flavor: str) -> None:
    result = _validate(staged, tmp_path, flavor=flavor)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_packer
@pytest.mark.skipif(
    not (REPO / "playbooks" / "bake.yml").is_file(),
    reason="playbooks/bake.yml (the bake playbook, another issue) is not in the checkout yet",
)
def test_packer_validate_with_fallback_filter_and_lab_key(staged: Path, tmp_path: Path) -> None:
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    result = _validate(staged, tmp_path, source_ami="", lab_host="10.213.7.2", lab_private_key_file=str(key))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_packer
@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("flavor", "centos", "flavor must be dlami or pcluster"),
        ("source_ami", "ami-123", "source_ami must be an AMI id"),
        ("source_ami", "img-0123456789abcdef0", "source_ami must be an AMI id"),
        (
            "root_volume_size_gib",
            4,
            "root_volume_size_gib must be 0 (the base AMI's snapshot size) or between",
        ),
        ("ssh_interface", "ssh", "ssh_interface must be session_manager"),
        ("temporary_security_group_source_cidrs", ["0.0.0.0/0"], "must not open SSH to the whole internet"),
        ("instance_type", "g5", "instance_type must look like"),
        ("region", "mars", "region must be an AWS region"),
    ],
)
def test_packer_validate_rejects_bad_variables(
    staged: Path, tmp_path: Path, variable: str, value: object, message: str
) -> None:
    result = _validate(staged, tmp_path, **{variable: value})
    assert result.returncode != 0
    # Packer wraps its messages at 80 columns.
    assert message in " ".join((result.stdout + result.stderr).split())


def _fake_root(root: Path) -> None:
    files = {
        "etc/ssh/ssh_host_ed25519_key": "secret",
        "etc/ssh/ssh_host_ed25519_key.pub": "pub",
        "etc/ssh/ssh_host_rsa_key": "secret",
        "etc/ssh/sshd_config": "PermitRootLogin no\n",
        "root/.ssh/authorized_keys": "ssh-ed25519 AAAA root",
        "root/.bash_history": "export TOKEN=x\n",
        "home/ubuntu/.ssh/authorized_keys": "ssh-ed25519 AAAA packer",
        "home/ubuntu/.ssh/config": "Host *\n",
        "home/ubuntu/.bash_history": "ls\n",
        "home/ubuntu/.python_history": "1+1\n",
        "var/lib/cloud/instances/i-0abc/user-data.txt": "#cloud-config\n",
        "var/lib/cloud/data/instance-id": "i-0abc\n",
        "var/lib/cloud/seed/nocloud/meta-data": "instance-id: lab\n",
        "var/log/cloud-init.log": "log\n",
        "var/log/syslog": "builder's syslog\n",
        "var/log/journal/0123/system.journal": "journal\n",
        "var/log/lastlog": "builder logins\n",
        "tmp/ansible-build.log": "x\n",
        "tmp/.hidden": "x\n",
        "var/tmp/packer-cache": "x\n",
        "var/crash/_usr_bin_python3.0.crash": "core\n",
        "opt/parallelcluster/pin_releasesever": "",
        "etc/yum/vars/releasever": "8\n",
        "etc/udev/rules.d/70-persistent-net.rules": "SUBSYSTEM==net\n",
        "etc/udev/rules.d/60-keep.rules": "kept\n",
        "etc/sysconfig/network-scripts/ifcfg-eth0": (
            "# Created by cloud-init on instance boot automatically\n"
        ),
        "etc/sysconfig/network-scripts/ifcfg-lo": "DEVICE=lo\n",
        "etc/munge/munge.key": "builder's munge key\n",
        "etc/machine-id": "0123456789abcdef0123456789abcdef\n",
        "var/lib/dbus/machine-id": "0123456789abcdef0123456789abcdef\n",
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "var/lib/cloud/instance").symlink_to("instances/i-0abc")


def _sanitize(root: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "SANITIZE_ROOT": str(root)}
    return subprocess.run(["bash", str(SANITIZE)], env=env, capture_output=True, text=True, check=True)


def test_sanitize_removes_host_identity_and_secrets(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _fake_root(root)
    result = _sanitize(root)
    assert not list((root / "etc/ssh").glob("ssh_host_*"))
    assert (root / "etc/ssh/sshd_config").is_file()
    assert not (root / "root/.ssh/authorized_keys").exists()
    assert not (root / "home/ubuntu/.ssh/authorized_keys").exists()
    assert (root / "home/ubuntu/.ssh/config").is_file()
    for history in ("root/.bash_history", "home/ubuntu/.bash_history", "home/ubuntu/.python_history"):
        assert not (root / history).exists(), history
    # As ParallelCluster's ami_cleanup.sh: cloud-init state and seed, scratch, crash dumps, pinned
    # network identity, every log file (directories kept, lastlog emptied).
    assert list((root / "var/lib/cloud").iterdir()) == []
    assert not (root / "var/log/cloud-init.log").exists()
    assert not (root / "var/log/syslog").exists()
    assert not (root / "var/log/journal/0123/system.journal").exists()
    assert (root / "var/log/journal/0123").is_dir()
    assert (root / "var/log/lastlog").read_text() == ""
    for emptied in ("tmp", "var/tmp", "var/crash"):
        assert list((root / emptied).iterdir()) == [], emptied
    assert not (root / "etc/udev/rules.d/70-persistent-net.rules").exists()
    assert (root / "etc/udev/rules.d/60-keep.rules").is_file()
    assert not (root / "etc/sysconfig/network-scripts/ifcfg-eth0").exists()
    assert (root / "etc/sysconfig/network-scripts/ifcfg-lo").is_file()
    assert not (root / "opt/parallelcluster/pin_releasesever").exists()
    assert not (root / "etc/yum/vars/releasever").exists()
    assert (root / "etc/machine-id").is_file()
    assert (root / "etc/machine-id").read_text() == ""
    assert not (root / "var/lib/dbus/machine-id").exists()
    assert not (root / "etc/munge/munge.key").exists()
    assert (root / "etc/munge").is_dir()
    assert "cleaned" in result.stdout

    # A second run (an already clean image) succeeds and removes nothing more.
    again = _sanitize(root)
    assert "cleaned 1 item(s)" in again.stdout  # only the (already empty) machine-id is rewritten


@needs_packer
def test_real_packer_output_and_manifest_parse(tmp_path: Path) -> None:
    """A real (network-free) packer build of a null source: our line parser, progress and manifest
    reader must understand what this packer actually writes."""
    template = tmp_path / "t"
    template.mkdir()
    manifest_path = tmp_path / "manifest.json"
    (template / "t.pkr.hcl").write_text(
        'source "null" "lab" {\n  communicator = "none"\n}\n'
        'build {\n  sources = ["source.null.lab"]\n'
        '  post-processor "manifest" {\n'
        f'    output = "{manifest_path}"\n'
        '    custom_data = { flavor = "dlami", note = "a, b" }\n  }\n}\n'
    )
    packer = Packer.find()
    stream = tmp_path / "progress.txt"
    with stream.open("w") as out:
        progress = Progress(out=out)
        lines: list[MachineLine] = []

        def record(line: MachineLine) -> None:
            lines.append(line)
            progress(line)

        var_file = write_var_file(tmp_path / "vars.json", {})
        status = packer.build(template, var_file, tmp_path / "packer.log", only=["null.lab"], on_line=record)
    assert status == 0, (tmp_path / "packer.log").read_text()
    assert any(line.kind == "ui" for line in lines)
    assert any(line.kind == "artifact" and line.target == "null.lab" for line in lines)
    assert "[" in stream.read_text() and "null.lab" in stream.read_text()
    artifacts = packer_manifest.last_run(manifest_path)
    assert [a.name for a in artifacts] == ["lab"]
    assert artifacts[0].builder_type == "null"
    assert artifacts[0].images == {}
    assert artifacts[0].custom_data == {"flavor": "dlami", "note": "a, b"}
    # Packer appends runs to the same manifest; only the last one counts.
    packer.build(template, var_file, tmp_path / "packer2.log", only=["null.lab"])
    data = json.loads(manifest_path.read_text())
    assert len(data["builds"]) == 2
    assert len(packer_manifest.last_run(manifest_path)) == 1


CHECK_BASE = PACKER_DIR / "scripts" / "check-base.sh"


def _check_base(root: Path, flavor: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "CHECK_ROOT": str(root), "GPUFORGE_FLAVOR": flavor}
    return subprocess.run(["bash", str(CHECK_BASE)], env=env, capture_output=True, text=True, check=False)


def test_check_base_requires_parallelcluster_marker_for_pcluster(tmp_path: Path) -> None:
    assert _check_base(tmp_path, "dlami").returncode == 0
    missing = _check_base(tmp_path, "pcluster")
    assert missing.returncode == 1 and "not an official ParallelCluster AMI" in missing.stderr
    marker = tmp_path / "opt/parallelcluster/.bootstrapped"
    marker.parent.mkdir(parents=True)
    marker.write_text("")
    assert _check_base(tmp_path, "pcluster").returncode == 1  # an empty marker is no bootstrap either
    marker.write_text("aws-parallelcluster-cookbook-3.16.1")
    ok = _check_base(tmp_path, "pcluster")
    assert ok.returncode == 0 and "3.16.1" in ok.stdout
    assert _check_base(tmp_path, "centos").returncode == 1


def test_machine_readable_lines_are_unescaped() -> None:
    line = MachineLine.parse("1796220038,amazon-ebs.gpu,ui,say,==> a%!(PACKER_COMMA) b\\nc\n")
    assert line == MachineLine(1796220038, "amazon-ebs.gpu", "ui", ("say", "==> a, b\nc"))
    assert MachineLine.parse("not machine readable") is None
    assert MachineLine.parse("") is None


@pytest.mark.skipif(
    shutil.which("shellcheck") is None, reason="shellcheck absent (apt-get install shellcheck)"
)
def test_packer_scripts_pass_shellcheck() -> None:
    scripts = sorted(str(p) for p in (PACKER_DIR / "scripts").glob("*.sh"))
    assert scripts
    result = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout


def _amazon_ebs_source(text: str) -> str:
    return text[text.index('source "amazon-ebs" "gpu"') : text.index('source "null" "lab"')]


def test_modern_staging_makes_builder_and_image_imdsv2_only(tmp_path: Path) -> None:
    """What modern Packer runs (gpuforge bake, or a user running the staged directory) sets
    metadata_options and imds_support in the amazon-ebs source; Packer 1.6's staging has neither."""
    modern = stage_templates(PACKER_DIR, tmp_path / "modern", modern=True)
    source = _amazon_ebs_source((modern / "gpuforge.pkr.hcl").read_text())
    options = re.search(r"\n  metadata_options \{\n(.*?)\n  \}\n", source, re.S)
    assert options is not None, source
    settings = dict(re.findall(r'^\s*(\w+)\s*=\s*"([^"]*)"$', options.group(1), re.M))
    assert settings == {"http_endpoint": "enabled", "http_tokens": "required"}
    assert re.search(r'^  imds_support = "v2.0"$', source, re.M)
    assert "gpuforge:modern-packer-settings" not in source
    assert (modern / "plugins.pkr.hcl").read_text() == (PACKER_DIR / MODERN_PLUGINS_FILE).read_text()
    legacy = stage_templates(PACKER_DIR, tmp_path / "legacy", modern=False)
    legacy_source = _amazon_ebs_source((legacy / "gpuforge.pkr.hcl").read_text())
    assert not re.search(r"^\s*(metadata_options|imds_support)\b", legacy_source, re.M)
    assert "plugins.pkr.hcl" not in {p.name for p in legacy.iterdir()}


@needs_packer
def test_modern_staging_is_packer_fmt_clean(tmp_path: Path) -> None:
    modern = stage_templates(PACKER_DIR, tmp_path / "modern", modern=True)
    result = subprocess.run(["packer", "fmt", "-check", "-diff", str(modern)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_bakes_never_share_cached_facts(tmp_path: Path) -> None:
    """Every Packer build's host is called "default": with ansible.cfg's jsonfile fact cache a bake
    would take another build's facts (another OS release) gathered within the hour. The ansible
    provisioner's environment must keep facts in memory, as Ansible itself reads that setting."""
    template = (PACKER_DIR / "gpuforge.pkr.hcl").read_text()
    block = template[template.index('provisioner "ansible"') :]
    block = block[block.index("ansible_env_vars") : block.index("]", block.index("ansible_env_vars"))]
    env_vars = dict(item.split("=", 1) for item in re.findall(r'"([A-Z_]+=[^"]*)"', block))
    env_vars["ANSIBLE_CONFIG"] = str(REPO / "ansible.cfg")
    dump = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-config")), "dump", "--only-changed"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env={**os.environ, **env_vars},
    ).stdout
    memory = r"^CACHE_PLUGIN\(env: ANSIBLE_CACHE_PLUGIN\) = ansible\.builtin\.memory$"
    assert re.search(memory, dump, re.M), dump


@needs_packer
@pytest.mark.skipif(
    not (REPO / "playbooks" / "bake.yml").is_file(), reason="playbooks/bake.yml is not in the checkout yet"
)
def test_builder_is_reached_through_session_manager_or_a_stated_cidr(staged: Path, tmp_path: Path) -> None:
    """Session Manager is the default and needs the builder profile (Packer's own check); without it, SSH is
    open only to the CIDRs given, and no CIDR is refused instead of becoming Packer's 0.0.0.0/0."""
    no_profile = _validate(staged, tmp_path, iam_instance_profile=None)
    assert no_profile.returncode != 0
    assert "session_manager connectivity requires a valid instance profile" in no_profile.stdout
    no_cidr = _validate(staged, tmp_path, ssh_interface="private_ip", iam_instance_profile=None)
    assert no_cidr.returncode != 0
    refusal = "set-temporary_security_group_source_cidrs-when-ssh_interface-is-not-session_manager"
    assert refusal in no_cidr.stdout
    cidr = _validate(
        staged,
        tmp_path,
        ssh_interface="private_ip",
        temporary_security_group_source_cidrs=["203.0.113.7/32"],
        iam_instance_profile=None,
    )
    assert cidr.returncode == 0, cidr.stdout + cidr.stderr


def test_amazon_ebs_source_never_opens_ssh_to_the_internet() -> None:
    """The source takes the interface and the CIDRs from variables whose defaults are Session Manager and
    nothing, and the bake volume keeps the base snapshot's size unless a size is asked for."""
    source = _amazon_ebs_source((PACKER_DIR / "gpuforge.pkr.hcl").read_text())
    assert re.search(r"^  ssh_interface\s+= var.ssh_interface$", source, re.M)
    assert "temporary_security_group_source_cidrs" in source
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))
    assert "0.0.0.0/0" not in code
    variables = (PACKER_DIR / "variables.pkr.hcl").read_text()
    assert re.search(r'variable "ssh_interface" \{[^}]*default\s+= "session_manager"', variables)
    assert re.search(r'variable "root_volume_size_gib" \{[^}]*default\s+= 0\n', variables)
    assert re.search(r"volume_size\s+= var.root_volume_size_gib == 0 \? null", source)


def test_neither_staging_gives_packer_a_region_copy(tmp_path: Path) -> None:
    """gpuforge copies the finished image itself (gpuforge.ami.images.copy_image): Packer's copies, and the
    intermediary encrypt_boot makes, leave snapshots the pipeline policy cannot tag or delete (issue 34)."""
    for modern in (True, False):
        staged = stage_templates(PACKER_DIR, tmp_path / str(modern), modern=modern)
        source = _amazon_ebs_source((staged / "gpuforge.pkr.hcl").read_text())
        assert not re.search(r"^\s*(ami_regions|encrypt_boot|region_kms_key_ids)\s*=", source, re.M)
    assert "ami_regions" not in (PACKER_DIR / "variables.pkr.hcl").read_text()
