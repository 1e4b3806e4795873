# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Action sglang_ops.fleet.host_lock: the run's identity is known on the controller, the lease
is kept on the host by sglang_ops.fleet.host_lock_lease (the documentation is in
plugins/modules/host_lock.py)."""

from __future__ import annotations

import time
from typing import Any

from ansible.plugins.action import ActionBase

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.options import BY_NAME
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.run_identity import (
    controller_identity,
    holder_is_dead_here,
)

ARGUMENT_SPEC: dict[str, Any] = {
    "state": {"type": "str", "choices": ["acquired", "released"], "default": "acquired"},
    # The retune's lock_ttl and lock_wait (the option table), under the names of this action.
    "ttl": BY_NAME["lock_ttl"].spec(),
    "wait": BY_NAME["lock_wait"].spec(),
}
MODULE = "sglang_ops.fleet.host_lock_lease"
# Seconds between two tries while a live run holds the lease and ``wait`` is not over.
WAIT_INTERVAL = 5.0


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
        if args["wait"] < 0:
            return {**result, "failed": True, "msg": "wait must be >= 0 (0: fail at once naming the holder)"}
        identity = controller_identity(args["ttl"])
        module_args = {"state": args["state"], "identity": identity}
        started = time.monotonic()
        deadline = started + (args["wait"] if args["state"] == "acquired" else 0)
        while True:
            res = self._call(module_args, task_vars)
            if not (res.get("failed") and (res.get("holder") or {}).get("run_id")):
                break
            # Held by another live run: try again until the lease is free or the wait is over.
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(WAIT_INTERVAL, remaining))
        result.update(res)
        if res.get("failed"):
            waited = f"; waited {time.monotonic() - started:.0f}s" if args["wait"] else ""
            result["msg"] = f"{res.get('msg')}{waited}; nothing was touched on this host"
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

    def _call(self, module_args: dict[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        res: dict[str, Any] = self._execute_module(module_name=MODULE, module_args=module_args, task_vars=task_vars)
        holder = res.get("holder") or {}
        if res.get("failed") and holder.get("run_id") and holder_is_dead_here(holder):
            # The holder ran on this controller and its process is gone: its lease was left
            # behind by a dead run. Take it over now rather than after its TTL.
            retry = dict(module_args, take_over=holder["run_id"])
            res = self._execute_module(module_name=MODULE, module_args=retry, task_vars=task_vars)
        return res
