#!/usr/bin/python
# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
# Documentation of the sglang_ops.fleet.host_lock action plugin (plugins/action/host_lock.py), which
# knows the run's identity on the controller and runs sglang_ops.fleet.host_lock_lease on the host;
# ansible-doc finds action plugins' documentation here. The options are those of ARGUMENT_SPEC there,
# as a unit test checks.

from __future__ import annotations

DOCUMENTATION = r"""
---
module: host_lock
short_description: One retune or deploy per host at a time
description:
  - Takes a lease on the host (C(/run/sglang-fleet/host.lock)) before a run touches anything there,
    and gives it back at the end. The lease names the run that holds it - a run id, the
    controller host, the user, the controller's process and the start time.
  - A second run finds the lease and fails at once, before touching anything, naming the holder.
  - A lease left by a run that died is taken over - when it was not renewed within its TTL
    (every phase of M(sglang_ops.fleet.retune) and every write of the server role renews it), or
    at once when the holder ran on this same controller and its process is gone.
  - The result sets the fact C(sglang_fleet_lock) (the lease), which the later tasks of the run
    pass on to M(sglang_ops.fleet.retune) and M(sglang_ops.fleet.server_units) so that they prove
    the lease still theirs before they act.
  - In check mode nothing is taken; a lease held by another run is reported as a warning.
version_added: 0.2.0
author: sglang-fleet maintainers (@sglang-ops)
options:
  state:
    description: C(acquired) takes (or renews) the lease, C(released) gives it back if this run holds it.
    type: str
    choices: [acquired, released]
    default: acquired
  ttl:
    description:
      - Seconds after its last renewal at which a lease counts as left by a dead run. Longer than
        any pause between two tasks of a run on the host (the generation clients' stop, for one).
    type: int
    default: 1800
  wait:
    description:
      - Seconds to keep trying while another live run holds the lease (every few seconds), for
        O(state=acquired); C(0) fails at once, naming the holder. Past it, the task fails naming
        the holder and how long it waited. Used by C(retune.yml) to take the host lock of every
        host of the run before any is touched (C(sglang_retune_fleet_lock)).
    type: int
    default: 0
attributes:
  check_mode:
    support: full
    details: Nothing is taken; a lease held by another run is reported as a warning.
  diff_mode:
    support: none
  platform:
    platforms: posix
  action:
    support: full
  async:
    support: none
  bypass_host_loop:
    support: none
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.flow
notes:
  - The lease is kept on the host (the Proxmox node for instances inside LXC containers) by
    M(sglang_ops.fleet.host_lock_lease).
"""

EXAMPLES = r"""
- name: Take the host lock for this run
  sglang_ops.fleet.host_lock:

- name: Take it, waiting up to 10 minutes for another run to give it back
  sglang_ops.fleet.host_lock:
    wait: 600

- name: Give it back
  sglang_ops.fleet.host_lock:
    state: released
"""

RETURN = r"""
lock:
  description: The lease as written on the host (run_id, controller, user, controller_pid, started_at, renewed_at).
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
"""
