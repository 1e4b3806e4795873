#!/usr/bin/python
# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
# Documentation of the sglang_ops.fleet.advise_report action plugin (the work is done on the
# controller by plugins/action/advise_report.py); ansible-doc finds action plugins' documentation
# here. The options are those of ARGUMENT_SPEC there, as a unit test checks.

from __future__ import annotations

DOCUMENTATION = r"""
---
module: advise_report
short_description: The fleet report of the tuning advisor, and the inventory patch
description:
  - From every host's result of M(sglang_ops.fleet.advise) - the fleet report (instances with
    identical settings and advice grouped, the hosts without advice named), for people and as
    data, and the inventory patch (host layer or per instance, as YAML) written on the controller
    at O(output). Nothing runs on a host and nothing is applied.
version_added: 0.3.0
author: sglang-fleet maintainers (@sglang-ops)
options:
  results:
    description: Every host's result of M(sglang_ops.fleet.advise), keyed by host.
    type: dict
    required: true
  output:
    description: Where the inventory patch (YAML) is written, on the controller.
    type: path
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
  - module: sglang_ops.fleet.advise
"""

EXAMPLES = r"""
- name: Observe the instances of the host and diagnose them
  sglang_ops.fleet.advise:
    instances: "{{ sglang_server_resolved.instances }}"
  register: _advice

- name: The fleet report, and the patch
  sglang_ops.fleet.advise_report:
    results: "{{ dict(ansible_play_hosts | zip(ansible_play_hosts | map('extract', hostvars, '_advice'))) }}"
    output: advice/sglang-fleet-advice.yml
  run_once: true
"""

RETURN = r"""
report:
  description: The fleet report (groups, instances, patch, problems) as data.
  returned: always
  type: dict
text:
  description: The fleet report for people.
  returned: always
  type: str
report_lines:
  description: RV(text) as lines.
  returned: always
  type: list
  elements: str
patch_path:
  description: Where the patch was written (null - O(output) not given).
  returned: always
  type: str
patch_yaml:
  description: The patch.
  returned: always
  type: str
advice_produced:
  description: Whether any instance was diagnosed.
  returned: always
  type: bool
"""
