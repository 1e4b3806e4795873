#!/usr/bin/python
# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""One phase of a retune, for every given instance of a host at once."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: retune_phase
short_description: Run one phase of an SGLang instance retune on a host
description:
  - Internal to the M(sglang_ops.fleet.retune) action plugin, which calls it once per host per
    phase. Usable on its own to inspect instances (O(op=inspect) changes nothing).
  - Gathers or acts on all the given instances in one execution, on the host itself or inside
    the Proxmox LXC containers that hold them (through C(pct exec)).
version_added: 0.1.0
author: sglang-fleet maintainers (@sglang-ops)
options:
  op:
    description:
      - C(inspect) reports unit state, main PID and invocation, the running command line and
        environment, /health, /server_info, GPU memory and recorded state.
      - C(stop) stops the units and proves the instances dead, killing the instances' own
        survivors by PID.
      - C(release) waits until the GPU memory of the instances is released.
      - C(start) starts the units and proves a new, healthy process serving the expected settings.
      - C(record) records the current settings as the last good ones.
      - C(clients) reports each generation client unit of C(client_units) in O(options) - its state, its
        control socket's answer and which of the given instances it sends to (changes nothing).
      - C(drain) and C(resume) drain and resume endpoints (C(clients) in O(options), unit to URLs) in the
        generation clients through their control sockets; C(client_stop) and C(client_start) stop
        and start the generation client units of C(client_units) in O(options).
      - The generation client operations run on the host itself, never in a container.
    type: str
    required: true
    choices: [inspect, stop, release, start, record, clients, drain, resume, client_stop, client_start]
  instances:
    description: Resolved instances (see M(sglang_ops.fleet.server_validate)), with per-phase keys.
    type: list
    elements: dict
    required: true
  options:
    description: Phase options (deadlines, thresholds, tool paths); see M(sglang_ops.fleet.retune).
    type: dict
    default: {}
  managed_units:
    description: Every instance unit of the host, to tell another instance's process from a foreign one.
    type: list
    elements: dict
    default: []
  pct:
    description: The C(pct) command on a Proxmox node.
    type: str
    default: pct
  lock_run_id:
    description:
      - The run that holds the host lock (see M(sglang_ops.fleet.host_lock)). Every phase but
        O(op=inspect) and O(op=clients) (which only read) proves the lease this run's before it
        acts and renews it while it runs.
      - Without it, a phase that acts refuses while another live run holds the host lock.
    type: str
attributes:
  check_mode:
    support: partial
    details: Only O(op=inspect) and O(op=clients) run in check mode.
  diff_mode:
    support: none
  platform:
    platforms: posix
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
"""

EXAMPLES = r"""
- name: Inspect the instances of a host
  sglang_ops.fleet.retune_phase:
    op: inspect
    instances: "{{ sglang_server_resolved.instances }}"
  register: facts
"""

RETURN = r"""
instances:
  description: Per-instance results of the phase, keyed by instance name.
  returned: for the instance operations
  type: dict
clients:
  description: Per generation client unit, what was found or done.
  returned: for the generation client operations
  type: dict
containers:
  description: Host-level evidence (GPU table, nvidia-smi errors) per container (C(host) for a bare host).
  returned: for the instance operations
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang_ops.fleet.plugins.module_utils import _host_lock
from ansible_collections.sglang_ops.fleet.plugins.module_utils._pct import group_by_container, run_agent

INSTANCE_OPS = ("inspect", "stop", "release", "start", "record")
# The generation clients of the host: on the host itself (where the clients run), once.
CLIENT_OPS = ("clients", "drain", "resume", "client_stop", "client_start")
# Operations that only read: no lease needed, and they run in check mode.
READ_ONLY_OPS = ("inspect", "clients")


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "op": {
                "type": "str",
                "required": True,
                "choices": [*INSTANCE_OPS, *CLIENT_OPS],
            },
            "instances": {"type": "list", "elements": "dict", "required": True},
            "options": {"type": "dict", "default": {}},
            "managed_units": {"type": "list", "elements": "dict", "default": []},
            "pct": {"type": "str", "default": "pct"},
            "lock_run_id": {"type": "str"},
        },
        supports_check_mode=True,
    )
    op = module.params["op"]
    if module.check_mode and op not in READ_ONLY_OPS:
        module.fail_json(msg=f"op={op} changes the host and cannot run in check mode")
    if op in READ_ONLY_OPS:
        run_phase(module)
        return
    try:
        with _host_lock.guard(module.params["lock_run_id"], what=f"retune's {op} phase") as renewer:
            run_phase(module, renewer)
    except _host_lock.LockError as exc:
        module.fail_json(msg=f"{exc}; the {op} phase did nothing", holder=exc.holder, lock_error=True)


def run_phase(module: AnsibleModule, renewer: _host_lock.Renewer | None = None) -> None:
    op = module.params["op"]
    if op in CLIENT_OPS:
        run_client_phase(module, renewer)
        return
    groups = group_by_container(module.params["instances"])
    managed = group_by_container(module.params["managed_units"])
    merged: dict = {"instances": {}, "containers": {}}
    failures = []
    for container, instances in groups.items():
        request = dict(module.params["options"])
        request.update(op=op, instances=instances, managed_units=[m["unit"] for m in managed.get(container, [])])
        result = run_agent(request, container, module.params["pct"])
        key = "host" if container is None else str(container)
        if result.get("failed"):
            failures.append(f"{key}: {result.get('msg')}")
            for inst in instances:
                merged["instances"][inst["name"]] = {"failed": True, "msg": result.get("msg")}
            merged["containers"][key] = {"failed": True, "msg": result.get("msg")}
            continue
        merged["instances"].update(result.get("instances", {}))
        merged["containers"][key] = {k: v for k, v in result.items() if k != "instances"}
    changed = op in ("stop", "start", "record")
    if renewer is not None and renewer.lost:
        merged["lock_lost"] = renewer.lost
    if failures:
        module.fail_json(msg="; ".join(failures), changed=changed, **merged)
    module.exit_json(changed=changed, **merged)


def run_client_phase(module: AnsibleModule, renewer: _host_lock.Renewer | None) -> None:
    op = module.params["op"]
    request = dict(module.params["options"])
    request.update(op=op, instances=module.params["instances"])
    result = run_agent(request, None, module.params["pct"])
    if renewer is not None and renewer.lost:
        result["lock_lost"] = renewer.lost
    changed = op not in READ_ONLY_OPS
    if result.get("failed"):
        result.pop("failed")
        module.fail_json(msg=str(result.pop("msg", "failed")), changed=changed, **result)
    module.exit_json(changed=changed, **result)


if __name__ == "__main__":
    main()
