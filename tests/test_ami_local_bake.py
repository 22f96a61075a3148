"""`gpuforge-lab bake --save-image` end to end, then a host booted from the image.

The real packer (Debian's 1.6.6) runs the real provisioners (playbooks/bake.yml with the install
tag, then packer/scripts/sanitize.sh) over SSH against a real lab host, with no AWS at all. The
baked host is kept as a lab image (the lab's AMI). testinfra inspects that image through chroot
(sanitized, stack installed, modes), and a new lab boots from it: the host must come up with an
identity of its own and need nothing more from the install phase.

The bake is this tree's shared golden image (tests/goldenlab.py): baked once per tree by whichever
lab module asks first (test_fleet_lab and test_partial_failure_lab boot their hosts from it too),
its output and the builder's identity recorded with it, so every assertion here reads that bake.

Needs root, systemd-nspawn (the lab) and the packer binary; CI installs them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import testinfra
import yaml
from ansible_collections.gpuforge.gpu.plugins.plugin_utils.fast_path import INSTALL_REVISION

import goldenlab
import labtools
from gpuforge import versions
from gpuforge.ami import manifest as packer_manifest
from gpuforge_lab import images as lab_images
from labtools import LAB_MARKS, REPO, gpuforge_lab, lab, on, playbook, recap

GOLDEN_LAB = labtools.lab_name("golden")

pytestmark = [
    *LAB_MARKS,
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("packer") is None, reason="packer binary absent (apt-get install packer)"
    ),
]


@pytest.fixture(scope="module")
def baked() -> dict[str, Any]:
    """This tree's golden lab image and the record of its bake (tests/goldenlab.py).

    The bake is shared: whichever lab module asks first prepares the fixtures on a builder lab,
    remembers the builder's identity, bakes it and keeps it as the image; the others wait for it.
    The builder lab is gone by now; its artifact fixtures (the keys and hashes the image was
    installed with) are kept with the record, for the runs below on hosts booted from the image.
    """
    return goldenlab.shared_golden_image()


@pytest.fixture(scope="module")
def builder(baked: dict[str, Any]) -> dict[str, Any]:
    """What the runs below took from the builder lab's environment: its artifact fixtures."""
    return {"env": {"GPUFORGE_LAB_ARTIFACTS": baked["artifacts"]}}


def test_local_bake_runs_both_provisioners_and_keeps_the_image(baked: dict[str, Any]) -> None:
    # Progress was streamed while packer ran, from both provisioners.
    assert "PLAY RECAP" in baked["stderr"] and "sanitize: cleaned" in baked["stderr"]
    digest = versions.load().digest
    (artifact,) = packer_manifest.last_run(baked["run_dir"] / "manifest.json")
    assert (artifact.name, artifact.builder_type, artifact.images) == ("lab", "null", {})
    assert artifact.custom_data["versions_hash"] == digest

    listed = json.loads(gpuforge_lab("image", "list", "--json").stdout)
    (info,) = [i for i in listed if i["name"] == baked["image"]]
    assert (info["source_lab"], info["source_host"]) == (baked["builder_lab"], baked["builder_host"])
    assert info["versions_hash"] == digest and info["sanitized"] is True
    # The builder is spent, as Packer's is: saving the image stopped it (its status then, recorded).
    status = baked["builder_status"]
    assert status["name"] == baked["builder_lab"] and status["hosts"][0]["running"] is False


# The image, checked by testinfra through chroot: what sanitize.sh and the bake promise.


@pytest.fixture(scope="module")
def image(baked: dict[str, Any]) -> Any:
    return testinfra.get_host(str(lab_images.rootfs(baked["image"])), connection="chroot")


@pytest.mark.parametrize(
    "pattern",
    [
        "/etc/ssh/ssh_host_*",
        "/root/.ssh/authorized_keys*",
        "/home/*/.ssh/authorized_keys*",
        "/root/.bash_history",
        "/home/*/.bash_history",
        "/var/lib/dbus/machine-id",
    ],
)
def test_image_holds_no_host_identity_or_login_keys(image: Any, pattern: str) -> None:
    """Nothing that identifies the builder or let anyone log in to it is left."""
    assert image.run(f"ls -d {pattern}").stdout.strip() == ""


def test_image_machine_id_is_empty_so_each_host_makes_its_own(image: Any) -> None:
    machine_id = image.file("/etc/machine-id")
    assert machine_id.exists and machine_id.content_string == ""


def test_image_holds_no_private_key_material(image: Any) -> None:
    """No PEM, OpenSSH or PGP private key in the places configuration and keys live."""
    found = image.run(
        "grep -rlI --exclude-dir=site-packages -e 'PRIVATE KEY-----' -e 'BEGIN PGP PRIVATE KEY BLOCK' "
        "/etc /root /home /srv /usr/local /opt /var/lib /var/cache 2>/dev/null || true"
    ).stdout.split()
    assert found == []


def test_image_records_the_manifest_it_was_built_from(image: Any) -> None:
    manifest = image.file("/etc/gpuforge/manifest.json")
    assert (manifest.user, manifest.group, manifest.mode) == ("root", "root", 0o644)
    assert json.loads(manifest.content_string)["versions_hash"] == versions.load().digest


@pytest.mark.parametrize(
    ("path", "mode"),
    [
        ("/etc/sudoers.d/90-gpuforge-lab", 0o440),
        ("/var/cache/gpuforge/gnupg", 0o700),
        ("/etc/apt/keyrings/nvidia-cuda.asc", 0o644),
        ("/etc/sysctl.d/99-gpuforge-efa.conf", 0o644),
        ("/etc/security/limits.d/99-gpuforge-efa.conf", 0o644),
    ],
)
def test_image_keys_and_configs_have_safe_modes(image: Any, path: str, mode: int) -> None:
    target = image.file(path)
    assert target.exists
    assert (target.user, target.mode) == ("root", mode)


def test_image_has_the_pinned_driver_held(image: Any) -> None:
    # The lab's stand-in packaging of the production pin (nvidia_driver_debian_package_version).
    pin = versions.load().version("nvidia_driver") + "-1"
    assert image.package("nvidia-smi").version == pin
    assert "nvidia-smi" in image.run("apt-mark showhold").stdout.split()


def test_image_carries_slurm_with_its_daemons_off(image: Any) -> None:
    """munge and both Slurm daemons are baked (a golden node's configure phase only configures
    them), none enabled before a node is configured, and no munge key every node would share."""
    for package in ("munge", "slurm-client", "slurmctld", "slurmd"):
        assert image.package(package).is_installed, package
    enabled = image.run("ls /etc/systemd/system/multi-user.target.wants/").stdout.split()
    assert {"munge.service", "slurmctld.service", "slurmd.service"}.isdisjoint(enabled), enabled
    assert not image.file("/etc/munge/munge.key").exists


# A host booted from the image: the golden-image promise.


@pytest.fixture(scope="module")
def golden(baked: dict[str, Any]) -> Iterator[dict[str, Any]]:
    with lab(GOLDEN_LAB, 1, ec2=False, image=baked["image"]) as info:
        yield info


def test_golden_host_boots_with_an_identity_of_its_own(golden: dict[str, Any], baked: dict[str, Any]) -> None:
    host = golden["hosts"][0]["name"]
    machine_id, _, host_key, *_ = on(
        GOLDEN_LAB, host, "cat /etc/machine-id /etc/ssh/ssh_host_ed25519_key.pub"
    ).split()
    assert len(machine_id) == 32 and machine_id != baked["machine_id"]
    assert host_key != baked["host_key"]
    assert on(GOLDEN_LAB, host, "hostname").strip() == host
    assert json.loads(on(GOLDEN_LAB, host, "cat /etc/gpuforge/manifest.json"))["versions_hash"] == (
        versions.load().digest
    )


def test_golden_host_needs_nothing_from_the_install_phase(
    golden: dict[str, Any], builder: dict[str, Any], baked: dict[str, Any]
) -> None:
    """bake.yml's install tag on a host from the image changes nothing: the image has it all."""
    node = golden["hosts"][0]
    run = playbook(
        {
            **golden["env"],
            "GPUFORGE_LAB_ARTIFACTS": builder["env"]["GPUFORGE_LAB_ARTIFACTS"],
            "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(Path(golden["state_file"]).parent / "facts"),
        },
        "-i",
        f"{node['ip']},",
        "playbooks/bake.yml",
        "--tags",
        "install",
        "-e",
        f"@{baked['lab_vars']}",
        # Every install task, not the golden fast path (tested below): the image really has it all.
        "-e",
        "gpuforge_full_install=true",
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:]
    assert recap(run.stdout)[node["ip"]]["changed"] == 0, _changed_tasks(run.stdout)


# The golden fast path (playbooks/bake.yml's first play): the one host of the golden lab under
# several inventory names, each with what makes the decision differ.
DECISION = re.compile(r'ok: \[(\w+)\] => \{\s*"msg": "gpuforge: (fast path|full install)[^:]*: ([^"]*)"')


def _aliases(golden: dict[str, Any], tmp: Path, names: dict[str, dict[str, Any]]) -> Path:
    """An inventory naming the golden host once per case, with the case's host variables."""
    ip = golden["hosts"][0]["ip"]
    inventory = tmp / "aliases.yml"
    inventory.write_text(
        yaml.safe_dump({"all": {"hosts": {n: {"ansible_host": ip, **v} for n, v in names.items()}}})
    )
    return inventory


def _alias_env(golden: dict[str, Any], builder: dict[str, Any]) -> dict[str, str]:
    """The golden lab's playbook environment for runs over an alias inventory of its host."""
    return {
        **golden["env"],
        "GPUFORGE_LAB_ARTIFACTS": builder["env"]["GPUFORGE_LAB_ARTIFACTS"],
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(Path(golden["state_file"]).parent / "facts"),
        # One JSON line per result, so each host's reason reads back whole.
        "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
    }


def _run_aliases(
    golden: dict[str, Any], builder: dict[str, Any], inventory: Path, *args: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, tuple[str, str]]]:
    run = playbook(
        _alias_env(golden, builder),
        "-i",
        str(inventory),
        "playbooks/bake.yml",
        *args,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:]
    return run, {host: (path, reason) for host, path, reason in DECISION.findall(run.stdout)}


def _installed_on(stdout: str) -> set[str]:
    """The hosts the install play ran tasks on."""
    play = stdout.split("PLAY [Bake the GPU software stack]", 1)[1].split("PLAY RECAP", 1)[0]
    return set(re.findall(r"^(?:ok|changed|skipping): \[(\w+)\]", play, re.MULTILINE))


def test_golden_host_skips_the_install_phase_after_one_check(
    golden: dict[str, Any], builder: dict[str, Any], tmp_path: Path
) -> None:
    """A host from the image, of a type it was baked for: the install play leaves it out."""
    manifest = json.loads(on(GOLDEN_LAB, golden["hosts"][0]["name"], "cat /etc/gpuforge/manifest.json"))
    assert manifest["completed"] == {
        "versions_hash": versions.load().digest,
        "targets": manifest["targets"],
        "install_revision": INSTALL_REVISION,
    }
    inventory = _aliases(golden, tmp_path, {"golden": {"gpuforge_instance_type": manifest["targets"][0]}})
    run, decisions = _run_aliases(golden, builder, inventory)
    assert decisions["golden"][0] == "fast path", decisions
    assert "skipping: no hosts matched" in run.stdout.split("PLAY [Bake the GPU software stack]", 1)[1]
    # The decision play only: the pins and manifest read, the node record started (gpuforge.gpu.component,
    # on the controller), one compare, the group, the reason.
    counts = recap(run.stdout)["golden"]
    assert counts["changed"] == 0 and counts["ok"] <= 13, counts


def test_golden_fast_path_decides_per_host_in_check_mode(
    golden: dict[str, Any], builder: dict[str, Any], tmp_path: Path
) -> None:
    """A changed pin, no manifest, a foreign instance type or gpuforge_full_install: the install play runs."""
    host = golden["hosts"][0]["name"]
    manifest = json.loads(on(GOLDEN_LAB, host, "cat /etc/gpuforge/manifest.json"))
    target = manifest["targets"][0]
    changed = yaml.safe_load((REPO / "versions.yml").read_text())
    changed["gpuforge_versions"]["pytorch"]["version"] = "99.0.0"
    (tmp_path / "versions.yml").write_text(yaml.safe_dump(changed))
    # A configuration directory without a manifest (check mode writes nothing into it).
    on(GOLDEN_LAB, host, "install -d -m 0755 /var/tmp/gpuforge-no-manifest")
    inventory = _aliases(
        golden,
        tmp_path,
        {
            "golden": {"gpuforge_instance_type": target},
            "asked_for": {"gpuforge_instance_type": target, "gpuforge_full_install": True},
            "pins_changed": {
                "gpuforge_instance_type": target,
                "gpuforge_common_versions_file": str(tmp_path / "versions.yml"),
            },
            "no_manifest": {
                "gpuforge_instance_type": target,
                "gpuforge_common_config_dir": "/var/tmp/gpuforge-no-manifest",
            },
            "foreign_type": {"gpuforge_instance_type": "c5n.large"},
        },
    )
    # Only gpuforge_common of the install play: enough to show which hosts it ran on.
    run, decisions = _run_aliases(golden, builder, inventory, "--check", "--tags", "gpuforge_common")
    assert {h: d[0] for h, d in decisions.items()} == {
        "golden": "fast path",
        "asked_for": "full install",
        "pins_changed": "full install",
        "no_manifest": "full install",
        "foreign_type": "full install",
    }
    assert decisions["asked_for"][1] == "full install asked for (gpuforge_full_install=true)"
    assert decisions["pins_changed"][1].startswith("pins changed: the node has ")
    assert decisions["no_manifest"][1].startswith("no readable /etc/gpuforge/manifest.json")
    assert decisions["foreign_type"][1].startswith("c5n.large is not among the image's targets")
    assert _installed_on(run.stdout) == {"asked_for", "pins_changed", "no_manifest", "foreign_type"}
    assert recap(run.stdout)["golden"]["changed"] == 0


def _changed_tasks(stdout: str) -> str:
    """The tasks that reported changed, each with its result line (the recap alone names none)."""
    found, task = [], ""
    for line in stdout.splitlines():
        if line.startswith("TASK ["):
            task = line.rstrip("* ")
        elif line.startswith("changed:"):
            found.append(f"{task}\n  {line}")
    return "\n".join(found) or stdout[-4000:]


def test_drift_check_finds_a_hand_changed_file_on_a_golden_host(
    golden: dict[str, Any], builder: dict[str, Any], baked: dict[str, Any], tmp_path: Path
) -> None:
    """The fast path trusts the manifest; the deep drift check (-e gpuforge_drift_install=true) still
    compares a golden host's install roles (the default check says it did not: test_drift_files)."""
    host = golden["hosts"][0]["name"]
    manifest = json.loads(on(GOLDEN_LAB, host, "cat /etc/gpuforge/manifest.json"))
    sysctl = "/etc/sysctl.d/99-gpuforge-efa.conf"
    # The lab's fixture variables in the inventory itself: the drift check's own check-mode run of
    # the roles reads the same inventory (extra vars do not reach it).
    lab_vars = yaml.safe_load(baked["lab_vars"].read_text())
    inventory = _aliases(
        golden, tmp_path, {"golden": {"gpuforge_instance_type": manifest["targets"][0], **lab_vars}}
    )
    on(GOLDEN_LAB, host, f"cp -p {sysctl} /var/tmp/efa-sysctl.orig && echo '# by hand' >> {sysctl}")
    try:
        run = playbook(
            _alias_env(golden, builder),
            "-i",
            str(inventory),
            "playbooks/drift.yml",
            "-e",
            "gpuforge_drift_fail=false",
            "-e",
            "gpuforge_drift_install=true",
            "-e",
            json.dumps({"gpuforge_drift_playbooks": ["gpuforge.gpu.bake"]}),
            timeout=900,
        )
    finally:
        on(GOLDEN_LAB, host, f"mv /var/tmp/efa-sysctl.orig {sysctl}")
    assert run.returncode == 0, run.stdout[-4000:]
    assert "up to date with versions.yml" in run.stdout  # the manifest matches: a golden host
    # (hardware.json may differ too: the earlier runs here named no instance type.)
    reports = re.findall(r'"msg": "([^"]*managed file[^"]*)"', run.stdout)
    assert any(sysctl in r and r.startswith("DRIFT: ") for r in reports), reports or run.stdout[-4000:]
