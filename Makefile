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
APT_PACKAGES := debootstrap systemd-container iproute2 openssh-client git gnupg curl gcc packer prometheus shellcheck

PY_SOURCES := scripts tests molecule bench plugins

.PHONY: help setup demo test lint pytest molecule lab-down clean

help:
	@echo "make demo   - set up, start the local lab ($(DEMO_NODES) hosts + emulated EC2) and run site.yml on it"
	@echo "make test   - set up, then run every check: lint, pytest, molecule"
	@echo "make lint | pytest | molecule | lab-down"

setup: $(STAMPS)/apt $(STAMPS)/venv

$(STAMPS)/apt:
	@mkdir -p $(STAMPS)
	# Packages must not start their services on the control host (prometheus would).
	printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 0755 /usr/sbin/policy-rc.d
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(APT_PACKAGES) >/dev/null
	rm -f /usr/sbin/policy-rc.d
	touch $@

$(STAMPS)/venv: pyproject.toml requirements/constraints.txt
	@mkdir -p $(STAMPS)
	test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -c requirements/constraints.txt -e '.[dev]'
	touch $@

demo: setup
	gpuforge lab down --name $(DEMO_LAB)
	gpuforge lab up --name $(DEMO_LAB) --nodes $(DEMO_NODES) --moto-port $(DEMO_MOTO_PORT)
	# The lab cannot reach NVIDIA's repositories: molecule/nvidia/prepare.yml builds signed
	# TEST-FIXTURE stand-ins on the hosts and its vars point the NVIDIA roles at them (the EFA
	# and PyTorch stand-ins come from the lab's artifact server via group_vars/gpuforge_lab.yml).
	eval "$$(gpuforge lab env --name $(DEMO_LAB))" && \
	  ansible-inventory --graph --flush-cache && \
	  ansible all -m ansible.builtin.ping && \
	  ansible-playbook molecule/nvidia/prepare.yml && \
	  ansible-playbook site.yml -e @molecule/nvidia/vars/fixtures.yml
	@echo "The lab stays up: explore with 'eval \"\$$(gpuforge lab env --name $(DEMO_LAB))\"'; remove it with 'make lab-down'."

test: setup lint pytest molecule

lint: setup
	ruff check $(PY_SOURCES)
	ruff format --check $(PY_SOURCES)
	mypy
	yamllint -s .
	ansible-lint
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
	gpuforge lab down --name $(DEMO_LAB)

clean: lab-down
	rm -rf $(VENV) .cache
