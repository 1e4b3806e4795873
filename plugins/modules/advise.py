#!/usr/bin/python
# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
# Documentation of the sglang_ops.fleet.advise action plugin (the work is done on the controller
# by plugins/action/advise.py, which runs sglang_ops.fleet.advise_observe on the host); ansible-doc
# finds action plugins' documentation here. The options are those of ARGUMENT_SPEC there, as a unit
# test checks.

from __future__ import annotations

DOCUMENTATION = r"""
---
module: advise
short_description: Find what limits the throughput of SGLang instances, and propose the tuning change
description:
  - Per host (with O(instances)) - observes every instance for O(window) seconds (its C(/metrics)
    every O(interval) seconds, or a range query of Prometheus when O(prometheus_url) is set; its
    C(/server_info); the weights, Mamba cache and KV cache allocation lines of its current run in
    the unit's journal; nvidia-smi's GPU memory), derives the model's memory facts from that
    evidence, and classifies each instance - C(mamba-bound) (running requests pinned at the
    effective max, Mamba state slots full), C(kv-bound) (the KV cache nearly full),
    C(max-running-bound) (pinned at max_running_requests with memory to spare), C(client-bound)
    (below the max with no queue), C(compute-bound) (none of these), C(unknown) (not enough
    evidence).
  - For C(mamba-bound), C(max-running-bound) and C(kv-bound) it proposes settings that fit in the GPU's
    memory per SGLang's own memory arithmetic for the release, and that the release's flag table
    accepts, with the predicted effective max running requests and throughput; for C(client-bound)
    the generation clients' concurrency; for C(compute-bound) nothing.
  - The fleet report from every host's result, and the inventory patch, are
    M(sglang_ops.fleet.advise_report)'s.
  - Nothing is ever applied - the operator reviews the patch and commits it, then runs the retune.
version_added: 0.1.0
author: sglang-fleet maintainers (@sglang-ops)
options:
  instances:
    description: The host's resolved instances, as returned by M(sglang_ops.fleet.server_validate).
    type: list
    elements: dict
  window:
    description: Seconds to observe (or to read back from Prometheus).
    type: float
    default: 300.0
  interval:
    description: Seconds between two metrics samples (the Prometheus query step).
    type: float
    default: 5.0
  prometheus_url:
    description:
      - Prometheus's base URL (C(http://prometheus:9090)). When set, the metrics of the last O(window)
        seconds are read with range queries of its HTTP API, on the controller, instead of sampling
        C(/metrics) on the host for O(window) seconds.
      - Give a URL without credentials (it is recorded with the task's arguments); use
        O(prometheus_username) and O(prometheus_password).
    type: str
  prometheus_selector:
    description:
      - The label selector of one instance's series; placeholders C({host}) (C(ansible_host), else the
        inventory name), C({inventory_hostname}), C({port}) and C({name}) (the instance).
      - The default matches the labels the role C(sglang_ops.fleet.monitoring) gives every target;
        C(instance="{host}:{port}") (the scrape target) suits a Prometheus set up otherwise.
    type: str
    default: 'host="{inventory_hostname}",instance_name="{name}"'
  prometheus_timeout:
    description: Seconds per Prometheus query.
    type: float
    default: 30.0
  prometheus_ca_path:
    description: CA bundle (PEM) an https O(prometheus_url) is verified against; by default the system's.
    type: path
  prometheus_validate_certs:
    description: Whether the certificate of an https O(prometheus_url) is verified.
    type: bool
    default: true
  prometheus_username:
    description: User for HTTP basic authentication to Prometheus (sent only when set).
    type: str
  prometheus_password:
    description: Password for HTTP basic authentication to Prometheus (never logged).
    type: str
  nvidia_smi:
    description: The nvidia-smi command on the host.
    type: str
    default: nvidia-smi
  nvidia_smi_timeout:
    description: Seconds each nvidia-smi call may take.
    type: float
    default: 20.0
  http_timeout:
    description:
      - Timeout of the C(/server_info) request (each C(/metrics) request - the smaller of this and
        O(interval)).
    type: float
    default: 30.0
  client_units:
    description:
      - systemd units of the generation clients on the host (the retune's C(sglang_retune_client_units)).
        At the end of the window, each running one is asked on its control socket what it sends to
        each instance and whether its concurrency follows the server's (auto concurrency); the
        predicted throughput of a proposal then counts what they will send after the relaunch.
    type: list
    elements: str
    default: []
  pct:
    description: The C(pct) command on a Proxmox node.
    type: str
    default: pct
  supervisor:
    description:
      - What supervises the instances and clients on the host - C(systemd), or C(supervisord) on a pod.
        Set by the server role's sglang_server_supervisor.
    type: str
    default: systemd
  supervisor_root:
    description: On a pod, where supervisord's files live. Set by the server role's sglang_server_supervisor_root.
    type: path
    default: /workspace/sglang-fleet
  measure:
    description:
      - Opt in to the stepped measurement after the window, on every instance of the host at once.
        The host's generation clients that send to an instance are drained (nothing new sent there
        for a few seconds), the instance must then be idle, and the agent keeps its own requests, shaped like the
        window's, at a few concurrencies (shares of the effective max) for a few seconds each while
        sampling C(/metrics); then the clients are resumed. The throughput model fits the
        instance's decode step time against its running requests from those samples where the
        window did not vary them, pooling the samples of the host's alike instances (the same
        release and settings; only port and GPU differ) for one curve (C(docs/advisor.md)).
      - Costs each instance its generation for the drain and the steps (about 25 seconds
        by default).
    type: bool
    default: false
  measure_options:
    description:
      - The measurement's C(levels) (shares of the effective max, default C([0.25, 0.5, 1.0])),
        C(step_s) (seconds per level, default 4), C(interval) (seconds between samples, default
        0.25), C(settle) (share of each step left out while the gauges catch up, default 0.4),
        C(drain_timeout) (seconds the clients' requests in flight get, default 10) and
        C(max_new_tokens) (of each request, default 1024).
    type: dict
    default: {}
  policy:
    description:
      - Overrides of the advisor's thresholds and limits (C(plugin_utils/_advisor/vocabulary.py) C(Policy); see
        C(docs/advisor.md)), for example C(max_mem_fraction_static=0.9) or C(saturation_batch_tokens=512).
    type: dict
    default: {}
attributes:
  check_mode:
    support: full
    details: Nothing is changed either way; the patch file is written on the controller.
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
seealso:
  - module: sglang_ops.fleet.advise_report
  - module: sglang_ops.fleet.advise_observe
  - module: sglang_ops.fleet.server_validate
"""

EXAMPLES = r"""
- name: Observe the instances of the host and diagnose them
  sglang_ops.fleet.advise:
    instances: "{{ sglang_server_resolved.instances }}"
    window: 300
  register: _advice
"""

RETURN = r"""
instances:
  description:
    - Per instance (with O(instances)) - C(diagnosis), C(why) (the evidence in the metrics' own names),
      C(proposal) (C(changes) as setting - [now, proposed], C(client_changes), the predicted effective
      max running requests, KV tokens and throughput), C(alternatives), C(stats), C(facts),
      C(capacity), C(problems).
  returned: always
  type: list
  elements: dict
inventory:
  description: The host's settings layers as the inventory writes them (for the patch).
  returned: always
  type: dict
host_problem:
  description: Why the host gave no observation.
  returned: when the observe phase failed
  type: str
"""
