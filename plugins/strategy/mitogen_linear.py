"""The `mitogen_linear` strategy, found through this repository's ansible.cfg (strategy_plugins).

Opt-in: `pip install 'gpuforge[mitogen]'`, then `ANSIBLE_STRATEGY=mitogen_linear ansible-playbook
site.yml` (figures in docs/performance.md). mitogen ships this plugin inside its package, whose
path depends on the virtualenv; importing it here keeps ansible.cfg free of that path. The class
is loaded under its canonical module name, as mitogen's own proxy module does, so Ansible's
plugin loader does not create a second copy of mitogen's types.
"""

from ansible_mitogen.plugins.strategy.mitogen_linear import StrategyModule

DOCUMENTATION = r"""
name: mitogen_linear
author: gpuforge
short_description: Ansible's linear strategy over mitogen connections (opt-in)
description:
  - Re-exports mitogen's own mitogen_linear strategy, so that ansible.cfg names this collection's
    plugins/strategy instead of a path inside the virtualenv.
  - Needs the mitogen Python package (pip install 'gpuforge[mitogen]').
"""

__all__ = ["StrategyModule"]
