# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Action plugin sglang_ops.fleet.retune: kill, prove dead, prove GPU memory free, relaunch,
prove healthy; idempotent, check and diff mode, canary then waves, rollback; the generation
clients drained per wave (or stopped for the retune when they do not answer)."""

from __future__ import annotations

from typing import Any

from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.flow import Retune
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.options import ARGUMENT_SPEC, Options

display = Display()


PHASE_MODULE = "sglang_ops.fleet.retune_phase"


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(ARGUMENT_SPEC)
    _requires_connection = True

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        del tmp
        _validation, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        problems = _check_args(args)
        if problems:
            result.update(failed=True, msg="invalid arguments: " + "; ".join(problems))
            return result
        instances = list(args["instances"])
        if args.get("only"):
            unknown = sorted(set(args["only"]) - {i["name"] for i in instances})
            if unknown:
                result.update(failed=True, msg=f"only: unknown instance(s) {unknown}")
                return result
            instances = [i for i in instances if i["name"] in args["only"]]
        options = Options.from_args(args)
        managed = [{"unit": i["unit"], "container": i.get("container")} for i in args["instances"]]
        # The run's host lock (sglang_ops.fleet.host_lock): every phase that acts proves it ours.
        lock_run_id = (task_vars.get("sglang_fleet_lock") or {}).get("run_id")

        def run_phase(op: str, phase_instances: list[dict[str, Any]], phase_options: dict[str, Any]) -> dict[str, Any]:
            display.vvv(
                f"retune: {op} on {[i['name'] for i in phase_instances]}", host=task_vars.get("inventory_hostname")
            )
            return self._execute_module(
                module_name=PHASE_MODULE,
                module_args={
                    "op": op,
                    "instances": phase_instances,
                    "options": phase_options,
                    "managed_units": managed,
                    "pct": args["pct"],
                    "lock_run_id": lock_run_id,
                },
                task_vars=task_vars,
            )

        retune = Retune(instances, options, run_phase, check_mode=bool(self._task.check_mode))
        outcome = retune.run()
        result.update(outcome)
        if not self._task.diff:
            result.pop("diff", None)
        return result


def _check_args(args: dict[str, Any]) -> list[str]:
    problems = []
    for key in (
        "stop_timeout",
        "kill_timeout",
        "release_timeout",
        "start_timeout",
        "health_timeout",
        "poll_interval",
        "nvidia_smi_timeout",
        "http_timeout",
        "client_drain_timeout",
    ):
        if args[key] <= 0:
            problems.append(f"{key} must be > 0")
    if args["client_confirm_timeout"] < 0:
        problems.append("client_confirm_timeout must be >= 0 (0: the client's word at once, without waiting)")
    if args["wave_size"] < 0:
        problems.append("wave_size must be >= 0 (0: all remaining instances in one wave)")
    if args["smoke_requests"] < 0:
        problems.append("smoke_requests must be >= 0")
    if not isinstance(args["canary"], (bool, str)):
        problems.append("canary must be a boolean or an instance name")
    names = [i.get("name") for i in args["instances"]]
    for i, inst in enumerate(args["instances"]):
        missing = [k for k in ("name", "unit", "gpus", "port", "argv", "fingerprint") if k not in inst]
        if missing:
            problems.append(
                f"instances[{i}] lacks {missing} (pass the resolved instances of sglang_ops.fleet.server_validate)"
            )
    if len(set(names)) != len(names):
        problems.append(f"instance names are not unique: {names}")
    if isinstance(args["canary"], str) and args["canary"] not in names:
        problems.append(f"canary {args['canary']!r} is not one of the instances {names}")
    return problems
