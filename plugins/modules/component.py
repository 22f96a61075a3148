#!/usr/bin/python
# The documentation of the action plugin gpuforge.gpu.component (plugins/action/component.py), which runs
# on the controller; this file is what ansible-doc and ansible-test read for it.

from __future__ import annotations

DOCUMENTATION = r"""
module: component
author: gpuforge (@gpuforge)
short_description: Decide about one component by the version policy and record it in the node record
description:
  - "The one writer of the node record, the fact C(gpuforge_reality) (docs/architecture.md#reality): one
    entry per component (action, installed, pinned, floor, version, source, reason), which
    roles/gpuforge_common/tasks/manifest.yml writes to the node's manifest.json."
  - "Adopts an installed release at or above the floor that is compatible, keeps it at the pin, installs the
    pin otherwise, and fails with a message naming both releases where the pin is older than the installed
    release, unless C(gpuforge_common_allow_downgrade) is true (then the pin is installed: a downgrade).
    The decision is plugins/plugin_utils/policy.py, which the CLI imports too."
  - Reads the previous manifest (C(gpuforge_previous_manifest)) and the downgrade opt-in
    (C(gpuforge_common_allow_downgrade)) from the play, both published by the gpuforge_common role.
  - Prints one line about the decision. Never changes the host.
  - Roles read the record as C(ansible_facts.gpuforge_reality). Never set C(gpuforge_reality) with set_fact,
    which makes a second, top-level variable of that name that no role reads.
  - Call it once per component on the host it decides for. A loop, C(run_once) or C(delegate_to) is
    refused, since Ansible would keep only the last item's record or give one host's record to others.
version_added: 1.0.0
options:
  begin:
    description:
      - Start an empty record (gpuforge_common does, once per run; facts outlive a run in the fact cache).
    type: bool
    default: false
  component:
    description: The component's name in versions.yml.
    type: str
  installed:
    description: The upstream release the host has now (empty when none).
    type: str
    default: ""
  pin:
    description: The release the role installs (required with I(component)).
    type: str
  floor:
    description: The oldest release that is adopted (required with I(component)).
    type: str
  compatible:
    description:
      - Whether the installed release works with the rest of the host; an incompatible one is never adopted.
    type: bool
    default: true
  incompatible_reason:
    description: Why it is not compatible (recorded and printed).
    type: str
    default: ""
  ours:
    description:
      - The release gpuforge itself put in place and finds there (its own build under its own prefix, the
        exporter it pins exactly); empty when none.
      - Where the policy would install the pin over I(installed) and this is the pin, the pin is already
        there. It is recorded as kept, as gpuforge's.
    type: str
    default: ""
  installable:
    description:
      - Whether the role can install the pin on this host. Where it cannot, nothing is recorded for the
        component, so the manifest never lists a release the node lacks.
    type: bool
    default: true
  details:
    description:
      - Fields added to the entry whatever the decision (a digest, why a release found was not offered).
    type: dict
    default: {}
  kept_details:
    description: Fields added to the entry only when the installed release stays (where it lives).
    type: dict
    default: {}
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
  platform:
    support: full
    platforms: all
notes:
  - An action plugin. It runs on the controller and needs no connection to the host.
"""

EXAMPLES = r"""
- name: Decide whether to adopt the installed NCCL or install the pin
  gpuforge.gpu.component:
    component: nccl
    installed: "{{ _nccl_installed }}"
    pin: "{{ nccl_version }}"
    floor: "{{ nccl_floor }}"
    compatible: "{{ _nccl_ofi_range.outside | length == 0 }}"
    incompatible_reason: "{{ _nccl_ofi_range.outside }}"

- name: Install the pin where the policy says so
  ansible.builtin.apt:
    name: "libnccl2={{ nccl_package_version }}"
  when: ansible_facts.gpuforge_reality.nccl.action in ['install', 'downgrade']
"""

RETURN = r"""
msg:
  description: The one line about the decision, or the refusal's message.
  returned: always
  type: str
  sample: "nccl: adopt 2.27.7 (base_image); installed before: 2.27.7, floor 2.18.3, pin 2.30.7"
outcome:
  description:
    - C(installed) (the installed release stays), C(ours) (gpuforge's own earlier install of the pin stays),
      C(install) (the role installs the pin) or C(none) (the pin cannot be installed here; nothing recorded).
  returned: when a component was decided
  type: str
  sample: installed
ansible_facts:
  description: The node record with the component's entry added or replaced.
  returned: success
  type: dict
  contains:
    gpuforge_reality:
      description: Component name -> action, installed, pinned, floor, version, source, reason (and details).
      type: dict
      returned: success
"""
