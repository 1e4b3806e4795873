#!/usr/bin/python
# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Take, check or give back a host's retune lock (the host side of sglang_ops.fleet.host_lock)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: host_lock_lease
short_description: The host side of the host lock (run by sglang_ops.fleet.host_lock)
description:
  - Takes, renews or gives back the lease C(/run/sglang-fleet/host.lock) on the host for the run
    named by O(identity). M(sglang_ops.fleet.host_lock) runs it with the identity it knows on the
    controller; a task uses M(sglang_ops.fleet.host_lock), not this module.
  - A lease held by another live run fails the task at once, naming the holder in RV(holder).
version_added: 0.2.0
author: sglang-fleet maintainers (@sglang-ops)
options:
  state:
    description: C(acquired) takes (or renews) the lease, C(released) gives it back if this run holds it.
    type: str
    choices: [acquired, released]
    default: acquired
  identity:
    description:
      - The run - C(run_id), C(controller), C(user), C(controller_pid), C(controller_pid_starttime),
        C(started_at), C(ttl_s) - as M(sglang_ops.fleet.host_lock) builds it on the controller.
    type: dict
    required: true
  take_over:
    description: The run id of a holder known to be dead, whose lease is taken over at once.
    type: str
attributes:
  check_mode:
    support: full
    details: Nothing is taken; a lease held by another run is reported as a warning.
  diff_mode:
    support: none
  platform:
    platforms: posix
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
"""

EXAMPLES = r"""
# Run by the sglang_ops.fleet.host_lock action; a task takes the lock with it:
- name: Take the host lock for this run
  sglang_ops.fleet.host_lock:
"""

RETURN = r"""
lock:
  description: The lease as written on the host.
  returned: success
  type: dict
took_over:
  description: The lease of a dead run that this one took over, if any.
  returned: when a lease was taken over
  type: dict
holder:
  description: The run that holds the lease, when another run holds it.
  returned: when the lease is held by another run
  type: dict
released:
  description: Whether the lease was given back.
  returned: with O(state=released)
  type: bool
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang_ops.fleet.plugins.module_utils import _host_lock


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "state": {"type": "str", "choices": ["acquired", "released"], "default": "acquired"},
            # Set by the action plugin (sglang_ops.fleet.host_lock) from the controller.
            "identity": {"type": "dict", "required": True},
            "take_over": {"type": "str"},
        },
        supports_check_mode=True,
    )
    path = _host_lock.LOCK_PATH_DEFAULT
    identity = module.params["identity"]
    if module.params["state"] == "released":
        released = False if module.check_mode else _host_lock.release(identity["run_id"], path)
        # The lease is the run's bookkeeping, not managed state: never "changed", so a second run
        # of a playbook still reports nothing changed.
        module.exit_json(changed=False, released=released)
    if module.check_mode:
        holder = _host_lock.read(path)
        warnings = []
        if holder and holder.get("run_id") != identity["run_id"]:
            warnings.append(f"the host is locked by {_host_lock.describe(holder)}: an apply now would fail")
        module.exit_json(changed=False, lock=None, holder=holder, warnings=warnings)
    try:
        got = _host_lock.acquire(identity, path, take_over=module.params["take_over"])
    except _host_lock.LockError as exc:
        module.fail_json(msg=str(exc), holder=exc.holder)
    result = {"changed": False, "lock": got["lock"]}
    if got["took_over"]:
        result["took_over"] = got["took_over"]
    module.exit_json(**result)


if __name__ == "__main__":
    main()
