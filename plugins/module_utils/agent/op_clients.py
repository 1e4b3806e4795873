# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Operations on the generation clients of the host: ``clients`` (which run, which answer on
their control socket, which of the retune's instances each sends to, whether each has the servers'
API key or follows it), ``drain`` and ``resume`` (endpoints of one wave, through the control socket;
the resume hands the servers' key to a client that follows it and waits for the client's word that
each endpoint is back in service), ``client_stop`` and ``client_start`` (through the supervisor, for the clients
that do not answer; the start gives a following client the servers' key first)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Callable

from .client_keys import client_key, hand_over
from .clients import DRAIN_CALL_MARGIN, HELLO_TIMEOUT, RESUME_TIMEOUT, ClientError, sends_to
from .evidence import EvidenceError
from .host import Host, parallel
from .request import need
from .supervision import ended, stopped

# A client's stop drains its own requests and uploads its shard (its unit's TimeoutStopSec bounds
# it); the supervisor is given this long before the stop counts as failed.
CLIENT_STOP_TIMEOUT = 900.0
CLIENT_START_TIMEOUT = 120.0
RUNNING_STATES = ("active", "activating", "reloading")


def client_units(req: dict[str, Any]) -> list[str]:
    return [str(u) for u in need(req, "client_units") or []]


def op_clients(req: dict[str, Any], host: Host) -> dict[str, Any]:
    """Per client unit: its systemd state, its socket, its hello (endpoints), and which of the
    request's instances it sends to (same port, a host that is this one); with ``client_keys``,
    how each running one gets its API key (``client_keys.client_key``)."""
    units = client_units(req)
    instances = list(req.get("instances") or [])
    timeout = float(req.get("client_hello_timeout", HELLO_TIMEOUT))
    states = host.units(units) if units else {}
    out: dict[str, Any] = {}
    for unit in units:
        st = states.get(unit, {})
        path = host.client_socket(unit)
        active, sub = st.get("ActiveState", ""), st.get("SubState", "")
        entry: dict[str, Any] = {
            "unit": unit,
            "load_state": st.get("LoadState", ""),
            "active_state": active,
            "sub_state": sub,
            "main_pid": int(st.get("MainPID") or 0),
            # A finished job's client exits 0 and stays "active (exited)": nothing runs.
            "running": active in RUNNING_STATES and sub != "exited",
            "socket": path,
            "socket_exists": os.path.exists(path),
            "answered": False,
            "sends_to": {},
        }
        out[unit] = entry
        if not entry["running"]:
            continue
        if req.get("client_keys"):
            entry["key"] = client_key(host, unit)
        try:
            hello = host.client_call(unit, {"op": "hello"}, timeout)
        except ClientError as exc:
            entry["error"] = str(exc)
            continue
        endpoints = [e for e in hello.get("endpoints") or [] if isinstance(e, dict)]
        entry.update(
            answered=True,
            pid=hello.get("pid"),
            client_unit=hello.get("unit"),
            shard=hello.get("shard"),
            state=hello.get("state"),
            endpoints=endpoints,
            sends_to=sends_to(endpoints, instances, host.is_local_host),
        )
    return {"clients": out, "servers_key_set": bool(host.api_key)}


def clients_by_instance(req: dict[str, Any], host: Host) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """Per instance of ``req``: the endpoints of the running clients (``client_units``) that send to
    it, as each client's hello gives them (for the tuning advisor: what they send after a
    relaunch); and a line for each running client that did not answer."""
    found = op_clients(req, host)["clients"]
    out: dict[str, list[dict[str, Any]]] = {str(i["name"]): [] for i in req.get("instances") or []}
    problems = []
    for unit, entry in found.items():
        if entry["running"] and not entry["answered"]:
            problems.append(
                f"generation client {unit} runs but did not answer on its control socket: {entry.get('error')}"
            )
            continue
        by_url = {str(e.get("url")): e for e in entry.get("endpoints") or []}
        for name, urls in (entry.get("sends_to") or {}).items():
            for url in urls:
                endpoint = by_url.get(url) or {}
                out.setdefault(str(name), []).append(
                    {
                        "unit": unit,
                        "url": url,
                        **{k: endpoint.get(k) for k in ("follows_server", "factor", "capacity", "in_flight")},
                    }
                )
    return out, problems


def _socket_op(
    req: dict[str, Any],
    host: Host,
    op: str,
    timeout: float,
    extra: dict[str, Any],
    per_client: Callable[[str], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``op`` on each client of ``req["clients"]`` (unit -> endpoint URLs), at once, with ``extra``
    and what ``per_client(unit)`` adds: per client ``{"ok": true, **answer}`` or ``{"ok": false,
    "error": why}``, with ``ended`` when the client no longer answers because it ended by itself
    (its job done)."""
    plan = {str(u): list(urls) for u, urls in (req.get("clients") or {}).items()}

    def one(item: dict[str, Any]) -> dict[str, Any]:
        try:
            own = per_client(item["unit"]) if per_client is not None else {}
            request = {"op": op, "endpoints": item["endpoints"], **extra, **own}
            answer = host.client_call(item["unit"], request, timeout)
        except ClientError as exc:
            out = {"ok": False, "error": str(exc), "socket": host.client_socket(item["unit"])}
            how = ended(host.units([item["unit"]]).get(item["unit"], {}))
            return {**out, "ended": how} if how else out
        except OSError as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {**answer, "ok": True}

    answers = parallel(one, [{"unit": u, "endpoints": urls} for u, urls in plan.items()])
    # An exception in a worker comes back as parallel's own failure record (no "ok").
    return {
        "clients": {
            unit: answer if "ok" in answer else {"ok": False, "error": str(answer.get("msg"))}
            for unit, answer in zip(plan, answers)
        }
    }


def op_drain(req: dict[str, Any], host: Host) -> dict[str, Any]:
    """Drain one wave's endpoints in each client: it stops sending there, waits up to
    ``client_drain_timeout`` for their requests in flight and requeues the rest elsewhere. The
    drain lapses by itself after ``lease`` seconds unless resumed."""
    timeout = float(need(req, "client_drain_timeout"))
    lease = float(req["lease"])
    by = str(req.get("by") or "sglang-fleet retune")
    extra = {"timeout": timeout, "lease": lease, "by": by}
    return _socket_op(req, host, "drain", timeout + DRAIN_CALL_MARGIN, extra)


def resume_call_timeout(req: Mapping[str, Any]) -> float:
    """How long a resume's call on a control socket may take: the client's checks of the servers,
    the wait for its word (``client_confirm_timeout``), and a margin."""
    confirm = float(req.get("client_confirm_timeout") or 0.0)
    return float(req.get("client_resume_timeout", RESUME_TIMEOUT)) + confirm + DRAIN_CALL_MARGIN


def op_resume(req: dict[str, Any], host: Host) -> dict[str, Any]:
    """Resume the endpoints in each client: it re-reads each server's capacity and, within
    ``client_confirm_timeout`` seconds, says whether each endpoint is back in service (completing
    requests) or why not. With ``client_keys`` (a retune), a client that follows the servers' API
    key is handed it first."""
    confirm = float(req.get("client_confirm_timeout") or 0.0)
    extra = {"by": str(req.get("by") or "sglang-fleet retune"), "confirm": confirm}
    timeout = resume_call_timeout(req)

    def key(unit: str) -> dict[str, Any]:
        api_key = hand_over(host, unit)
        return {} if api_key is None else {"api_key": api_key}

    return _socket_op(req, host, "resume", timeout, extra, key if req.get("client_keys") else None)


def op_client_stop(req: dict[str, Any], host: Host) -> dict[str, Any]:
    """Stop the client services (SIGTERM: the client finishes its requests in flight and
    closes its shard), and say how each ended."""
    units = client_units(req)
    t0 = host.monotonic()
    res = host.service.stop(units, wait=True, timeout=float(req.get("client_stop_timeout", CLIENT_STOP_TIMEOUT)))
    elapsed = round(host.monotonic() - t0, 3)
    states = host.units(units)
    out = {}
    for unit in units:
        st = states.get(unit, {})
        done = stopped(st)
        entry = {
            "stopped": done,
            "unit_state": f"{st.get('ActiveState')}/{st.get('SubState')}",
            "rc": res["rc"],
            "elapsed_s": elapsed,
            "action": f"{res['cmd']} (rc={'timed out' if res['rc'] is None else res['rc']})",
        }
        if not done:
            entry["msg"] = f"still {entry['unit_state']} after {entry['action']}: {res['stderr'].strip()}".rstrip(": ")
        out[unit] = entry
    return {"clients": out}


def op_client_start(req: dict[str, Any], host: Host) -> dict[str, Any]:
    """Start the client services (the client resumes its job where it stopped); with
    ``client_keys`` (a retune), each that follows the servers' API key given it first (its
    environment file)."""
    units = client_units(req)
    key_errors = {}
    for unit in units if req.get("client_keys") else []:
        try:
            hand_over(host, unit)
        except (OSError, EvidenceError) as exc:  # started all the same: it generates where it can
            key_errors[unit] = f"the servers' API key could not be given to it: {exc}"
    res = host.service.start(units, wait=True, timeout=float(req.get("client_start_timeout", CLIENT_START_TIMEOUT)))
    states = host.units(units)
    out = {}
    for unit in units:
        st = states.get(unit, {})
        running = st.get("ActiveState") in RUNNING_STATES
        entry = {
            "started": running,
            "unit_state": f"{st.get('ActiveState')}/{st.get('SubState')}",
            "rc": res["rc"],
            "action": f"{res['cmd']} (rc={'timed out' if res['rc'] is None else res['rc']})",
        }
        if not running:
            entry["msg"] = f"{entry['unit_state']} after {entry['action']}: {res['stderr'].strip()}".rstrip(": ")
        if unit in key_errors:
            entry["key_error"] = key_errors[unit]
        out[unit] = entry
    return {"clients": out}
