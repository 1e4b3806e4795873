# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Action sglang_ops.fleet.host_lock: the run's identity is known on the controller, the lease
is kept on the host (plugins/modules/host_lock.py, where the documentation is)."""

from __future__ import annotations

from typing import Any

from ansible.plugins.action import ActionBase

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._run_identity import (
    controller_identity,
    holder_is_dead_here,
)

ARGUMENT_SPEC: dict[str, Any] = {
    "state": {"type": "str", "choices": ["acquired", "released"], "default": "acquired"},
    "ttl": {"type": "int", "default": 1800},
}
MODULE = "sglang_ops.fleet.host_lock"


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = True
    _supports_check_mode = True

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result: dict[str, Any] = super().run(tmp, task_vars)
        _validation, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        if args["ttl"] <= 0:
            return {**result, "failed": True, "msg": "ttl must be > 0"}
        identity = controller_identity(args["ttl"])
        module_args = {"state": args["state"], "identity": identity}
        res = self._execute_module(module_name=MODULE, module_args=module_args, task_vars=task_vars)
        holder = res.get("holder") or {}
        if res.get("failed") and holder.get("run_id") and holder_is_dead_here(holder):
            # The holder ran on this controller and its process is gone: its lease was left
            # behind by a dead run. Take it over now rather than after its TTL.
            retry = dict(module_args, take_over=holder["run_id"])
            res = self._execute_module(module_name=MODULE, module_args=retry, task_vars=task_vars)
        result.update(res)
        if res.get("failed"):
            result["msg"] = f"{res.get('msg')}; nothing was touched on this host"
            return result
        if args["state"] == "acquired" and res.get("lock"):
            result["ansible_facts"] = {"sglang_fleet_lock": res["lock"]}
        if res.get("took_over"):
            prev = res["took_over"]
            result.setdefault("warnings", []).append(
                f"took over the host lock left by run {prev.get('run_id')} (user {prev.get('user')} on "
                f"{prev.get('controller')}, started {prev.get('started_at')}): its process is gone or its lease expired"
            )
        return result
