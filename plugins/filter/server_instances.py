"""Filter sglang_ops.fleet.server_instances: one host's variables to its resolved SGLang instances."""

from __future__ import annotations

DOCUMENTATION = r"""
name: server_instances
author: sglang_ops.fleet maintainers
version_added: "1.0.0"
short_description: Resolve the SGLang instances of one host from its variables
description:
  - Applies the instance layout (one instance per GPU by default, or C(sglang_server_instances)), merges the
    settings layers C(sglang_server_args) < C(sglang_server_host_args) < instance C(args) (C(null) removes a
    setting), validates everything against the host's SGLang version and returns each instance with its argv,
    environment and fingerprint.
  - Returns exactly what the M(sglang_ops.fleet.server_validate) action returns as C(instances), from the same
    function; use that action in plays, this filter where a template or C(set_fact) needs the data.
  - Any problem fails with one message listing every problem of the host, each naming the instance and the
    variable path to fix.
positional: _input, hostname
options:
  _input:
    description: The variables of one host, for example C(hostvars[inventory_hostname]).
    type: dict
    required: true
  hostname:
    description: The host's inventory name, used in messages.
    type: str
    required: true
"""

EXAMPLES = r"""
- name: Resolve this host's SGLang instances
  ansible.builtin.set_fact:
    sglang_server_instances_resolved: >-
      {{ hostvars[inventory_hostname] | sglang_ops.fleet.server_instances(inventory_hostname) }}
"""

RETURN = r"""
_value:
  description:
    - One mapping per instance with the keys name, unit, gpus, port, container, version, flag_table, args,
      args_unchecked, argv, env, warnings, fingerprint, http_host, health_url, self_sigkill_on_stop,
      expected_server_info, user and served_model_name (described in M(sglang_ops.fleet.server_validate)).
  type: list
  elements: dict
"""

from collections.abc import Mapping  # noqa: E402
from typing import Any  # noqa: E402

from ansible.errors import AnsibleFilterError  # noqa: E402
from ansible.utils.display import Display  # noqa: E402

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.checks import ServerArgsError  # noqa: E402
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.resolve import (  # noqa: E402
    HOST_VARIABLES,
    resolve_instances,
)

display = Display()


def server_instances(hostvars: Mapping[str, Any], hostname: str) -> list[dict[str, Any]]:
    if not isinstance(hostvars, Mapping):
        raise AnsibleFilterError(f"server_instances expects the variables of one host, got {type(hostvars).__name__}")
    # Only the collection's own variables are read; touching the rest would template all of them.
    wanted = {name: hostvars[name] for name in HOST_VARIABLES if name in hostvars}
    try:
        instances = resolve_instances(str(hostname), wanted)
    except ServerArgsError as exc:
        raise AnsibleFilterError(str(exc)) from exc
    for warning in dict.fromkeys(w for instance in instances for w in instance["warnings"]):
        display.warning(warning)
    return instances


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"server_instances": server_instances}
