"""Ansible lookup gpuforge.gpu.data_file: where this collection's shared data files are.

versions.yml and data/instance_types.yml live once, at the collection's root (the repository root
in a checkout, the installed collection's directory otherwise). Roles ask this lookup for them
instead of walking up from their own role_path, so a role never reaches outside the collection
and an installed collection reads its own copy. The Python CLI reads the same files
(gpuforge.paths), and tests/test_repository.py keeps both hashes equal.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: data_file
author: gpuforge (@gpuforge)
short_description: Path of one of the gpuforge collection's shared data files
description:
  - Returns the absolute path of a data file shipped at the root of the gpuforge.gpu collection,
    so that roles load the collection's single copy wherever the collection is installed.
options:
  _terms:
    description: The data file, by name.
    type: list
    elements: str
    required: true
    choices:
      - versions
      - instance_types
      - aws_ofi_nccl
"""

EXAMPLES = r"""
- name: Load the versions manifest
  ansible.builtin.include_vars:
    file: "{{ lookup('gpuforge.gpu.data_file', 'versions') }}"
"""

RETURN = r"""
_raw:
  description: The absolute path of each requested file.
  type: list
  elements: path
"""

from pathlib import Path
from typing import Any

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

# The collection root: plugins/lookup/data_file.py -> plugins/lookup -> plugins -> root.
_ROOT = Path(__file__).resolve().parents[2]
FILES = {
    "versions": Path("versions.yml"),
    "instance_types": Path("data/instance_types.yml"),
    "aws_ofi_nccl": Path("data/aws_ofi_nccl.yml"),
}


class LookupModule(LookupBase):
    def run(self, terms: list[Any], variables: dict[str, Any] | None = None, **kwargs: Any) -> list[str]:
        paths = []
        for term in terms:
            if term not in FILES:
                raise AnsibleLookupError(
                    f"gpuforge.gpu.data_file: unknown data file {term!r}; choose one of {', '.join(FILES)}"
                )
            path = _ROOT / FILES[term]
            if not path.is_file():
                raise AnsibleLookupError(f"gpuforge.gpu.data_file: {path} is missing from the collection")
            paths.append(str(path))
        return paths
