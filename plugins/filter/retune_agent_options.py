"""Filter sglang_ops.fleet.retune_agent_options: every option a request to the host agent carries."""

from __future__ import annotations

DOCUMENTATION = r"""
name: retune_agent_options
author: sglang_ops.fleet maintainers
version_added: "0.2.0"
short_description: Every option a request to the host agent carries, from the retune's option table
description:
  - The host agent requires every option an operation reads (tool paths, timeouts, state directories, poll
    interval) and carries no fallbacks of its own. This filter gives them all, with the defaults of the retune's
    option table (the same the M(sglang_ops.fleet.retune) action sends), overridden by the keys of its input.
  - For a task that runs M(sglang_ops.fleet.retune_phase) directly, as C(playbooks/status.yml) does.
positional: _input
options:
  _input:
    description:
      - The options to set (for example the role's C(sglang_retune_*) values); the others take the table's defaults.
    type: dict
    required: true
"""

EXAMPLES = r"""
- name: Inspect the running instances
  sglang_ops.fleet.retune_phase:
    op: inspect
    instances: "{{ sglang_status_resolved.instances }}"
    options: "{{ {'http_timeout': sglang_retune_http_timeout} | sglang_ops.fleet.retune_agent_options }}"
"""

RETURN = r"""
_value:
  description: The agent options by name (for example C(nvidia_smi), C(secrets_file), C(state_dir), C(poll_interval)).
  type: dict
"""

from collections.abc import Mapping  # noqa: E402
from typing import Any  # noqa: E402

from ansible.errors import AnsibleFilterError  # noqa: E402

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.options import agent_options  # noqa: E402


def retune_agent_options(given: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(given, Mapping):
        raise AnsibleFilterError(f"retune_agent_options expects a mapping, got {type(given).__name__}")
    known = agent_options({})
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise AnsibleFilterError(f"retune_agent_options: unknown option(s) {unknown}; known: {sorted(known)}")
    return agent_options(dict(given))


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"retune_agent_options": retune_agent_options}
