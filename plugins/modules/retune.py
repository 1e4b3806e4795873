#!/usr/bin/python
# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
# Documentation of the sglang_ops.fleet.retune action plugin (the work is done on the controller
# by plugins/action/retune.py, which runs sglang_ops.fleet.retune_phase on the host).
# ansible-doc reads this YAML as text; the options' names, types and defaults are those of the
# option table (plugins/plugin_utils/_retune/options.py), as a unit test checks.

from __future__ import annotations

DOCUMENTATION = r"""
---
module: retune
short_description: Relaunch SGLang instances with new settings, proving each step
description:
  - Compares each instance of the host with its desired settings, as the running server itself
    reports them (its command line and environment, C(/server_info), C(/health)), and leaves
    unchanged instances untouched.
  - For each instance to change, in a canary and then waves of O(wave_size) instances in parallel -
    B(stop) the unit with a deadline (SIGKILL of its cgroup after O(stop_timeout));
    B(prove it dead) - its cgroup empty, no process holding its GPUs (open C(/dev/nvidiaN) handles,
    and nvidia-smi's compute apps where their PIDs mean something) or listening on its port; the
    instance's own survivors (its cgroup, or SGLang processes on its GPUs or port, such as a
    detached scheduler) are killed by PID with escalation, anything else fails the instance
    closed, naming the process; nothing is ever killed by a name pattern;
    B(prove its GPU memory free) - memory.used of each of its GPUs at or below
    O(release_threshold_mib), polled until O(release_timeout) (correct inside LXC);
    B(relaunch) it and B(prove it healthy) - a new main PID and invocation, C(/health) 200,
    C(/server_info) reporting exactly the desired settings, its effective max running requests at
    least O(min_max_running_requests), and O(smoke_requests) real completions answered.
  - If the new settings fail (crash at start, start deadline, settings mismatch, failed
    completions), the last good settings (kept on the host) are relaunched and verified the same
    way, and the task fails saying what happened. A failure stops the remaining waves; instances
    not reached keep running as they were. An instance is never left down without the result
    saying so (RV(down)).
  - Evidence is never inferred from silence - nvidia-smi missing, hanging or unparsable, or a host
    unreachable mid-way fails the instance closed, quoting what was run and what came back.
  - One module execution per host per phase gathers what the phase needs for all instances.
  - B(The generation clients) of the host (O(client_units)), when anything is to change - a client
    that answers on its control socket (C(/run/sglang-fleet/clients/UNIT/control.sock)) is drained
    per wave, only on the endpoints of that wave's instances (it finishes or requeues their
    requests in flight within O(client_drain_timeout)), and resumes them after the wave, whatever
    happened; the other instances keep generating. A running client that does not answer, whose
    drain fails, or every running client when O(client_drain) is false, is stopped for the host's
    retune and started again after it, whatever happened. RV(clients) and RV(notes) say which.
version_added: 0.1.0
author: sglang-fleet maintainers (@sglang-ops)
options:
  instances:
    description:
      - The host's resolved instances, as returned by M(sglang_ops.fleet.server_validate)
        (name, unit, gpus, port, container, argv, env, expected_server_info, fingerprint).
    type: list
    elements: dict
    required: true
  only:
    description: Limit the retune to these instance names.
    type: list
    elements: str
  wave_size:
    description: Instances relaunched in parallel per wave after the canary; C(0) means all the rest at once.
    type: int
    default: 0
  canary:
    description:
      - Relaunch one instance alone first - C(true) the first to change, or an instance name;
        C(false) for none.
    type: raw
    default: true
  stop_timeout:
    description:
      - Seconds for the unit to stop (SGLang drains its in-flight requests) before its cgroup is
        SIGKILLed. The same as the unit's C(TimeoutStopSec) (the server role's
        C(sglang_server_stop_timeout)), which the role C(sglang_ops.fleet.retune) passes.
    type: float
    default: 300
  kill_timeout:
    description: Seconds to wait after each signal of an escalation.
    type: float
    default: 10
  release_timeout:
    description: Seconds for the GPU memory to fall to O(release_threshold_mib) after the processes are gone.
    type: float
    default: 300
  release_threshold_mib:
    description:
      - memory.used (MiB) at or below which a GPU counts as released. The same as the start
        guard's (the server role's C(sglang_server_release_threshold_mib)), which the role
        C(sglang_ops.fleet.retune) passes.
    type: int
    default: 1024
  start_timeout:
    description:
      - Seconds from start until C(/health) answers 200 (model load). The same as the server
        role's C(sglang_server_start_timeout), which the role C(sglang_ops.fleet.retune) passes;
        the start guard's deadline is not added, since an instance is started only once its GPUs
        and port are proven free.
    type: float
    default: 3600
  health_timeout:
    description: Timeout (seconds) of each verification request after the instance is up.
    type: float
    default: 120
  min_max_running_requests:
    description: Fail (and roll back) if the effective max running requests per DP rank is below this.
    type: int
  smoke_requests:
    description: Real completions each relaunched instance must answer.
    type: int
    default: 2
  rollback:
    description: Relaunch the last good settings when the new ones fail.
    type: bool
    default: true
  force:
    description: Relaunch instances even when unchanged (a wedged one included).
    type: bool
    default: false
  relaunch_wedged:
    description:
      - Relaunch a wedged instance (its C(/health) or C(/server_info) does not answer within
        O(http_timeout)) or a stalled one (it holds requests and produces nothing, see
        O(stall_probe_s)) whose command line and environment are already the desired ones.
      - Without it such an instance is named unhealthy, left as it is, and the host fails; its
        siblings are retuned as usual. A wedged instance whose settings differ is relaunched in its
        wave either way.
    type: bool
    default: false
  ignore_fit_prediction:
    description:
      - Relaunch an instance even when the fit pre-flight predicts that SGLang would refuse its new
        settings at start (from its startup journal and SGLang's memory arithmetic).
      - Without it such an instance fails before anything is stopped and nothing on its host is
        touched. A prediction missing for lack of evidence never refuses.
    type: bool
    default: false
  call_margin:
    description:
      - Seconds the controller waits for the host's answer to a call of the retune beyond the
        deadline of what the call asked for (its stop, release, start, drain... deadlines, see the
        operator guide).
      - A host that has not answered by then counts as lost - its retune fails naming the phase and
        what is known of each instance, no further call is made to it (RV(host_lost)), and the
        other hosts finish. Covers the connection, the module's start and the commands no option
        bounds (systemctl, journalctl).
    type: float
    default: 120
  client_units:
    description:
      - systemd units of the generation clients on the host (the role's C(sglang_retune_client_units),
        formerly C(sglang_retune_pause_units)).
      - A running client that answers on its control socket is drained per wave, only on the
        endpoints of the instances relaunched; one that does not answer is stopped for the host's
        retune and started again after it.
    type: list
    elements: str
    default: [sglang-fleet-generate.service]
  client_drain:
    description:
      - Drain the answering generation clients per wave; C(false) stops every running client for
        the host's retune and starts it again after.
    type: bool
    default: true
  client_drain_timeout:
    description:
      - Seconds a drained client waits for its requests in flight on a wave's endpoints before it
        requeues the rest on its other endpoints. The drain's lease (after which the client
        resumes by itself, should the retune die) is derived from this and the wave's deadlines.
    type: float
    default: 120
  client_confirm_timeout:
    description:
      - Seconds a drained generation client is given, after a wave's endpoints are handed back to
        it, to say that each is back in service - it completed a request there, or, at the bound,
        it sends there and nothing failed. An endpoint it took out of service (an API key or path
        refused), that is down, or whose requests only failed fails the host with the client's own
        reason, and the next wave does not start.
    type: float
    default: 60
  nvidia_smi:
    description: The nvidia-smi command on the host (or inside the container).
    type: str
    default: nvidia-smi
  nvidia_smi_timeout:
    description:
      - Seconds each nvidia-smi call may take. One that hangs past it is killed with every
        process it started (its own process group), and counts as broken evidence - before any
        stop, the instances of the host are left serving and the result is blocked.
    type: float
    default: 20
  devices_dir:
    description: Where the C(nvidiaN) device nodes are.
    type: path
    default: /dev
  supervisor:
    description:
      - What supervises the instances and clients on the host - C(systemd), or C(supervisord) on a pod.
        Set by the server role's sglang_server_supervisor.
    type: str
    default: systemd
  supervisor_root:
    description:
      - On a pod, where supervisord's files live (see the server role). Set by the server role's
        sglang_server_supervisor_root.
    type: path
    default: /workspace/sglang-fleet
  secrets_file:
    description: Root-only environment file holding C(SGLANG_API_KEY) (read on the host, never sent back).
    type: path
    default: /etc/sglang-fleet/secrets.env
  state_dir:
    description: Where the last good settings are kept on the host.
    type: path
    default: /var/lib/sglang-fleet
  desired_dir:
    description: Where the server role records each instance's desired settings on the host.
    type: path
    default: /etc/sglang-fleet/instances
  poll_interval:
    description: Seconds between polls (unit state, GPU memory, health).
    type: float
    default: 0.5
  http_timeout:
    description:
      - Timeout of each C(/health) and C(/server_info) request. A running instance whose endpoint
        does not answer within it (C(/server_info) hangs when a scheduler is stuck or gone) is
        wedged, and is relaunched in its wave when its settings (read from C(/proc)) differ, else named
        unhealthy and left as it is unless O(relaunch_wedged) or O(force) is set.
    type: float
    default: 30
  stall_probe_s:
    description:
      - Seconds between the two reads of C(/metrics) that tell whether a running instance that
        answers C(/health) and C(/server_info) still produces. One that holds requests (running or
        waiting) and processes no token between them (C(sglang:realtime_tokens_total) flat) is
        stalled - unhealthy as a wedged one is - and is relaunched in its wave when its settings
        differ, else named unhealthy and left as it is unless O(relaunch_wedged) or O(force) is set.
      - A stall is concluded only when a third read, 32 s after the first, still finds requests and
        the counter where it was. An idle scheduler reports its requests again only 30 s after its
        last report, so a server that has just gone idle is not taken for a stalled one.
      - The second read is made only when the first finds requests. An instance without C(/metrics)
        (started without C(enable_metrics)) is not checked. 0 - no check.
    type: float
    default: 5
  pct:
    description:
      - The C(pct) command on a Proxmox node (the server role's C(sglang_server_pct), which the role
        C(sglang_ops.fleet.retune) passes).
    type: str
    default: pct
attributes:
  check_mode:
    support: full
    details: Inspects and reports what would be done; nothing is stopped, started or written.
  diff_mode:
    support: full
    details: The running command line against the desired one, per instance to change.
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
seealso:
  - module: sglang_ops.fleet.server_validate
  - module: sglang_ops.fleet.retune_phase
"""

EXAMPLES = r"""
- name: Retune the instances of each host
  sglang_ops.fleet.retune:
    instances: "{{ sglang_server_resolved.instances }}"
    wave_size: 2
    min_max_running_requests: 32
  register: retune

- name: Show what would change, touching nothing
  sglang_ops.fleet.retune:
    instances: "{{ sglang_server_resolved.instances }}"
  check_mode: true
  diff: true
"""

RETURN = r"""
changed:
  description: Whether any instance was (or, in check mode, would be) relaunched or started.
  returned: always
  type: bool
elapsed:
  description: Seconds the retune took.
  returned: always
  type: float
instances:
  description:
    - Per instance - C(action) (unchanged, relaunched, started, rolled_back, failed, skipped, unhealthy; in
      check mode would_relaunch, would_start), C(reasons), C(state) (running, stopped, down,
      unverified), C(old_main_pid), C(new_main_pid), C(gpu_memory_before_mib),
      C(gpu_memory_released_mib), C(time_to_dead_s), C(time_to_release_s), C(time_to_healthy_s),
      C(relaunch_s) (wall time from the stop to proven health, round trips included),
      C(effective_max_running_requests_before), C(effective_max_running_requests_after),
      C(flag_diff), C(killed) (PIDs signalled, with their command lines), C(escalated), C(msg),
      C(wedged) (what of its own endpoints did not answer at inspect; empty when it answered).
  returned: always
  type: list
  elements: dict
wedged:
  description: Per wedged instance, what did not answer and what became of it (relaunched and how it
    was stopped, or left as it is, unhealthy).
  returned: when any
  type: list
  elements: str
down:
  description: Instances left down (their GPUs idle) - the operator must act.
  returned: when any
  type: list
  elements: str
round_trips:
  description: Module executions on the host per phase.
  returned: always
  type: dict
clients:
  description:
    - Per generation client unit (empty when nothing was to change) - C(unit), C(mode) (C(drained)
      per wave, C(stopped) for the retune, C(not running), C(not sending here)), C(why), C(sends_to)
      (the host's instances it sends to), C(waves) (per wave drained - C(instances), C(waited_s),
      C(abandoned) requests requeued elsewhere, C(resumed_capacity) per endpoint), and when stopped
      C(stopped_s) and C(started_again).
  returned: always
  type: list
  elements: dict
clients_stopped:
  description: The generation client units stopped during the retune (empty - no client ever stopped).
  returned: always
  type: list
  elements: str
notes:
  description: Host-level lines for the summary - one per generation client, and anything else worth saying.
  returned: when any
  type: list
  elements: str
host_lost:
  description:
    - The host stopped answering - C(phase) (the call that went unanswered), C(instances) (those it
      was about), C(rollback), C(deadline_s), C(margin_s), C(bound_s), C(waited_s). No further call
      was made to the host; each instance's C(msg) (and C(host_lost)) says what is known of it.
  returned: when the host was lost
  type: dict
"""
