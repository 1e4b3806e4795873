# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Controller-side logic of a retune: decide, plan waves, run the phases, roll back, report.

Nothing here talks to a host directly: the phases are run through a ``PhaseRunner`` callable
(one module execution per host per phase, provided by the action plugin), so the whole flow is
unit-tested with a fake runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.settings import (
    describe_server_info,
    differences,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune_clients import ClientsUnknown, RetuneClients
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune_options import Options
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune_predict import predict_after

UNCHANGED = "unchanged"
RELAUNCHED = "relaunched"
STARTED = "started"
ROLLED_BACK = "rolled_back"
FAILED = "failed"
SKIPPED = "skipped"
# Predictions in check mode.
WOULD_RELAUNCH = "would_relaunch"
WOULD_START = "would_start"

PhaseRunner = Callable[[str, list[dict[str, Any]], dict[str, Any]], dict[str, Any]]


class PhaseError(Exception):
    """A phase could not run at all (host unreachable, module failure): no evidence."""

    def __init__(self, op: str, msg: str, result: Mapping[str, Any] | None = None):
        self.op = op
        self.result = dict(result or {})
        super().__init__(f"{op} phase failed: {msg}")


@dataclass
class Decision:
    name: str
    action: str  # UNCHANGED, "relaunch", "start" or "blocked"
    reasons: list[str] = field(default_factory=list)
    flag_diff: dict[str, Any] = field(default_factory=dict)
    # Blocked only because the running server does not answer: ``force`` relaunches it anyway.
    forceable: bool = False


def decide(instance: Mapping[str, Any], facts: Mapping[str, Any], check_mode: bool) -> Decision:
    """Is this instance serving its desired settings? Unchanged means running, healthy and
    reporting the desired settings itself (its command line, its environment, its own
    /server_info), not merely an unchanged unit file."""
    name = instance["name"]
    if facts.get("failed"):
        return Decision(name, "blocked", [f"no usable evidence: {facts.get('msg')}"])
    foreign = facts.get("foreign") or []
    if foreign:
        return Decision(
            name,
            "blocked",
            [
                "a process that is not this instance's holds its GPU or port: "
                + "; ".join(f"PID {p['pid']} ({p['cmdline']}) {p['reason']}" for p in foreign)
            ],
        )
    if not check_mode and facts.get("installed_fingerprint") != instance.get("fingerprint"):
        return Decision(
            name,
            "blocked",
            [
                "the desired state installed on the host does not match the inventory "
                f"(installed {facts.get('installed_fingerprint')}, inventory {instance.get('fingerprint')}): "
                "apply the server role first (retune.yml does)"
            ],
        )
    if not facts.get("running"):
        state = f"{facts.get('active_state') or 'unknown'}/{facts.get('sub_state') or 'unknown'}"
        return _unless_evidence_broken(Decision(name, "start", [f"not running (unit {state})"]), facts)
    if facts.get("unanswered"):
        return Decision(
            name,
            "blocked",
            [
                "; ".join(facts["unanswered"])
                + ": its settings cannot be confirmed, so it is left as it is; to relaunch it anyway, "
                "set sglang_retune_force=true (and sglang_retune_only to name it)"
            ],
            forceable=True,
        )
    reasons: list[str] = []
    # The inspected facts are the running evidence: the host's verdicts on the command line and
    # environment it read (they hold secrets and never leave it), the user, and /server_info.
    answered = facts.get("server_info_status") == 200
    found = differences(instance, {**facts, "server_info": (facts.get("server_info") or {}) if answered else None})
    diff: dict[str, Any] = found["flag_diff"] or {}
    if facts.get("health_status") != 200:
        reasons.append(f"unhealthy: /health answered {facts.get('health_status') or facts.get('health_error')}")
    if found["flag_diff"] is not None:
        reasons.append("command line differs: " + describe_flag_diff(diff))
    if found["env"]:
        reasons.append(
            "environment differs: "
            + ", ".join(f"{k}={v['running']!r}→{v['expected']!r}" for k, v in found["env"].items())
        )
    if found["user"]:
        reasons.append(f"runs as {found['user']['running']}, desired {found['user']['expected']}")
    if not answered:
        reasons.append(
            f"cannot confirm its settings: /server_info answered {facts.get('server_info_status')} "
            f"({facts.get('server_info_error')})"
        )
    elif found["server_info"]:
        reasons.append(describe_server_info(found["server_info"], "desired"))
    if reasons:
        return _unless_evidence_broken(Decision(name, "relaunch", reasons, diff), facts)
    return Decision(name, UNCHANGED, [])


def _unless_evidence_broken(decision: Decision, facts: Mapping[str, Any]) -> Decision:
    """An instance to stop or start is blocked, while it still serves, when a source of evidence
    the later proofs need (nvidia-smi, /proc, the unit's cgroup) did not answer correctly: once
    stopped it could not be proven dead or its GPU free, and would be left down."""
    errors = facts.get("evidence_errors") or []
    if not errors:
        return decision
    return Decision(
        decision.name,
        "blocked",
        [f"evidence the retune needs is broken, so nothing is stopped: {e.get('msg')}" for e in errors]
        + [f"(would {decision.action}: {'; '.join(decision.reasons)})"],
        decision.flag_diff,
    )


def flag_changes(diff: Mapping[str, Any], arrow: str = "→") -> str:
    """A flag diff in one line (``--flag old→new, +--added value, -removed``); empty if none."""
    parts = [f"{k} {v[0]}{arrow}{v[1]}" for k, v in diff.get("changed", {}).items()]
    parts += [f"+{k} {v}" if v is not True else f"+{k}" for k, v in diff.get("added", {}).items()]
    parts += [f"-{k}" for k in diff.get("removed", {})]
    return ", ".join(parts)


def describe_flag_diff(diff: Mapping[str, Any]) -> str:
    return flag_changes(diff) or "(same flags, other words)"


def plan_waves(names: list[str], canary: bool | str, wave_size: int) -> list[list[str]]:
    """The canary alone first (the named instance, or the first to change), then waves of
    ``wave_size`` (0: all the rest at once)."""
    rest = list(names)
    if not rest:
        return []
    waves: list[list[str]] = []
    if canary:
        first = canary if isinstance(canary, str) and canary in rest else rest[0]
        rest.remove(first)
        waves.append([first])
    size = wave_size if wave_size > 0 else max(len(rest), 1)
    waves += [rest[i : i + size] for i in range(0, len(rest), size)]
    return waves


def _clients_in_the_way(units: list[str]) -> str:
    return (
        f"not touched: generation client(s) {', '.join(units)} may send to it and could not be stopped; "
        "still running as it was"
    )


def _state_words(state: str) -> str:
    if state == "unverified":
        return "instance is UP but NOT VERIFIED (serving settings that failed their checks)"
    return "instance is DOWN"


def mib(values: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(values or {})


class Retune:
    """One host's retune: inspect, decide, then per wave stop → release → start, with rollback;
    around each wave the generation clients drain and resume its endpoints (_retune_clients)."""

    def __init__(self, instances: list[dict[str, Any]], options: Options, run_phase: PhaseRunner, check_mode: bool):
        self.instances = {i["name"]: i for i in instances}
        self.order = [i["name"] for i in instances]
        self.opts = options
        self.run_phase = run_phase
        self.check_mode = check_mode
        self.results: dict[str, dict[str, Any]] = {}
        self.round_trips: dict[str, int] = {}
        self.host_notes: list[str] = []
        self.clients: RetuneClients | None = None

    # -- phases -------------------------------------------------------------------------------

    def _phase(
        self,
        op: str,
        names: list[str],
        extra: dict[str, Any] | None = None,
        per_instance: Callable[[str], dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        payload = []
        for name in names:
            inst = dict(self.instances[name])
            if per_instance:
                inst.update(per_instance(name))
            payload.append(inst)
        options = {**self.opts.agent, **(extra or {})}
        self.round_trips[op] = self.round_trips.get(op, 0) + 1
        result = self.run_phase(op, payload, options)
        if result.get("unreachable") or ("instances" not in result):
            raise PhaseError(op, result.get("msg", "no result"), result)
        return result

    def _phase_or_fail(
        self,
        op: str,
        names: list[str],
        extra: dict[str, Any],
        state: str,
        consequence: str,
        per_instance: Callable[[str], dict[str, Any]] | None = None,
        on_result: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> dict[str, Any] | None:
        """A phase's per-instance results (``on_result`` sees the whole result); if the phase could
        not run at all, every instance in it fails with ``state`` and the consequence spelled out,
        and None is returned."""
        try:
            result = self._phase(op, names, extra, per_instance)
            if on_result is not None:
                on_result(result)
            return dict(result["instances"])
        except PhaseError as exc:
            if exc.result.get("lock_error"):
                # Refused before it acted (another run holds the host): nothing changed in this
                # phase, so an instance not yet stopped still runs as it was.
                state = "running" if op == "stop" else "down"
                consequence = "not stopped, still running as it was" if op == "stop" else _state_words(state)
            for name in names:
                self.results[name].update(action=FAILED, state=state, msg=f"{exc}: {consequence}")
            return None

    def _client_phase(self, op: str, names: list[str], extra: dict[str, Any]) -> dict[str, Any]:
        """A generation client operation (on the host itself); its result as it came back."""
        self.round_trips[op] = self.round_trips.get(op, 0) + 1
        return self.run_phase(op, [dict(self.instances[n]) for n in names], {**self.opts.agent, **extra})

    # -- flow ---------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            # In check mode the inspect phase also reads each running instance's startup journal
            # lines (op_observe's reader): the model facts of the predicted capacity.
            inspected = self._phase("inspect", self.order, {"startup_journal": True} if self.check_mode else None)
        except PhaseError as exc:
            return self._final(t0, failed_msg=f"{exc}; nothing was changed")
        facts = inspected["instances"]
        decisions = {
            n: decide(self.instances[n], facts.get(n, {"failed": True, "msg": "not inspected"}), self.check_mode)
            for n in self.order
        }
        if self.opts.force:
            for n, d in decisions.items():
                if d.action == UNCHANGED or d.forceable:
                    d.action, d.reasons = "relaunch", ["forced", *d.reasons]
                    decisions[n] = _unless_evidence_broken(d, facts.get(n, {}))
        for name in self.order:
            self.results[name] = self._initial_result(name, facts.get(name, {}), decisions[name])
        blocked = [n for n in self.order if decisions[n].action == "blocked"]
        if self.check_mode:
            self._predict(facts, inspected.get("gpus") or {})
            return self._final(t0, failed_msg=self._blocked_msg(blocked) if blocked else None)
        if blocked:
            # Bad evidence or something foreign in the way: touch nothing on this host.
            for name in self.order:
                if name not in blocked and decisions[name].action != UNCHANGED:
                    self.results[name].update(
                        action=SKIPPED, msg="not touched: another instance of the host is blocked"
                    )
            return self._final(t0, failed_msg=self._blocked_msg(blocked))
        to_record = [n for n in self.order if decisions[n].action == UNCHANGED and not facts[n].get("has_last_good")]
        if to_record:
            try:
                self._phase("record", to_record)
                for name in to_record:
                    self.results[name]["recorded_last_good"] = True
            except PhaseError as exc:
                self.host_notes.append(f"could not record last good settings: {exc}")
        to_change = [n for n in self.order if decisions[n].action in ("relaunch", "start")]
        waves = plan_waves(to_change, self.opts.canary, self.opts.wave_size)
        if not waves:
            return self._final(t0, failed_msg=None)
        self.clients = RetuneClients(self._client_phase, self.opts)
        try:
            self.clients.discover(self.order, to_change)
        except ClientsUnknown as exc:
            for name in to_change:
                self.results[name].update(
                    action=SKIPPED, msg="not touched: the generation clients of the host could not be found out"
                )
            why = f"the generation clients could not be found out ({exc}); nothing was changed"
            return self._final(t0, failed_msg=why)
        try:
            failed_msg = self._run_waves(waves, decisions)
        finally:
            # Whatever happened (a failed wave, a phase that raised): the clients stopped run again.
            self.clients.start_stopped()
        return self._final(t0, failed_msg=failed_msg)

    def _run_waves(self, waves: list[list[str]], decisions: Mapping[str, Decision]) -> str | None:
        """The waves in order, until one fails; returns why the retune stopped, if it did."""
        assert self.clients is not None
        unstoppable = self.clients.stop_undrained()
        if unstoppable:
            msg = _clients_in_the_way(unstoppable)
            for name in (n for wave in waves for n in wave):
                self.results[name].update(action=SKIPPED, msg=msg)
            return f"{msg}; no instance was touched"
        for index, wave in enumerate(waves):
            ok = self._run_wave(wave, decisions)
            if not ok:
                for later in waves[index + 1 :]:
                    for name in later:
                        self.results[name].update(
                            action=SKIPPED, msg="not touched: an earlier wave failed; still running as it was"
                        )
                return "retune stopped after a failed wave: " + "; ".join(
                    f"{n}: {self.results[n].get('msg')}"
                    for n in wave
                    if self.results[n]["action"] not in (RELAUNCHED, STARTED)
                )
        return None

    def _predict(self, facts: Mapping[str, Any], gpus: Mapping[str, Any]) -> None:
        """Check mode: the effective max running requests each instance that would be relaunched
        or started is predicted to get (``_retune_predict``), or why not in one word."""
        for name in self.order:
            result = self.results[name]
            if result["action"] not in (WOULD_RELAUNCH, WOULD_START):
                continue
            result.update(predict_after(self.instances[name], facts.get(name) or {}, gpus))

    def _blocked_msg(self, blocked: list[str]) -> str:
        return "failed closed, nothing changed on this host: " + "; ".join(
            f"{n}: {' '.join(self.results[n]['reasons'])}" for n in blocked
        )

    def _run_wave(self, wave: list[str], decisions: Mapping[str, Decision]) -> bool:
        """Drain the wave's endpoints in the clients, stop → release → start (rollback), then
        resume the endpoints whatever happened."""
        assert self.clients is not None
        unstoppable = self.clients.drain(wave)
        try:
            if unstoppable:
                for name in wave:
                    self.results[name].update(action=SKIPPED, msg=_clients_in_the_way(unstoppable))
                return False
            return self._relaunch_wave(wave, decisions)
        finally:
            self.clients.resume(wave)

    def _relaunch_wave(self, wave: list[str], decisions: Mapping[str, Decision]) -> bool:
        t0 = time.monotonic()
        stopped = self._stop_and_release(wave)
        if not stopped:
            return False
        # The whole wave ready to start, on the host itself (where the clients' sockets are): the
        # start phase hands its endpoints back to the clients as soon as every instance is healthy.
        on_host = all(self.instances[n].get("container") is None for n in wave)
        whole = len(stopped) == len(wave)
        resume = self.clients.to_resume() if self.clients is not None and whole and on_host else {}
        started = self._start(stopped, rollback=False, resume=resume)
        failed = [n for n in stopped if n not in started]
        for name in started:
            self.results[name]["action"] = STARTED if decisions[name].action == "start" else RELAUNCHED
            # Wall time, stop to proven health, round trips included: how long it did not serve.
            self.results[name]["relaunch_s"] = round(time.monotonic() - t0, 3)
        if failed and self.opts.rollback:
            self._rollback(failed)
        elif failed:
            for name in failed:
                r = self.results[name]
                r.update(
                    action=FAILED, msg=f"relaunch failed, rollback disabled: {r.get('msg')}: {_state_words(r['state'])}"
                )
        return not failed and len(stopped) == len(wave)

    def _stop_and_release(self, names: list[str]) -> list[str]:
        """Stop, prove dead, prove GPU memory free. Returns the instances ready to start; the
        others are failed closed (never relaunched blindly)."""
        stop = self._phase_or_fail(
            "stop",
            names,
            {
                "stop_timeout": self.opts.stop_timeout,
                "kill_timeout": self.opts.kill_timeout,
                # Processes in teardown after SIGKILL are waited for within the release deadline.
                "release_timeout": self.opts.release_timeout,
            },
            state="unknown",
            consequence="state unknown, not relaunched",
        )
        if stop is None:
            return []
        dead = []
        for name in names:
            res = stop.get(name, {})
            r = self.results[name]
            if r.get("time_to_dead_s") is None:  # keep the first (the relaunch), not the rollback's
                r["time_to_dead_s"] = res.get("time_to_dead_s")
            r["escalated"] = r.get("escalated", False) or bool(res.get("escalated"))
            if res.get("teardown_s"):
                r["teardown_s"] = res["teardown_s"]
            r["killed"] = r.get("killed", []) + list(res.get("killed", []))
            if res.get("dead"):
                dead.append(name)
            else:
                r.update(
                    action=FAILED,
                    state="down",
                    msg=f"not proven dead, not relaunched, instance is DOWN: {res.get('msg') or res}",
                )
                r["foreign"] = res.get("foreign", [])
        if not dead:
            return []
        release = self._phase_or_fail(
            "release",
            dead,
            {"release_timeout": self.opts.release_timeout, "threshold_mib": self.opts.release_threshold_mib},
            state="down",
            consequence="GPU memory not proven free, not relaunched, instance is DOWN",
        )
        if release is None:
            return []
        ready = []
        for name in dead:
            res = release.get(name, {})
            r = self.results[name]
            if r.get("time_to_release_s") is None:  # keep the first (the relaunch), not the rollback's
                r["time_to_release_s"] = res.get("time_to_release_s")
            r["gpu_memory_released_mib"] = mib(res.get("used_mib"))
            # What the GPUs still held once the processes were gone: the driver's late release.
            r.setdefault("gpu_memory_after_dead_mib", mib(res.get("used_mib_first")))
            r["release_polls"] = r.get("release_polls", 0) + int(res.get("samples") or 0)
            if res.get("released"):
                ready.append(name)
            else:
                r.update(
                    action=FAILED,
                    state="down",
                    msg=f"GPU memory not proven free, not relaunched, instance is DOWN: {res.get('msg')}",
                )
        return ready

    def _resumed_by_start(self, result: Mapping[str, Any]) -> None:
        if self.clients is not None:
            self.clients.resumed_by_start(((result.get("containers") or {}).get("host") or {}).get("resumed"))

    def _start(self, names: list[str], rollback: bool, resume: Mapping[str, list[str]] | None = None) -> list[str]:
        """Start and prove healthy; returns the instances that are. ``resume``: the clients'
        endpoints to hand back once all of them are (unit -> URLs)."""
        if not names:
            return []
        extra: dict[str, Any] = {
            "start_timeout": self.opts.start_timeout,
            "health_timeout": self.opts.health_timeout,
            "min_max_running_requests": None if rollback else self.opts.min_max_running_requests,
            "smoke_requests": self.opts.smoke_requests,
        }
        if resume:
            extra.update(resume_clients=dict(resume), by=f"sglang-fleet retune of {', '.join(names)}")
        start = self._phase_or_fail(
            "start",
            names,
            extra,
            state="unknown",
            consequence="state unknown",
            per_instance=lambda n: {
                "use_last_good": rollback,
                "old_main_pid": self.results[n].get("old_main_pid"),
                "old_invocation_id": self.results[n].get("old_invocation_id"),
            },
            on_result=self._resumed_by_start,
        )
        if start is None:
            return []
        healthy = []
        for name in names:
            res = start.get(name, {})
            r = self.results[name]
            key = "rollback" if rollback else "relaunch"
            r[key] = {
                k: v
                for k, v in res.items()
                if k in ("msg", "journal", "server_info_mismatches", "smoke", "argv_diff", "actions", "crashed")
            }
            if res.get("healthy"):
                healthy.append(name)
                r.update(
                    new_main_pid=res.get("new_main_pid"),
                    new_invocation_id=res.get("new_invocation_id"),
                    time_to_healthy_s=res.get("time_to_healthy_s"),
                    effective_max_running_requests_after=res.get("effective_max_running_requests"),
                    state="running",
                )
            else:
                r["msg"] = res.get("msg") or "not healthy"
                # Crashed or never started: down. Up but not proven (settings, smoke): unverified.
                r["state"] = "down" if res.get("crashed") or not res.get("started") else "unverified"
                r["new_main_pid"] = res.get("new_main_pid")
        return healthy

    def _rollback(self, names: list[str]) -> None:
        can = [n for n in names if self.results[n].get("has_last_good")]
        for name in names:
            if name not in can:
                r = self.results[name]
                r.update(
                    action=FAILED,
                    msg=f"relaunch failed ({r.get('msg')}) and no last good settings are recorded to roll back to: "
                    + _state_words(r["state"]),
                )
        if not can:
            return
        why = {n: self.results[n].get("msg") for n in can}
        stopped = self._stop_and_release(can)
        healthy = set(self._start(stopped, rollback=True))
        for name in can:
            r = self.results[name]
            if name in healthy:
                r.update(
                    action=ROLLED_BACK,
                    state="running",
                    msg=f"new settings failed ({why[name]}); rolled back to the last good settings, which are healthy",
                )
            else:
                rollback_msg = r.get("rollback", {}).get("msg") or r.get("msg")
                r.update(
                    action=FAILED,
                    state="down",
                    msg=f"new settings failed ({why[name]}) and the rollback failed too ({rollback_msg}): "
                    "instance is DOWN",
                )

    # -- results ------------------------------------------------------------------------------

    def _initial_result(self, name: str, facts: Mapping[str, Any], decision: Decision) -> dict[str, Any]:
        inst = self.instances[name]
        action = decision.action
        if self.check_mode:
            action = {"relaunch": WOULD_RELAUNCH, "start": WOULD_START}.get(action, action)
        if action == "blocked":
            action = FAILED
        return {
            "name": name,
            "unit": inst.get("unit"),
            "container": inst.get("container"),
            "port": inst.get("port"),
            "gpus": inst.get("gpus"),
            "action": action,
            "reasons": decision.reasons,
            "flag_diff": decision.flag_diff,
            "state": "running" if facts.get("running") else "stopped",
            "old_main_pid": facts.get("main_pid") or None,
            "old_invocation_id": facts.get("invocation_id") or None,
            "new_main_pid": None,
            "gpu_memory_before_mib": mib(facts.get("gpu_used_mib")),
            "effective_max_running_requests_before": facts.get("effective_max_running_requests"),
            "effective_max_running_requests_after": facts.get("effective_max_running_requests")
            if action == UNCHANGED
            else None,
            "time_to_dead_s": None,
            "time_to_release_s": None,
            "time_to_healthy_s": None,
            "relaunch_s": None,
            "has_last_good": bool(facts.get("has_last_good")),
            "running_argv": facts.get("argv"),
            "desired_argv": inst.get("argv"),
        }

    def _final(self, t0: float, failed_msg: str | None) -> dict[str, Any]:
        instances = [self.results[n] for n in self.order if n in self.results]
        changed_actions = {RELAUNCHED, STARTED, ROLLED_BACK, WOULD_RELAUNCH, WOULD_START}
        touched = {RELAUNCHED, STARTED, ROLLED_BACK, FAILED}
        changed = any(r["action"] in changed_actions for r in instances) or any(
            r["action"] == FAILED and r.get("state") in ("down", "unknown") for r in instances
        )
        result: dict[str, Any] = {
            "changed": changed,
            "elapsed": round(time.monotonic() - t0, 3),
            "instances": instances,
            "round_trips": dict(self.round_trips),
            "summary": {
                action: sorted(r["name"] for r in instances if r["action"] == action)
                for action in sorted({r["action"] for r in instances})
            },
        }
        down = [r["name"] for r in instances if r.get("state") in ("down", "unknown") and r["action"] in touched]
        if down:
            result["down"] = down
        unverified = [r["name"] for r in instances if r.get("state") == "unverified"]
        if unverified:
            result["unverified"] = unverified
        clients = self.clients
        result["clients"] = clients.report() if clients else []
        result["clients_stopped"] = clients.stopped() if clients else []
        notes = (clients.notes() if clients else []) + self.host_notes
        if notes:
            result["notes"] = notes
        not_started = clients.start_failures() if clients else {}
        if not_started:
            # The generation stopped on this host and stays stopped: a failure of the host.
            also = "generation client(s) NOT started again after the retune: " + "; ".join(
                f"{u} ({why})" for u, why in not_started.items()
            )
            failed_msg = f"{failed_msg}; {also}" if failed_msg else also
        if failed_msg:
            result["failed"] = True
            result["msg"] = failed_msg + (f" — DOWN: {', '.join(down)}" if down else "")
        elif any(r["action"] in (FAILED, ROLLED_BACK) for r in instances):
            result["failed"] = True
            result["msg"] = "; ".join(
                f"{r['name']}: {r.get('msg')}" for r in instances if r["action"] in (FAILED, ROLLED_BACK)
            )
        else:
            result["msg"] = self._ok_msg(instances)
        if self.check_mode:
            result["diff"] = [
                {
                    "before_header": f"{r['name']} (running)",
                    "after_header": f"{r['name']} (desired)",
                    "before": "\n".join(r.get("running_argv") or []) + "\n",
                    "after": "\n".join(r.get("desired_argv") or []) + "\n",
                }
                for r in instances
                if r["action"] in (WOULD_RELAUNCH, WOULD_START)
            ]
        return result

    @staticmethod
    def _ok_msg(instances: list[dict[str, Any]]) -> str:
        counts: dict[str, int] = {}
        for r in instances:
            counts[r["action"]] = counts.get(r["action"], 0) + 1
        return ", ".join(f"{n} {a}" for a, n in sorted(counts.items())) or "no instances"
