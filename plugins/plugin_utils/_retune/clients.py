# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The generation clients during one host's retune.

A running client that answers on its control socket is *drained per wave*: before a wave's
instances are stopped, the client stops sending to exactly their endpoints (it finishes or
requeues their requests in flight elsewhere), and once the wave is over (relaunched, rolled back
or failed) it resumes them; the host's other instances keep generating. The client's word on each
resumed endpoint is the proof that the wave gave it back: one it took out of service (its API key
refused), that is down, or whose requests only fail since, is *lost*: the host fails, naming the
endpoint and the client's reason, and no later wave starts.

A client whose API key is its own (not the servers') and is not the servers' key cannot reach a
relaunched server: the retune refuses such a host before anything is stopped. A client that follows
the servers' key is handed it by the host agent with each resume (``client_keys``). A running client that
does not answer (no socket, timeout, error), or every running client when ``client_drain`` is
false, is *stopped* before the first wave and started again after the last, whatever happened. A
client whose drain fails falls back to that: stopped for the rest of the host's retune. A client
that is not running, or sends to none of the instances to change, is left alone.

Nothing here talks to the host: the agent's client operations (``clients``, ``drain``,
``resume``, ``client_stop``, ``client_start``) run through a ``ClientPhase`` callable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.options import Options

DRAINED = "drained"
STOPPED = "stopped"
NOT_RUNNING = "not running"
NOT_SENDING = "not sending here"

# Beyond the wave's own deadlines: round trips to the host, polls, the resume itself.
LEASE_MARGIN_S = 120.0

# (op, instance names, options) -> the phase's result: "clients" per unit, or, when the phase
# could not run at all, no "clients" and a "msg" saying why.
ClientPhase = Callable[[str, list[str], dict[str, Any]], dict[str, Any]]


class ClientsUnknown(Exception):
    """The clients of the host could not be found out: nothing may be touched."""


def drain_lease(opts: Options) -> float:
    """How long a wave's drain holds in the client unless resumed: the client's own wait for
    requests in flight, then the longest the wave can take - stop (SIGKILL after the stop deadline,
    then the kill wait), release, start with the model load and its verification requests - twice
    when a failed relaunch is rolled back, plus a margin. The drain outlives the wave, never the
    other way round; if the retune dies, the client resumes by itself when it lapses."""
    one_pass = opts.stop_timeout + 2 * opts.kill_timeout + opts.release_timeout + opts.start_timeout
    one_pass += opts.health_timeout * (2 + opts.smoke_requests)
    passes = 2 if opts.rollback else 1
    return round(opts.client_drain_timeout + passes * one_pass + LEASE_MARGIN_S, 1)


def _names(names: list[str]) -> str:
    return ", ".join(names)


@dataclass
class Client:
    unit: str
    socket: str
    mode: str
    why: str
    sends_to: dict[str, list[str]] = field(default_factory=dict)
    # How it gets its API key (the agent's client_keys.client_key): follows, matches.
    key: dict[str, Any] = field(default_factory=dict)
    # Endpoints it did not take back after their wave: instances, url, why (the client's words).
    lost: list[dict[str, Any]] = field(default_factory=list)
    # One entry per wave drained: instances, endpoints, waited_s, abandoned, resumed_capacity.
    waves: list[dict[str, Any]] = field(default_factory=list)
    # Stopped (or a stop tried): when, for how long, how it went.
    stopped_at: float | None = None
    stopped_s: float | None = None
    stop_error: str | None = None
    started: bool = False
    start_error: str | None = None
    # A drained client whose drain failed, and so was stopped: why.
    drain_error: str | None = None
    resume_errors: list[str] = field(default_factory=list)
    # Ended by itself during the retune (its job done), so nothing to drain or hand back: how it stood.
    ended: str | None = None

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "unit": self.unit,
            "mode": self.mode,
            "why": self.why,
            "sends_to": sorted(self.sends_to),
            "waves": [{k: v for k, v in w.items() if k != "endpoints"} for w in self.waves],
        }
        if self.stopped_at is not None:
            out.update(stopped_s=self.stopped_s, started_again=self.started)
        for key in ("stop_error", "start_error"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if self.resume_errors:
            out["resume_errors"] = list(self.resume_errors)
        if self.ended:
            out["ended"] = self.ended
        if self.lost:
            out["lost"] = [dict(x) for x in self.lost]
        return out

    def drained_waves(self) -> str:
        return "; ".join(
            f"{_names(w['instances'])}: {float(w.get('waited_s') or 0):.1f} s, {w.get('abandoned') or 0} abandoned"
            + (f", back in service in {w['back_s']:.1f} s" if w.get("back_s") is not None else "")
            for w in self.waves
        )

    def lost_words(self) -> str:
        return "; ".join(f"{x['url']} ({_names(x['instances'])}): {x['why']}" for x in self.lost)

    def note(self) -> str:
        """The client's line in the summary."""
        if self.mode == NOT_RUNNING:
            return f"client {self.unit}: not running ({self.why}), left alone"
        if self.mode == NOT_SENDING:
            return f"client {self.unit}: {self.why}, left alone"
        if self.mode == DRAINED:
            if self.lost:
                return (
                    f"client {self.unit}: drained per wave, never stopped, but did NOT take back "
                    f"{self.lost_words()} ({self.drained_waves()})"
                )
            if not self.waves:
                return f"client {self.unit}: drained per wave, never stopped (no wave reached its instances)"
            if self.ended:
                return (
                    f"client {self.unit}: drained per wave, never stopped ({self.drained_waves()}); it ended by "
                    f"itself during the retune ({self.ended}: its job done), nothing left to hand back"
                )
            return f"client {self.unit}: drained per wave, never stopped ({self.drained_waves()})"
        span = "for the rest of the retune" if self.drain_error is not None else "for the retune"
        if self.stop_error:
            what = f"could NOT be stopped ({self.stop_error})"
        else:
            took = f" ({self.stopped_s:.1f} s)" if self.stopped_s is not None else ""
            what = f"stopped {span}{took}"
        if self.started:
            what += ", running again after it" if self.stop_error else ", started again"
        elif self.start_error:
            what += f", NOT started again ({self.start_error})"
        if self.drain_error is not None and self.waves:
            what += f"; drained before: {self.drained_waves()}"
        if self.why.startswith("did not answer"):
            return f"client {self.unit} {self.why}: {what}"
        return f"client {self.unit}: {self.why}: {what}"


def _failure(op: str, result: Mapping[str, Any]) -> str | None:
    """Why a client phase could not run at all (None if it ran)."""
    if result.get("unreachable") or "clients" not in result:
        return f"{op} phase failed: {result.get('msg', 'no result')}"
    return None


def _answer(result: Mapping[str, Any], failure: str | None, unit: str, failed: dict[str, Any]) -> dict[str, Any]:
    """One client's answer in a phase's result; ``failed`` when the phase could not run."""
    if failure:
        return failed
    return dict(result["clients"].get(unit) or {})


class RetuneClients:
    """The generation clients of one host for one retune (see the module's docstring)."""

    def __init__(self, run_phase: ClientPhase, opts: Options, clock: Callable[[], float] = time.monotonic):
        self.run_phase = run_phase
        self.opts = opts
        self.clock = clock
        self.lease = drain_lease(opts)
        self.clients: dict[str, Client] = {}
        # Drained for the wave under way, to resume after it: unit -> the wave's entry.
        self._drained: dict[str, dict[str, Any]] = {}
        self.servers_key_set = False

    # -- discovery ----------------------------------------------------------------------------

    def discover(self, instances: list[str], to_change: list[str]) -> None:
        """Ask the host which clients run, which answer and where each sends. Raises
        ClientsUnknown when the host could not say."""
        if not self.opts.client_units:
            return
        result = self.run_phase(
            "clients", instances, {"client_units": list(self.opts.client_units), "client_keys": True}
        )
        failure = _failure("clients", result)
        if failure:
            raise ClientsUnknown(failure)
        changing = set(to_change)
        self.servers_key_set = bool(result.get("servers_key_set"))
        for unit in self.opts.client_units:
            found = result["clients"].get(unit) or {}
            sock = str(found.get("socket") or "its control socket")
            sends = {str(n): list(urls) for n, urls in (found.get("sends_to") or {}).items()}
            client = Client(unit=unit, socket=sock, mode=NOT_RUNNING, why="", sends_to=sends)
            client.key = dict(found.get("key") or {})
            self.clients[unit] = client
            if not found.get("running"):
                state = f"{found.get('active_state') or 'unknown'}/{found.get('sub_state') or 'unknown'}"
                client.why = "not installed" if found.get("load_state") == "not-found" else f"unit {state}"
            elif not self.opts.client_drain:
                client.mode, client.why = STOPPED, "sglang_retune_client_drain is false"
            elif not found.get("answered"):
                client.mode, client.why = STOPPED, f"did not answer on {sock} ({found.get('error') or 'no answer'})"
            elif not changing & set(sends):
                urls = [str(e.get("url")) for e in found.get("endpoints") or [] if isinstance(e, dict)]
                client.mode = NOT_SENDING
                client.why = f"sends to none of the instances retuned here ({_names(urls) or 'no endpoints'})"
            else:
                client.mode = DRAINED
                client.why = f"answers on {sock}, sends to {_names([n for n in to_change if n in sends])}"

    def key_refusals(self) -> list[str]:
        """The running clients that would be locked out of the relaunched servers: the servers
        require a key, and the client's own key (set apart from theirs) is not it. A client that
        did not answer may send anywhere; one that answered counts if it sends to a changed
        instance. Empty when the retune may go on."""
        if not self.servers_key_set:
            return []
        out = []
        for client in self.clients.values():
            if client.mode in (NOT_RUNNING, NOT_SENDING) or not client.key:
                continue
            if client.key.get("follows") or client.key.get("matches"):
                continue
            where = client.key.get("env_file") or "no environment file"
            out.append(
                f"generation client {client.unit} cannot get the servers' API key: its key is its own "
                f"(generation_api_key set apart from sglang_server_api_key, in {where}) and is not the servers' "
                "key, so every relaunched server would refuse it; let it follow the servers' key (leave "
                "generation_api_key unset) or give it theirs, deploy the generation role, then retune"
            )
        return out

    # -- stop and start -----------------------------------------------------------------------

    def stop_undrained(self) -> list[str]:
        """Before the first wave: stop the running clients that are not drained per wave. Returns
        those that could not be stopped (the instances they may send to must not be touched)."""
        return self._stop([c for c in self.clients.values() if c.mode == STOPPED and c.stopped_at is None])

    def _stop(self, clients: list[Client]) -> list[str]:
        if not clients:
            return []
        for client in clients:
            client.mode = STOPPED
            client.stopped_at = self.clock()
        result = self.run_phase("client_stop", [], {"client_units": [c.unit for c in clients]})
        failure = _failure("client_stop", result)
        failed = []
        for client in clients:
            res = _answer(result, failure, client.unit, {"stopped": False, "msg": failure})
            if not res.get("stopped"):
                client.stop_error = str(res.get("msg") or "no result")
                failed.append(client.unit)
        return failed

    def start_stopped(self) -> None:
        """After the last wave, whatever happened: start again every client stopped (or that a
        stop was tried on)."""
        clients = [c for c in self.clients.values() if c.stopped_at is not None and not c.started]
        if not clients:
            return
        result = self.run_phase("client_start", [], {"client_units": [c.unit for c in clients], "client_keys": True})
        failure = _failure("client_start", result)
        now = self.clock()
        for client in clients:
            res = _answer(result, failure, client.unit, {"started": False, "msg": failure})
            client.started = bool(res.get("started"))
            client.stopped_s = round(now - float(client.stopped_at or now), 1)
            if not client.started:
                client.start_error = str(res.get("msg") or "no result")

    # -- per wave -----------------------------------------------------------------------------

    def drain(self, wave: list[str]) -> list[str]:
        """Before a wave: drain its endpoints in each client drained per wave that sends there. A
        client whose drain fails is stopped for the rest of the retune. Returns the clients that
        could not be stopped either (the wave must not be touched)."""
        plan: dict[str, list[str]] = {}
        for client in self.clients.values():
            urls = [url for name in wave for url in client.sends_to.get(name, [])]
            if client.mode == DRAINED and urls and not client.ended:
                plan[client.unit] = list(dict.fromkeys(urls))
        if not plan:
            return []
        result = self.run_phase(
            "drain",
            wave,
            {
                "clients": plan,
                "client_drain_timeout": self.opts.client_drain_timeout,
                "lease": self.lease,
                "by": f"sglang-fleet retune of {_names(wave)}",
            },
        )
        failure = _failure("drain", result)
        fallback = []
        for unit, urls in plan.items():
            client = self.clients[unit]
            answer = _answer(result, failure, unit, {"ok": False, "error": failure})
            if answer.get("ok"):
                entry = {
                    "instances": [n for n in wave if n in client.sends_to],
                    "endpoints": urls,
                    "waited_s": answer.get("waited_s"),
                    "abandoned": answer.get("abandoned"),
                    "resumed_capacity": None,
                }
                client.waves.append(entry)
                self._drained[unit] = entry
            elif answer.get("ended"):
                client.ended = str(answer["ended"])
            else:
                client.drain_error = str(answer.get("error") or "no answer")
                client.why = f"drain of {_names(wave)} failed ({client.drain_error})"
                fallback.append(client)
        return self._stop(fallback)

    def to_resume(self) -> dict[str, list[str]]:
        """What the current wave drained, per client (unit -> endpoint URLs): the start phase
        resumes it as soon as the whole wave is healthy, in its own round trip."""
        return {unit: list(entry["endpoints"]) for unit, entry in self._drained.items()}

    def hand_back(self, wave: list[str]) -> dict[str, Any]:
        """What a resume of ``wave``'s endpoints carries, whether the start phase or a resume phase
        of its own hands them back: who asks, how long the clients are given for their word, and
        that the servers' key goes to the clients that follow it."""
        return {
            "by": f"sglang-fleet retune of {_names(wave)}",
            "client_confirm_timeout": self.opts.client_confirm_timeout,
            "client_keys": True,
        }

    def resumed_by_start(self, answers: Mapping[str, Any] | None) -> None:
        """Take the start phase's resume answers; what they did not resume, resume() still does."""
        for unit, answer in (answers or {}).items():
            entry = self._drained.get(unit)
            if entry is not None and isinstance(answer, Mapping) and answer.get("ok"):
                self._taken_back(unit, entry, answer)
                del self._drained[unit]

    def resume(self, wave: list[str]) -> None:
        """After a wave, whatever happened to it: resume what was drained for it and is not resumed
        yet (a failed or rolled back wave). A resume that fails leaves the endpoints lost (the
        client's lease ends the drain by itself, later)."""
        drained, self._drained = self._drained, {}
        if not drained:
            return
        plan = {unit: list(entry["endpoints"]) for unit, entry in drained.items()}
        result = self.run_phase("resume", wave, {"clients": plan, **self.hand_back(wave)})
        failure = _failure("resume", result)
        for unit, entry in drained.items():
            answer = _answer(result, failure, unit, {"ok": False, "error": failure})
            if answer.get("ok"):
                self._taken_back(unit, entry, answer)
            elif answer.get("ended"):
                self.clients[unit].ended = str(answer["ended"])
            else:
                why = f"resuming it failed ({answer.get('error') or 'no answer'})"
                self.clients[unit].resume_errors.append(
                    f"client {unit}: {why} for {_names(entry['instances'])}; "
                    f"its drain lapses by itself {self.lease:.0f} s after it began"
                )
                self._lose(unit, entry, dict.fromkeys(entry["endpoints"], why))

    def _taken_back(self, unit: str, entry: dict[str, Any], answer: Mapping[str, Any]) -> None:
        """A resume's answer: the capacity in force, and the client's word on each endpoint (an
        endpoint it says nothing of is not counted back: a client too old to confirm)."""
        entry["resumed_capacity"] = dict(answer.get("capacity") or {})
        service = answer.get("service")
        words = service if isinstance(service, Mapping) else {}
        lost: dict[str, str] = {}
        waited = []
        for url in entry["endpoints"]:
            word = words.get(url)
            if not isinstance(word, Mapping):
                lost[url] = "the client gave no word on it (redeploy the client with the generation role)"
            elif not word.get("in_service"):
                lost[url] = str(word.get("why") or "not in service")
            else:
                waited.append(float(word.get("waited_s") or 0.0))
        if waited and not lost:
            entry["back_s"] = max(waited)
        self._lose(unit, entry, lost)

    def _lose(self, unit: str, entry: dict[str, Any], lost: Mapping[str, str]) -> None:
        client = self.clients[unit]
        for url, why in lost.items():
            names = [n for n in entry["instances"] if url in client.sends_to.get(n, [])] or list(entry["instances"])
            client.lost.append({"instances": names, "url": url, "why": why})

    def lost(self) -> list[str]:
        """Each client that did not take back an endpoint of a wave, with which and why."""
        return [
            f"generation client {c.unit} did not take back {c.lost_words()}" for c in self.clients.values() if c.lost
        ]

    # -- report -------------------------------------------------------------------------------

    def report(self) -> list[dict[str, Any]]:
        return [c.report() for c in self.clients.values()]

    def notes(self) -> list[str]:
        out = []
        for client in self.clients.values():
            out.append(client.note())
            out += client.resume_errors
        return out

    def stopped(self) -> list[str]:
        """The clients stopped (or that a stop was tried on) during this retune."""
        return [c.unit for c in self.clients.values() if c.stopped_at is not None]

    def start_failures(self) -> dict[str, str]:
        return {c.unit: str(c.start_error) for c in self.clients.values() if c.start_error}
