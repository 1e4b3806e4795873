#!/usr/bin/python
# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The observe phase of the tuning advisor, for every given instance of a host at once."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: advise_observe
short_description: Observe what SGLang instances of a host are doing (for the tuning advisor)
description:
  - Internal to the M(sglang_ops.fleet.advise) action plugin, which calls it once per host. Changes
    nothing.
  - For every instance - its C(/server_info) once, the startup lines of its current run from the
    unit's journal (the weights, Mamba cache and KV cache allocation lines), and its C(/metrics)
    every C(interval) of O(options) seconds for C(window) seconds (unless
    C(sample_metrics=false)); nvidia-smi's memory.used of every GPU at the same ticks.
  - On the host itself, or inside the Proxmox LXC containers that hold the instances (through
    C(pct exec)), all containers at once.
version_added: 0.1.0
author: sglang-fleet maintainers (@sglang-ops)
options:
  instances:
    description: The instances to observe (C(name), C(unit), C(gpus), C(port), C(container), C(http_host)).
    type: list
    elements: dict
    required: true
  options:
    description:
      - C(window) and C(interval) (seconds), C(sample_metrics) (false - read /server_info, the journal
        and GPU memory only), C(journal_pattern), C(nvidia_smi), C(nvidia_smi_timeout), C(http_timeout).
    type: dict
    default: {}
  pct:
    description: The C(pct) command on a Proxmox node.
    type: str
    default: pct
attributes:
  check_mode:
    support: full
    details: Only reads; nothing on the host is changed.
  diff_mode:
    support: none
  platform:
    platforms: posix
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
"""

EXAMPLES = r"""
- name: Observe the instances of a host for a minute
  sglang_ops.fleet.advise_observe:
    instances: "{{ sglang_server_resolved.instances }}"
    options: {window: 60, interval: 5}
  register: observed
"""

RETURN = r"""
instances:
  description:
    - Per instance - unit identity, C(server_info), C(journal) (startup lines), C(samples) (one dict
      of metric values per tick, C(t) seconds from the start), C(metrics_errors).
  returned: always
  type: dict
containers:
  description:
    - Per container (C(host) for a bare host) - C(gpus) (memory.total, memory.used min/max),
      C(gpu_error), C(window_s).
  returned: always
  type: dict
"""

import threading
from typing import Any

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang_ops.fleet.plugins.module_utils._pct import group_by_container, run_agent


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "instances": {"type": "list", "elements": "dict", "required": True},
            "options": {"type": "dict", "default": {}},
            "pct": {"type": "str", "default": "pct"},
        },
        supports_check_mode=True,
    )
    groups = list(group_by_container(module.params["instances"]).items())
    options = dict(module.params["options"])
    # The agent gets the window plus time for its one-off reads; a hung container is cut off.
    timeout = float(options.get("window", 300)) + 300.0
    results: list[Any] = [None] * len(groups)

    def observe(index: int, container: Any, instances: list) -> None:
        request = dict(options)
        request.update(op="observe", instances=instances)
        results[index] = run_agent(request, container, module.params["pct"], timeout if container is not None else None)

    threads = [
        threading.Thread(target=observe, args=(i, container, instances), daemon=True)
        for i, (container, instances) in enumerate(groups)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    merged: dict = {"instances": {}, "containers": {}}
    failures = []
    for (container, instances), got in zip(groups, results):
        key = "host" if container is None else str(container)
        result = got or {"failed": True, "msg": "no result"}
        if result.get("failed"):
            failures.append(f"{key}: {result.get('msg')}")
            merged["containers"][key] = {"failed": True, "msg": result.get("msg")}
            for inst in instances:
                merged["instances"][inst["name"]] = {"failed": True, "server_info_error": result.get("msg")}
            continue
        merged["instances"].update(result.get("instances", {}))
        merged["containers"][key] = {k: v for k, v in result.items() if k != "instances"}
    if failures and len(failures) == len(groups):
        module.fail_json(msg="; ".join(failures), **merged)
    module.exit_json(changed=False, **merged)


if __name__ == "__main__":
    main()
