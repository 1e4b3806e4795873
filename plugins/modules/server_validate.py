#!/usr/bin/python
# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
# Documentation of the sglang_ops.fleet.server_validate action plugin, which runs entirely on the
# controller (plugins/action/server_validate.py); ansible-doc finds action plugins' documentation here.

from __future__ import annotations

DOCUMENTATION = r"""
module: server_validate
author: sglang-fleet maintainers (@sglang-ops)
version_added: 0.1.0
short_description: Validate and resolve the SGLang instances of a host, on the controller
description:
  - Reads the host's C(sglang_server_*) variables, applies the instance layout and validates every setting
    against the flag table of the host's SGLang version (C(sglang_server_version)).
  - Runs entirely on the controller; nothing is executed on or copied to the host, so it is safe in check
    mode and is meant to run before anything on a host changes.
  - On success returns the resolved instances (argv, environment, fingerprint per instance) and sets them as
    the fact C(sglang_server_instances_resolved). Replaced deprecated flags and unchecked flags produce
    warnings.
  - On failure the message lists every problem of the host, each naming the instance and the variable path
    to fix (for example C(sglang_server_instances[2].args.max_mamba_cache_sze)).
options: {}
attributes:
  check_mode:
    support: full
    details: Runs on the controller only and changes nothing.
  diff_mode:
    support: none
  platform:
    platforms: all
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
  - Variables read are C(sglang_server_version), C(sglang_server_flag_table_version), C(sglang_server_python),
    C(sglang_server_model_path), C(sglang_server_served_model_name), C(sglang_server_listen_host),
    C(sglang_server_base_port), C(sglang_server_gpu_count), C(sglang_server_instances),
    C(sglang_server_lxc_container), C(sglang_server_args), C(sglang_server_host_args),
    C(sglang_server_args_unchecked), C(sglang_server_env), C(sglang_server_host_env), C(sglang_server_user),
    and of C(sglang_server_api_key) and C(sglang_server_secret_env) only whether they are set and the secret
    names (no secret value enters the result). Unset variables take the server role's defaults, also where the
    role is not applied.
  - The filter P(sglang_ops.fleet.server_instances#filter) returns the same instances, from the same function.
seealso:
  - plugin: sglang_ops.fleet.server_instances
    plugin_type: filter
  - plugin: sglang_ops.fleet.server_cli_args
    plugin_type: filter
"""

EXAMPLES = r"""
- name: Validate SGLang settings before touching any host
  sglang_ops.fleet.server_validate:

- name: Show the launch command of each instance
  ansible.builtin.debug:
    msg: "{{ item.unit }}: {{ item.argv | join(' ') }}"
  loop: "{{ sglang_server_instances_resolved }}"
  loop_control:
    label: "{{ item.name }}"
"""

RETURN = r"""
instances:
  description: The resolved instances of the host.
  returned: success
  type: list
  elements: dict
  contains:
    name:
      description: Instance name.
      type: str
    unit:
      description: systemd unit name, C(sglang-<name>.service).
      type: str
    gpus:
      description: GPU indexes of the host (or container) the instance owns.
      type: list
      elements: int
    port:
      description: HTTP port.
      type: int
    container:
      description: Proxmox LXC container id holding the instance, null on the bare host.
      type: int
    version:
      description: SGLang version installed.
      type: str
    flag_table:
      description: Flag table version used for the checks.
      type: str
    args:
      description: Every launch setting under the names that version uses.
      type: dict
    args_unchecked:
      description: Flags passed without validation.
      type: dict
    argv:
      description: The complete command line.
      type: list
      elements: str
    env:
      description: Environment of the unit, CUDA_VISIBLE_DEVICES included.
      type: dict
    warnings:
      description: Warnings about this instance.
      type: list
      elements: str
    fingerprint:
      description: sha256 of the canonical JSON of version, argv and env.
      type: str
    http_host:
      description: Address the host itself reaches the instance at.
      type: str
    health_url:
      description: The instance's /health URL, from the host.
      type: str
    self_sigkill_on_stop:
      description: Whether this SGLang release ends a clean stop by SIGKILLing itself.
      type: bool
    expected_server_info:
      description: Values /server_info must report for the settings given explicitly.
      type: dict
    user:
      description: System user the instance runs as.
      type: str
    served_model_name:
      description: Model name clients ask for (null - the model path).
      type: str
sglang_server_instances_resolved:
  description: The same list as RV(instances); also set as a host fact of that name.
  returned: success
  type: list
  elements: dict
problems:
  description: One line per problem found.
  returned: failure
  type: list
  elements: str
"""
