# gpuforge developer entry points. `make demo` and `make test` set everything up on a fresh
# Debian 12 machine as root (apt packages, the Python venv) before they run.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV := .venv
STAMPS := .cache/stamps
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export PIP_DISABLE_PIP_VERSION_CHECK := 1

DEMO_LAB ?= demo
DEMO_NODES ?= 3
DEMO_MOTO_PORT ?= 5100

# What the control host needs: the lab (debootstrap, systemd-nspawn, iproute2, ssh), Packer
# for `packer validate` and the local bake, promtool for the alert-rule tests, gpg for the
# signed-download tests, gcc for the stand-in plugin in the EFA fixture, git for ansible-pull,
# shellcheck for the shell scripts we ship.
POLICY_RC_D ?= /usr/sbin/policy-rc.d
APT_GET ?= apt-get
APT_PACKAGES := debootstrap systemd-container iproute2 openssh-client git gnupg curl gcc packer prometheus shellcheck

PY_SOURCES := scripts lab tests molecule bench plugins

.PHONY: help setup lab-rootfs demo test unit lint pytest molecule lab-down clean

help:
	@echo "make demo   - set up, start the local lab ($(DEMO_NODES) hosts + emulated EC2) and run site.yml on it"
	@echo "make test   - set up, then run every check (lint, pytest, molecule) side by side, with a timing table"
	@echo "make unit   - set up, then the unit layer alone (no lab, no playbook; about a minute)"
	@echo "make lint | pytest | molecule | lab-down"

setup: $(STAMPS)/apt $(STAMPS)/venv $(STAMPS)/sanity-wheels

$(STAMPS)/apt:
	@mkdir -p $(STAMPS)
	# Packages must not start their services on the control host (prometheus would), so a deny-all
	# policy-rc.d is in place while apt-get runs. One that was there before is kept aside (in
	# $(STAMPS), not next to it) and put back afterwards, also when apt-get fails or is interrupted;
	# otherwise ours is removed. tests/test_makefile.py runs this recipe on temporary paths.
	saved="$(STAMPS)/policy-rc.d.saved"; had=no; \
	if [ -e "$(POLICY_RC_D)" ] || [ -L "$(POLICY_RC_D)" ]; then cp -a "$(POLICY_RC_D)" "$$saved"; had=yes; fi; \
	restore() { if [ "$$had" = yes ]; then mv -f "$$saved" "$(POLICY_RC_D)"; else rm -f "$(POLICY_RC_D)"; fi; }; \
	trap restore EXIT; trap 'exit 130' INT TERM; \
	rm -f "$(POLICY_RC_D)"; printf '#!/bin/sh\nexit 101\n' > "$(POLICY_RC_D)"; chmod 0755 "$(POLICY_RC_D)"; \
	$(APT_GET) update -qq; \
	DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq --no-install-recommends $(APT_PACKAGES) >/dev/null
	touch $@

$(STAMPS)/venv: pyproject.toml lab/pyproject.toml requirements/constraints.txt
	@mkdir -p $(STAMPS)
	test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	# --no-compile: byte-compiling every installed file (the ansible package alone bundles thousands
	# of collection modules) doubled the install's time; Python compiles what is imported, once.
	# ./lab is the checkout's test doubles (gpuforge-lab: the lab, the artifact server, bench helpers), a
	# project of its own so that the gpuforge wheel carries only the product.
	$(VENV)/bin/pip install -q --no-compile -c requirements/constraints.txt -e '.[dev]' -e ./lab
	touch $@

# What ansible-test's sanity virtualenvs install (its pinned requirements and the pip it bootstraps),
# downloaded once into .cache/ansible-test/wheels, so that `make lint` runs ansible-test offline
# (scripts/ci/sanity.py). Again whenever the venv (and so ansible-core's pins) is rebuilt.
$(STAMPS)/sanity-wheels: $(STAMPS)/venv
	$(VENV)/bin/python scripts/ci/sanity.py wheels
	touch $@

# The Debian tree every lab host boots from (cached under GPUFORGE_CACHE_DIR, built once per
# recipe; `gpuforge-lab up` builds it otherwise). Standard library only, so `make -j2 setup lab-rootfs`
# builds it while pip installs the virtualenv.
lab-rootfs: $(STAMPS)/apt
	PYTHONPATH=scripts:lab python3 -m gpuforge_lab.rootfs

demo: setup lab-rootfs
	gpuforge-lab down --name $(DEMO_LAB)
	gpuforge-lab up --name $(DEMO_LAB) --nodes $(DEMO_NODES) --moto-port $(DEMO_MOTO_PORT)
	# The lab cannot reach NVIDIA's repositories: tests/fixtures/nvidia/prepare.yml builds signed
	# TEST-FIXTURE stand-ins on the hosts, and the lab group's group_vars (inventory/group_vars/
	# gpuforge_lab/) point the NVIDIA roles at them and the EFA and PyTorch roles at the lab's
	# artifact server. So site.yml runs on the lab as it runs on a fleet, with no extra variables.
	lab_env=$$(gpuforge-lab env --name $(DEMO_LAB)) && eval "$$lab_env" && \
	  ansible-inventory --graph --flush-cache && \
	  ansible all -m ansible.builtin.ping && \
	  ansible-playbook tests/fixtures/nvidia/prepare.yml && \
	  ansible-playbook site.yml
	@echo "The lab stays up: explore it with the commands in docs/lab.md (After make demo); remove it with 'make lab-down'."

# Lint, the pytest groups and the Molecule scenarios run side by side (most of their time is
# spent waiting on lab hosts), then a table of phase timings; see scripts/ci/testrun.py.
# GPUFORGE_CI_JOBS caps how many phases run at once. `make pytest` / `make molecule` stay serial.
test:
	python3 scripts/ci/testrun.py

# The unit layer (scripts/ci/schedule.py: the tests the committed timings record as fast and
# playbook-free), one shard per CPU, as `make test` starts it first.
unit: setup
	python3 scripts/ci/testrun.py --skip-setup --only "pytest unit-"

lint: setup
	ruff check $(PY_SOURCES)
	ruff format --check $(PY_SOURCES)
	mypy
	yamllint -s .
	# Its syntax checks need no hosts; the default inventory (the EC2 fleet) fails without AWS credentials,
	# as it must for a real run (ansible.cfg: unparsed_is_failed). An empty INI file, not "localhost,":
	# ANSIBLE_INVENTORY is a comma-separated path list, so that value adds "" (this directory) as an
	# inventory, and every syntax check walked the whole tree through the collection link.
	mkdir -p .cache && : > .cache/lint-inventory.ini
	ANSIBLE_INVENTORY=$(CURDIR)/.cache/lint-inventory.ini ansible-lint
	# ansible-test sanity, the check Galaxy collections run, on the collection as ansible-galaxy builds it,
	# offline from the wheels setup downloaded (scripts/ci/sanity.py; README: As an Ansible collection).
	python scripts/ci/sanity.py run
	packer fmt -check packer/
	# GitHub Actions: pinned SHAs, no credential persistence, no expressions in scripts.
	zizmor --offline --persona=auditor .github/workflows/

pytest: setup
	pytest

molecule: setup
	for scenario in $$(ls molecule | grep -v '^_'); do \
	  test -f molecule/$$scenario/molecule.yml || continue; \
	  echo "== molecule test -s $$scenario"; \
	  molecule test -s $$scenario; \
	done

lab-down:
	gpuforge-lab down --name $(DEMO_LAB)

clean: lab-down
	rm -rf $(VENV) .cache
