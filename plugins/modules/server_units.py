#!/usr/bin/python
# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Install the desired state of a host's SGLang instances, bare or inside Proxmox LXC."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: server_units
short_description: Install SGLang instance units and their files, and start instances that are not running
description:
  - Converges, on the host itself or inside the Proxmox LXC containers that hold the instances
    (through C(pct exec) from the node), the system user, directories and files (units,
    desired-state records, helper scripts, the secrets file) of SGLang instances.
  - Each changed unit is checked with C(systemd-analyze verify) before it is installed (its
    warnings count as failures), written atomically, and followed by a C(daemon-reload).
  - Never restarts a running instance, whatever changed; relaunching is the job of
    M(sglang_ops.fleet.retune), which proves the old process dead, its GPU memory free and the
    new one healthy. Instances that are not running are started.
version_added: 0.1.0
author: sglang-fleet maintainers (@sglang-ops)
options:
  targets:
    description: What to converge, one entry per place (the bare host, or a container).
    type: list
    elements: dict
    required: true
    suboptions:
      container:
        description: Proxmox LXC container id, or null for the host itself.
        type: int
      user:
        description: System user C({name, home, groups}) that runs the servers; missing groups are skipped.
        type: dict
      directories:
        description: Directories C({path, mode, owner, group}) to create.
        type: list
        elements: dict
        default: []
      files:
        description: Files C({path, content, mode, owner, group, verify}); units are verified first.
        type: list
        elements: dict
        default: []
      health_urls:
        description:
          - Each unit's /health URL. Where the supervisor's start does not wait for the server to
            answer (supervisord), the start of a unit waits for it here, within O(start_timeout).
        type: dict
        default: {}
      units:
        description: The instance units here.
        type: list
        elements: str
        default: []
      enable:
        description: Enable the units at boot.
        type: bool
        default: true
      start:
        description: Start units that are not running (running ones are left alone).
        type: bool
        default: true
  secret_files:
    description:
      - Files whose content is secret (the environment file with the API key). Never shown in
        diffs or output; written root-owned C(0600) unless a mode is given.
      - Each entry has a C(container) key like O(targets).
    type: list
    elements: dict
    default: []
  start_timeout:
    description: Seconds to wait for the started units (their ExecStartPost health wait).
    type: int
    default: 3600
  pct:
    description: The C(pct) command on a Proxmox node.
    type: str
    default: pct
  secrets_file:
    description:
      - The secrets file on the host (in each container) whose values are redacted from every
        command line shown. The server role passes its own path.
    type: path
    required: true
  state_dir:
    description: Where the last good settings of each instance are kept on the host.
    type: path
    required: true
  desired_dir:
    description: Where the desired-settings records are written; a record written here is a desired record.
    type: path
    required: true
  supervisor:
    description: What supervises the instances - C(systemd) units, or C(supervisord) programs on a pod.
    type: str
    choices: [systemd, supervisord]
    default: systemd
  supervisor_root:
    description: On a pod, where supervisord's files live (the server role's C(sglang_server_supervisor_root)).
    type: path
  lock_run_id:
    description:
      - The run that holds the host lock (M(sglang_ops.fleet.host_lock) sets C(sglang_fleet_lock));
        the lease is proven this run's and renewed before anything is written.
      - Without it, nothing is written while another live run holds the host lock.
    type: str
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
  platform:
    platforms: posix
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
"""

EXAMPLES = r"""
- name: Install one instance unit on a bare host and start it if it is not running
  sglang_ops.fleet.server_units:
    targets:
      - container: null
        files:
          - path: /etc/systemd/system/sglang-gpu0.service
            content: "{{ lookup('ansible.builtin.template', 'sglang-instance.service.j2') }}"
        units: [sglang-gpu0.service]
    secrets_file: /etc/sglang-fleet/secrets.env
    state_dir: /var/lib/sglang-fleet
    desired_dir: /etc/sglang-fleet/instances
"""

RETURN = r"""
targets:
  description: Per place (C(host) or the container id), the files written, actions and started units.
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang_ops.fleet.plugins.module_utils import _host_lock
from ansible_collections.sglang_ops.fleet.plugins.module_utils._pct import run_agent


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "targets": {"type": "list", "elements": "dict", "required": True},
            "secret_files": {"type": "list", "elements": "dict", "default": [], "no_log": True},
            "start_timeout": {"type": "int", "default": 3600},
            "pct": {"type": "str", "default": "pct"},
            "secrets_file": {"type": "path", "required": True},
            "state_dir": {"type": "path", "required": True},
            "desired_dir": {"type": "path", "required": True},
            "supervisor": {"type": "str", "choices": ["systemd", "supervisord"], "default": "systemd"},
            "supervisor_root": {"type": "path"},
            "lock_run_id": {"type": "str"},
        },
        supports_check_mode=True,
    )
    if module.check_mode:
        converge(module)
        return
    try:
        with _host_lock.guard(module.params["lock_run_id"], what="server role's write"):
            converge(module)
    except _host_lock.LockError as exc:
        module.fail_json(msg=f"{exc}; nothing was written", holder=exc.holder)


def converge(module: AnsibleModule) -> None:
    secrets_by_place: dict = {}
    for spec in module.params["secret_files"]:
        secret = {"mode": "0600", "owner": "root", "group": "root", **spec, "secret": True, "verify": False}
        secrets_by_place.setdefault(secret.pop("container", None), []).append(secret)
    places = {t.get("container"): t for t in module.params["targets"]}
    for container in secrets_by_place:
        places.setdefault(container, {"container": container})
    result: dict = {"changed": False, "targets": {}}
    diffs = []
    for container, target in places.items():
        request = {
            "op": "apply",
            "check_mode": module.check_mode,
            "diff": module._diff,
            "user": target.get("user"),
            "directories": target.get("directories") or [],
            "files": list(target.get("files") or []) + secrets_by_place.get(container, []),
            "units": target.get("units") or [],
            "health_urls": target.get("health_urls") or {},
            "enable": target.get("enable", True),
            "start": target.get("start", True),
            "start_timeout": module.params["start_timeout"],
            **{
                key: module.params[key]
                for key in ("secrets_file", "state_dir", "desired_dir", "supervisor", "supervisor_root")
            },
        }
        key = "host" if container is None else str(container)
        res = run_agent(request, container, module.params["pct"])
        for entry in res.get("files", []):
            if "diff" in entry:
                diff = entry.pop("diff")
                if container is not None:
                    diff["before_header"] = diff["after_header"] = f"CT {container}:{entry['path']}"
                diffs.append(diff)
        result["targets"][key] = res
        result["changed"] = result["changed"] or bool(res.get("changed"))
        if res.get("failed"):
            module.fail_json(msg=f"{key}: {res.get('msg')}", **result)
    if diffs:
        result["diff"] = diffs
    module.exit_json(**result)


if __name__ == "__main__":
    main()
