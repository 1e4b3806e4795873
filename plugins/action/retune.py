# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Action plugin sglang_ops.fleet.retune: kill, prove dead, prove GPU memory free, relaunch,
prove healthy; idempotent, check and diff mode, canary then waves, rollback; the generation
clients drained per wave (or stopped for the retune when they do not answer). Every call to the
host is bounded on the controller (a host that stops answering is lost, not waited for)."""

from __future__ import annotations

import time
from typing import Any

from ansible.errors import AnsibleConnectionFailure
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.bounded import CallTimedOut, bounded, reap
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.flow import HostLost, Retune
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.options import (
    ARGUMENT_SPEC,
    Options,
    call_deadline,
)

display = Display()


PHASE_MODULE = "sglang_ops.fleet.retune_phase"
# Seconds for the connection's close once its host is lost (a local operation: nothing is sent).
CLOSE_BOUND = 10.0


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
            # A frozen host cannot keep its own deadlines: the controller keeps them.
            deadline = call_deadline(op, phase_options)
            display.vvv(
                f"retune: {op} on {[i['name'] for i in phase_instances]}, bound {deadline + options.call_margin:.0f}s",
                host=task_vars.get("inventory_hostname"),
            )
            started = time.monotonic()
            try:
                with bounded(deadline + options.call_margin):
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
            except CallTimedOut as timed_out:
                reap(timed_out.killed)
                self._drop_connection()
                raise HostLost(op, deadline, options.call_margin, round(time.monotonic() - started, 1)) from None
            except AnsibleConnectionFailure as exc:
                # The connection gave up first (ssh's keep-alives, its connect timeout): the host
                # did not answer either. Lost as well, rather than the task unreachable with no
                # report, after calls to the host from the flow's finally clauses.
                self._drop_connection()
                waited = round(time.monotonic() - started, 1)
                why = f"the connection failed ({str(exc).strip()[:300]})"
                raise HostLost(op, deadline, options.call_margin, waited, why=why) from None

        retune = Retune(instances, options, run_phase, check_mode=bool(self._task.check_mode))
        outcome = retune.run()
        result.update(outcome)
        if not self._task.diff:
            result.pop("diff", None)
        return result

    def _drop_connection(self) -> None:
        """Forget the connection to a lost host (its process is already killed): close it, within
        a bound of its own, never reset it (a reset would talk to the host)."""
        try:
            with bounded(CLOSE_BOUND):
                self._connection.close()
        except (CallTimedOut, Exception) as exc:  # the host is lost either way
            display.vvv(f"retune: closing the connection to a lost host: {exc!r}")


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
        "call_margin",
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
