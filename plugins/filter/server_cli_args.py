"""Filter sglang_ops.fleet.server_cli_args: SGLang settings to the argv words one version accepts."""

from __future__ import annotations

DOCUMENTATION = r"""
name: server_cli_args
author: sglang_ops.fleet maintainers
version_added: "1.0.0"
short_description: Render SGLang settings as launch_server argv words for one SGLang version
description:
  - Validates a mapping of SGLang settings (snake_case names as C(/server_info) reports them) against the
    flag table of one SGLang version and returns the argument words for C(python -m sglang.launch_server).
  - Flags come sorted by name, each in the full spelling that version accepts; never an abbreviation, never a
    deprecated alias. A setting renamed between versions is written under the name the version knows
    (C(mamba_scheduler_strategy) and C(mamba_radix_cache_strategy) both work on every supported version).
  - C(true) renders a bare switch, C(false) omits it (or renders C(--no-x) for flags that have that form),
    C(null) omits the flag, lists render as several words, mappings and JSON-typed flags as compact JSON.
  - A deprecated switch that stands for another setting (for example C(disable_piecewise_cuda_graph)) is
    rendered as that setting and a warning says so.
  - Any invalid setting fails the task with one message listing every problem and how to fix it.
positional: _input, version
options:
  _input:
    description: Settings, keyed by SGLang setting name.
    type: dict
    required: true
  version:
    description:
      - SGLang version whose flag table applies, for example V(0.5.23).
      - One of the versions the collection has a table for (0.5.9, 0.5.14, 0.5.18 to 0.5.23).
    type: str
    required: true
"""

EXAMPLES = r"""
- name: Show the flags a tuning set becomes on 0.5.9 and 0.5.23
  ansible.builtin.debug:
    msg:
      - "{{ tuning | sglang_ops.fleet.server_cli_args('0.5.9') }}"
      - "{{ tuning | sglang_ops.fleet.server_cli_args('0.5.23') }}"
  vars:
    tuning:
      mamba_scheduler_strategy: no_buffer
      max_running_requests: 128
      trust_remote_code: true
# 0.5.9:  ['--mamba-scheduler-strategy', 'no_buffer', '--max-running-requests', '128', '--trust-remote-code']
# 0.5.23: ['--mamba-radix-cache-strategy', 'no_buffer', '--max-running-requests', '128', '--trust-remote-code']
"""

RETURN = r"""
_value:
  description: Argument words, in order, without the interpreter and module.
  type: list
  elements: str
"""

from collections.abc import Mapping  # noqa: E402
from typing import Any  # noqa: E402

from ansible.errors import AnsibleFilterError  # noqa: E402
from ansible.utils.display import Display  # noqa: E402

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.checks import (  # noqa: E402
    ServerArgsError,
    validate_args,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.render import render_cli_args  # noqa: E402

display = Display()


def server_cli_args(args: Mapping[str, Any] | None, version: str) -> list[str]:
    try:
        normalized, warnings = validate_args(args, str(version), where="server_cli_args")
        words = render_cli_args(normalized, str(version))
    except ServerArgsError as exc:
        raise AnsibleFilterError(str(exc)) from exc
    for warning in warnings:
        display.warning(warning)
    return words


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"server_cli_args": server_cli_args}
