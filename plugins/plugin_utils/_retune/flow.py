# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Controller-side flow of a retune: inspect, decide, plan waves, run the phases, roll back.

Nothing here talks to a host directly: the phases are run through a ``PhaseRunner`` callable
(one module execution per host per phase, provided by the action plugin), so the whole flow is
unit-tested with a fake runner. A runner whose call goes unanswered past its bound raises
:class:`HostLost`: the host's retune ends there, with no further call to it. The decision per
instance is :mod:`_retune.decide`; the per-instance records and the host's report are
:mod:`_retune.record`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.model_facts import JOURNAL_PATTERN
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.clients import ClientsUnknown, RetuneClients
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.decide import (
    Decision,
    decide,
    unhealthy_words,
    unless_evidence_broken,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.fit import (
    journal_request,
    predictions,
    refuse_unfit,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.options import Options
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.record import (
    FAILED,
    LOST_AFTER,
    RELAUNCHED,
    SKIPPED,
    STARTED,
    UNCHANGED,
    UNHEALTHY,
    blocked_msg,
    clients_in_the_way,
    host_report,
    initial_result,
    lost_words,
    record_lost,
    record_no_last_good,
    record_relaunch_failed,
    record_release,
    record_rollback,
    record_start,
    record_stop,
    state_words,
)

PhaseRunner = Callable[[str, list[dict[str, Any]], dict[str, Any]], dict[str, Any]]


class PhaseError(Exception):
    """A phase could not run at all (host unreachable, module failure): no evidence."""

    def __init__(self, op: str, msg: str, result: Mapping[str, Any] | None = None):
        self.op = op
        self.result = dict(result or {})
        super().__init__(f"{op} phase failed: {msg}")


class HostLost(Exception):
    """The host did not answer a call within its bound: the deadline of what the call asked for
    (_retune.options.call_deadline) plus the margin (call_margin). A frozen host (kernel hang,
    network partition) cannot keep its own deadlines; the controller gives it up, and makes no
    further call to it in this retune (one would hang too)."""

    def __init__(
        self, op: str, deadline_s: float, margin_s: float, waited_s: float | None = None, why: str | None = None
    ):
        self.op = op
        self.deadline_s = deadline_s
        self.margin_s = margin_s
        self.waited_s = waited_s
        # Why, when the connection itself gave up before the bound (ssh's keep-alives).
        self.why = why
        super().__init__(why or f"no answer to the {op} phase within {deadline_s + margin_s:.0f}s")


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


class Retune:
    """One host's retune: inspect, decide, then per wave stop → release → start, with rollback;
    around each wave the generation clients drain and resume its endpoints (_retune.clients)."""

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
        # Once the host is lost: the call that went unanswered (op, instances, options, rollback).
        self.lost: HostLost | None = None
        self.in_flight: tuple[str, list[str], dict[str, Any], bool] = ("", [], {}, False)
        self.rolling_back = False

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
        result = self._call(op, payload, options)
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
                consequence = "not stopped, still running as it was" if op == "stop" else state_words(state)
            for name in names:
                self.results[name].update(action=FAILED, state=state, msg=f"{exc}: {consequence}")
            return None

    def _client_phase(self, op: str, names: list[str], extra: dict[str, Any]) -> dict[str, Any]:
        """A generation client operation (on the host itself); its result as it came back."""
        return self._call(op, [dict(self.instances[n]) for n in names], {**self.opts.agent, **extra})

    def _call(self, op: str, payload: list[dict[str, Any]], options: dict[str, Any]) -> dict[str, Any]:
        """One call to the host. Once the host is lost none is made: HostLost again, at once (the
        clients' resume and start in the flow's ``finally`` clauses would hang too)."""
        if self.lost is not None:
            raise self.lost
        self.round_trips[op] = self.round_trips.get(op, 0) + 1
        try:
            return self.run_phase(op, payload, options)
        except HostLost as lost:
            self.lost = lost
            self.in_flight = (op, [i["name"] for i in payload], options, self.rolling_back)
            raise

    # -- flow ---------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            return self._run(t0)
        except HostLost:
            return self._lost(t0)

    def _run(self, t0: float) -> dict[str, Any]:
        try:
            # The inspect phase also reads the startup journal lines (op_observe's reader) of each
            # running instance (check mode) or of those whose settings change (a real run): the model
            # facts of the predicted capacity, and of the fit pre-flight (_retune.fit).
            journal = {"startup_journal": journal_request(self.check_mode), "journal_pattern": JOURNAL_PATTERN}
            inspected = self._phase("inspect", self.order, journal)
        except PhaseError as exc:
            return self._final(t0, failed_msg=f"{exc}; nothing was changed")
        facts = inspected["instances"]
        decisions = {
            n: decide(self.instances[n], facts.get(n, {"failed": True, "msg": "not inspected"}), self.check_mode)
            for n in self.order
        }
        for n, d in decisions.items():
            if d.action == UNHEALTHY and (self.opts.force or self.opts.relaunch_wedged):
                asked = "sglang_retune_relaunch_wedged" if self.opts.relaunch_wedged else "sglang_retune_force"
                d.action = "relaunch"
                d.reasons = [
                    unhealthy_words(d.wedged),
                    f"settings already desired; relaunched as asked ({asked})",
                ]
            elif d.action == UNCHANGED and self.opts.force:
                d.action, d.reasons = "relaunch", ["forced", *d.reasons]
                decisions[n] = unless_evidence_broken(d, facts.get(n, {}))
        # Fit pre-flight: new settings SGLang would refuse at start block the host before any stop.
        predicted = predictions(self.instances, inspected, decisions, self.check_mode)
        refuse_unfit(self.instances, facts, decisions, predicted, self.opts.ignore_fit_prediction)
        for name in self.order:
            self.results[name] = initial_result(
                name, self.instances[name], facts.get(name, {}), decisions[name], self.check_mode
            )
            self.results[name].update(predicted.get(name) or {})
        blocked = [n for n in self.order if decisions[n].action == "blocked"]
        if self.check_mode:
            return self._final(t0, failed_msg=blocked_msg(self.results, blocked) if blocked else None)
        if blocked:
            # Bad evidence or something foreign in the way: touch nothing on this host. (A wedged
            # instance is not blocked: it is relaunched, or named unhealthy, and the others go on.)
            for name in self.order:
                if name not in blocked and decisions[name].action != UNCHANGED:
                    self.results[name].update(
                        action=SKIPPED, msg="not touched: another instance of the host is blocked"
                    )
            return self._final(t0, failed_msg=blocked_msg(self.results, blocked))
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
        refused = self._clients_refuse(self.clients, to_change)
        if refused:
            return self._final(t0, failed_msg=refused)
        try:
            failed_msg = self._run_waves(waves, decisions)
        finally:
            # Whatever happened (a failed wave, a phase that raised): the clients stopped run again.
            self.clients.start_stopped()
        return self._final(t0, failed_msg=failed_msg)

    def _clients_refuse(self, clients: RetuneClients, to_change: list[str]) -> str | None:
        """Find the generation clients out; why nothing may be touched (the instances to change
        skipped), or None: the clients could not be found out, or one could not reach a relaunched
        server (its own API key is not the servers')."""
        try:
            clients.discover(self.order, to_change)
        except ClientsUnknown as exc:
            skipped = "the generation clients of the host could not be found out"
            why = f"the generation clients could not be found out ({exc})"
        else:
            refusals = clients.key_refusals()
            if not refusals:
                return None
            skipped, why = "a generation client could not reach it after its relaunch", "; ".join(refusals)
        for name in to_change:
            self.results[name].update(action=SKIPPED, msg=f"not touched: {skipped}")
        return f"{why}; nothing was changed"

    def _run_waves(self, waves: list[list[str]], decisions: Mapping[str, Decision]) -> str | None:
        """The waves in order, until one fails; returns why the retune stopped, if it did."""
        if self.clients is None:
            raise AssertionError("the clients are known in this phase")
        unstoppable = self.clients.stop_undrained()
        if unstoppable:
            msg = clients_in_the_way(unstoppable)
            for name in (n for wave in waves for n in wave):
                self.results[name].update(action=SKIPPED, msg=msg)
            return f"{msg}; no instance was touched"
        for index, wave in enumerate(waves):
            ok = self._run_wave(wave, decisions)
            lost = self.clients.lost()
            if not ok or lost:
                held = (
                    "not touched: an earlier wave failed; still running as it was"
                    if not ok
                    else "not touched: the generation client did not take back an earlier wave; still running as it was"
                )
                for later in waves[index + 1 :]:
                    for name in later:
                        self.results[name].update(action=SKIPPED, msg=held)
                failed = [
                    f"{n}: {self.results[n].get('msg')}"
                    for n in wave
                    if self.results[n]["action"] not in (RELAUNCHED, STARTED)
                ]
                return "; ".join(
                    (["retune stopped after a failed wave: " + "; ".join(failed)] if failed else [])
                    + [f"retune stopped, as {words}" for words in lost]
                )
        return None

    def _run_wave(self, wave: list[str], decisions: Mapping[str, Decision]) -> bool:
        """Drain the wave's endpoints in the clients, stop → release → start (rollback), then
        resume the endpoints whatever happened."""
        if self.clients is None:
            raise AssertionError("the clients are known in this phase")
        unstoppable = self.clients.drain(wave)
        try:
            if unstoppable:
                for name in wave:
                    self.results[name].update(action=SKIPPED, msg=clients_in_the_way(unstoppable))
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
                record_relaunch_failed(self.results[name])
        return not failed and len(stopped) == len(wave)

    def _stop_and_release(self, names: list[str], rollback: bool = False) -> list[str]:
        """Stop, prove dead, prove GPU memory free. Returns the instances ready to start; the
        others are failed closed (never relaunched blindly). A wedged instance is stopped
        without waiting for a drain (the agent's stop); the new process of a rollback is not."""
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
            per_instance=lambda n: {"wedged": bool(self.results[n].get("wedged")) and not rollback},
        )
        if stop is None:
            return []
        dead = []
        for name in names:
            if record_stop(self.results[name], stop.get(name, {})):
                dead.append(name)
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
            if record_release(self.results[name], release.get(name, {})):
                ready.append(name)
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
        if resume and self.clients is not None:
            extra.update(resume_clients=dict(resume), **self.clients.hand_back(names))
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
            if record_start(self.results[name], start.get(name, {}), rollback):
                healthy.append(name)
        return healthy

    def _rollback(self, names: list[str]) -> None:
        can = [n for n in names if self.results[n].get("has_last_good")]
        for name in names:
            if name not in can:
                record_no_last_good(self.results[name])
        if not can:
            return
        why = {n: self.results[n].get("msg") for n in can}
        self.rolling_back = True
        try:
            stopped = self._stop_and_release(can, rollback=True)
            healthy = set(self._start(stopped, rollback=True))
        finally:
            self.rolling_back = False
        for name in can:
            record_rollback(self.results[name], name in healthy, why[name])

    # -- results ------------------------------------------------------------------------------

    def _lost(self, t0: float) -> dict[str, Any]:
        """The host's report once it stopped answering: what each instance was known to be when the
        call went unanswered, what the clients are left with, and what to do next."""
        if self.lost is None:
            raise AssertionError("only once the host is lost")
        lost = self.lost
        op, names, options, rollback = self.in_flight
        during = f"the {op} phase" + (f" of {', '.join(names)}" if names else "")
        for name in self.order:
            if name in self.results:
                record_lost(self.results[name], op, name in names, rollback, during)
        headline = lost_words(op, names, lost.deadline_s, lost.margin_s, lost.why, lost.waited_s)
        said = [headline, *self._lost_client_notes(op, options), LOST_AFTER]
        by_words: dict[str, list[str]] = {}
        for name in names:
            words = self.results.get(name, {}).get("host_lost")
            if words:
                by_words.setdefault(words, []).append(name)
        known = [f"{', '.join(alike)}: {words}" for words, alike in by_words.items()]
        result = self._final(t0, failed_msg="; ".join([headline, *known, LOST_AFTER]))
        # First among the host's notes: the summary table prints them in order.
        result["notes"] = said + list(result.get("notes") or [])
        result["host_lost"] = {
            "phase": op,
            "instances": names,
            "rollback": rollback,
            "deadline_s": lost.deadline_s,
            "margin_s": lost.margin_s,
            "bound_s": lost.deadline_s + lost.margin_s,
            "waited_s": lost.waited_s,
            "why": lost.why,
        }
        return result

    def _lost_client_notes(self, op: str, options: Mapping[str, Any]) -> list[str]:
        """The generation clients of a lost host: the drain no resume will end (it lapses by itself
        after its lease), the clients stopped that nothing will start again."""
        if self.clients is None:
            return []
        pending = {u: list(urls) for u, urls in self.clients.to_resume().items()}
        sent = options.get("clients") if op in ("drain", "resume") else options.get("resume_clients")
        for unit, urls in (sent or {}).items():
            pending.setdefault(unit, list(urls))
        notes = [
            f"client {unit}: the drain of {', '.join(urls)} is not resumed (the host was lost): it lapses by "
            f"itself {self.clients.lease:.0f}s after it began"
            for unit, urls in pending.items()
        ]
        for unit in (c.unit for c in self.clients.clients.values() if c.stopped_at is not None and not c.started):
            started = "its start was sent, not confirmed" if op == "client_start" else "NOT started again"
            notes.append(
                f"client {unit}: stopped for the retune, {started} (the host was lost): once the host answers, "
                f"systemctl start {unit} (a rerun leaves a stopped client alone)"
            )
        return notes

    def _final(self, t0: float, failed_msg: str | None) -> dict[str, Any]:
        """The host's report, from the records (:func:`_retune.record.host_report`)."""
        return host_report(
            [self.results[n] for n in self.order if n in self.results],
            elapsed=round(time.monotonic() - t0, 3),
            round_trips=self.round_trips,
            clients=self.clients,
            host_notes=self.host_notes,
            check_mode=self.check_mode,
            failed_msg=failed_msg,
        )
