"""The `mitogen_linear` strategy, found through this repository's ansible.cfg (strategy_plugins).

Opt-in: `pip install 'gpuforge[mitogen]'`, then `ANSIBLE_STRATEGY=mitogen_linear ansible-playbook
site.yml` (figures in docs/performance.md). mitogen ships this plugin inside its package, whose
path depends on the virtualenv; importing it here keeps ansible.cfg free of that path. The class
is loaded under its canonical module name, as mitogen's own proxy module does, so Ansible's
plugin loader does not create a second copy of mitogen's types.

Without mitogen the plugin still loads (ansible-doc, the plugin list, a collection install that
never uses it); only a play that picks this strategy fails, saying what to install.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: mitogen_linear
author: gpuforge (@gpuforge)
short_description: Ansible's linear strategy over mitogen connections (opt-in)
description:
  - Re-exports mitogen's own mitogen_linear strategy, so that ansible.cfg names this collection's
    plugins/strategy instead of a path inside the virtualenv.
  - Needs the mitogen Python package (pip install 'gpuforge[mitogen]'); without it a play that
    uses this strategy fails before its first task.
requirements:
  - mitogen (pip install 'gpuforge[mitogen]')
"""

from typing import Any

from ansible.errors import AnsibleError
from ansible.plugins.strategy import StrategyBase

try:
    from ansible_mitogen.plugins.strategy.mitogen_linear import StrategyModule
except (ImportError, AnsibleError) as exc:
    # AnsibleError: a mitogen that refuses this ansible-core version (it checks on import).
    _MITOGEN_MISSING: Exception | None = exc
else:
    _MITOGEN_MISSING = None

if _MITOGEN_MISSING is not None:
    _MISSING_MESSAGE = (
        "the gpuforge.gpu.mitogen_linear strategy needs the mitogen package, which this Python cannot "
        f"import ({_MITOGEN_MISSING}): pip install 'gpuforge[mitogen]', or run without "
        "ANSIBLE_STRATEGY=mitogen_linear"
    )

    # A subclass of StrategyBase, as Ansible's strategy loader requires of what it loads, so that
    # choosing the strategy reaches this message instead of "invalid play strategy".
    class StrategyModule(StrategyBase):  # type: ignore[no-redef]
        """Stands in for mitogen's strategy when mitogen is not installed: refuses to run."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise AnsibleError(_MISSING_MESSAGE)


__all__ = ["StrategyModule"]
