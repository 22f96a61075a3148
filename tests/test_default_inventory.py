"""The checkout's default inventory (ansible.cfg): the ec2_fleet plugin, and a failure when it cannot be read.

A scheduled `ansible-playbook site.yml` whose inventory cannot be read (no credentials, no route to
EC2) must fail, not end with "no hosts matched" and exit status 0 as if the fleet were configured.
No AWS here: credentials are taken away and every endpoint points at a closed loopback port.
"""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuforge_lab.moto import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _config() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "ansible.cfg")
    return cfg


def _no_aws_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This process's environment without AWS access: no credentials, no IMDS, a closed endpoint."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "ANSIBLE_"))}
    closed = f"http://127.0.0.1:{free_port()}"
    return {
        **env,
        "PATH": f"{BIN}:{env.get('PATH', '')}",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"),
        "AWS_ENDPOINT_URL": closed,
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_REGION": "us-east-1",
        # A cache of its own: a warm one (an earlier lab run) would answer without AWS.
        "ANSIBLE_INVENTORY_CACHE_CONNECTION": str(tmp_path / "inventory-cache"),
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(tmp_path / "facts"),
        "ANSIBLE_FORCE_COLOR": "0",
        **extra,
    }


def _list_hosts(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "site.yml", "--list-hosts"],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env=env,
        timeout=300,
    )


def test_the_default_inventory_is_the_ec2_fleet_plugin() -> None:
    cfg = _config()
    assert cfg["defaults"]["inventory"] == "./inventory/ec2_fleet.yml"
    assert (REPO / "inventory/ec2_fleet.yml").is_file()
    assert cfg["inventory"].getboolean("any_unparsed_is_failed")
    assert cfg["inventory"].getboolean("unparsed_is_failed")


def test_site_yml_without_credentials_fails_naming_the_cause(tmp_path: Path) -> None:
    """No credentials: non-zero, the plugin's one-line cause and Ansible's verdict on the source."""
    run = _list_hosts(_no_aws_env(tmp_path))
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    assert "gpuforge.gpu.ec2_fleet: no AWS credentials" in out, out[-3000:]
    assert "Completely failed to parse inventory source" in out and "ec2_fleet.yml" in out, out[-3000:]
    assert "Traceback" not in out


def test_site_yml_with_an_unreachable_endpoint_fails_naming_it(tmp_path: Path) -> None:
    """Credentials but nothing listening at the endpoint: non-zero, the endpoint named."""
    env = _no_aws_env(tmp_path, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    run = _list_hosts(env)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    assert env["AWS_ENDPOINT_URL"] in out, out[-3000:]
    assert "Completely failed to parse inventory source" in out, out[-3000:]


@pytest.mark.parametrize("source", ["inventory/ec2_fleet.yml", "inventory/aws_ec2.yml"])
def test_any_named_inventory_that_cannot_be_read_fails(tmp_path: Path, source: str) -> None:
    """With -i as well: one unreadable source among several fails the run (any_unparsed_is_failed)."""
    local = tmp_path / "local.ini"
    local.write_text("[local]\nlocalhost ansible_connection=local\n")
    env = _no_aws_env(tmp_path)
    run = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(local), "-i", source, "site.yml", "--list-hosts"],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    assert f"Completely failed to parse inventory source {REPO / source}" in out, out[-3000:]
