# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The retune's bookkeeping: each instance's record (its action, state, timings, what each phase
reported of it, and why it failed, in words) and the host's report built from the records at the
end. The phase flow (:mod:`._retune`) decides what happens; this module writes it down.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.clients import RetuneClients
    from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.decide import Decision

# A record's action.
UNCHANGED = "unchanged"
RELAUNCHED = "relaunched"
STARTED = "started"
ROLLED_BACK = "rolled_back"
FAILED = "failed"
SKIPPED = "skipped"
# Wedged (its own endpoints hang) while serving the desired settings: named, not touched.
UNHEALTHY = "unhealthy"
# How the agent's verdict on a stalled instance begins (plugins/module_utils/agent/stall.py).
STALLED = "stalled: "
# Predictions in check mode.
WOULD_RELAUNCH = "would_relaunch"
WOULD_START = "would_start"

# What a start phase reported of an instance, kept in its record (under "relaunch" or "rollback").
_START_KEYS = ("msg", "journal", "server_info_mismatches", "smoke", "argv_diff", "actions", "crashed")


def mib(values: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(values or {})


def state_words(state: str) -> str:
    if state == "unverified":
        return "instance is UP but NOT VERIFIED (serving settings that failed their checks)"
    return "instance is DOWN"


def clients_in_the_way(units: list[str]) -> str:
    return (
        f"not touched: generation client(s) {', '.join(units)} may send to it and could not be stopped; "
        "still running as it was"
    )


# -- one instance's record --------------------------------------------------------------------


def initial_result(
    name: str, instance: Mapping[str, Any], facts: Mapping[str, Any], decision: Decision, check_mode: bool
) -> dict[str, Any]:
    """The record of an instance once decided, before anything is done to it."""
    action = decision.action
    if check_mode:
        action = {"relaunch": WOULD_RELAUNCH, "start": WOULD_START}.get(action, action)
    if action == "blocked":
        action = FAILED
    return {
        "name": name,
        "unit": instance.get("unit"),
        "container": instance.get("container"),
        "port": instance.get("port"),
        "gpus": instance.get("gpus"),
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
        "desired_argv": instance.get("argv"),
        "wedged": decision.wedged,
    }


def how_stopped(r: Mapping[str, Any]) -> str:
    """How the stop phase ended an instance's processes, in words (from its record)."""
    if r.get("escalated"):
        how = "SIGTERM, then SIGKILL of its cgroup past the stop deadline"
    else:
        how = "SIGTERM (systemctl stop)"
    signals = [f"PID {k.get('pid')} {k.get('signal')}" for k in r.get("killed") or []]
    return how + (f"; survivors killed by PID: {', '.join(signals)}" if signals else "")


def was_unwell(wedged: list[str]) -> str:
    """``was wedged (what did not answer)``, or ``was stalled (what was seen)``."""
    stalled = all(w.startswith(STALLED) for w in wedged)
    said = [w.removeprefix(STALLED) for w in wedged]
    return f"was {'stalled' if stalled else 'wedged'} ({'; '.join(said)})"


def wedged_words(r: Mapping[str, Any]) -> str:
    """What the summary says of a wedged (or stalled) instance: what did not answer (or why it is
    stalled), and what became of it."""
    what = f"{r['name']} {was_unwell(r['wedged'])}"
    if r["action"] in (RELAUNCHED, ROLLED_BACK):
        return f"{what}: relaunched, stopped by {how_stopped(r)}"
    if r["action"] == UNHEALTHY:
        return f"{what}: serves the desired settings, left as it is (UNHEALTHY)"
    return f"{what}: {r['action']}"


def record_stop(r: dict[str, Any], res: Mapping[str, Any]) -> bool:
    """The stop phase's result for the instance of record ``r``; whether it is proven dead (if
    not, it is failed: down, not relaunched)."""
    if r.get("time_to_dead_s") is None:  # keep the first (the relaunch), not the rollback's
        r["time_to_dead_s"] = res.get("time_to_dead_s")
    r["escalated"] = r.get("escalated", False) or bool(res.get("escalated"))
    if res.get("teardown_s"):
        r["teardown_s"] = res["teardown_s"]
    r["killed"] = r.get("killed", []) + list(res.get("killed", []))
    if res.get("dead"):
        return True
    r.update(
        action=FAILED,
        state="down",
        msg=f"not proven dead, not relaunched, instance is DOWN: {res.get('msg') or res}",
    )
    r["foreign"] = res.get("foreign", [])
    return False


def record_release(r: dict[str, Any], res: Mapping[str, Any]) -> bool:
    """The release phase's result for the instance of record ``r``; whether its GPU memory is
    proven free (if not, it is failed: down, not relaunched)."""
    if r.get("time_to_release_s") is None:  # keep the first (the relaunch), not the rollback's
        r["time_to_release_s"] = res.get("time_to_release_s")
    r["gpu_memory_released_mib"] = mib(res.get("used_mib"))
    # What the GPUs still held once the processes were gone: the driver's late release.
    r.setdefault("gpu_memory_after_dead_mib", mib(res.get("used_mib_first")))
    r["release_polls"] = r.get("release_polls", 0) + int(res.get("samples") or 0)
    if res.get("released"):
        return True
    r.update(
        action=FAILED,
        state="down",
        msg=f"GPU memory not proven free, not relaunched, instance is DOWN: {res.get('msg')}",
    )
    return False


def record_start(r: dict[str, Any], res: Mapping[str, Any], rollback: bool) -> bool:
    """The start phase's result (of the relaunch, or of the ``rollback``) for the instance of
    record ``r``; whether it is proven healthy."""
    key = "rollback" if rollback else "relaunch"
    r[key] = {k: v for k, v in res.items() if k in _START_KEYS}
    if res.get("healthy"):
        r.update(
            new_main_pid=res.get("new_main_pid"),
            new_invocation_id=res.get("new_invocation_id"),
            time_to_healthy_s=res.get("time_to_healthy_s"),
            effective_max_running_requests_after=res.get("effective_max_running_requests"),
            state="running",
        )
        return True
    r["msg"] = res.get("msg") or "not healthy"
    # Crashed or never started: down. Up but not proven (settings, smoke): unverified.
    r["state"] = "down" if res.get("crashed") or not res.get("started") else "unverified"
    r["new_main_pid"] = res.get("new_main_pid")
    return False


def record_relaunch_failed(r: dict[str, Any]) -> None:
    """The relaunch failed and rollback is disabled."""
    r.update(action=FAILED, msg=f"relaunch failed, rollback disabled: {r.get('msg')}: {state_words(r['state'])}")


def record_no_last_good(r: dict[str, Any]) -> None:
    """The relaunch failed and there are no last good settings to roll back to."""
    r.update(
        action=FAILED,
        msg=f"relaunch failed ({r.get('msg')}) and no last good settings are recorded to roll back to: "
        + state_words(r["state"]),
    )


def record_rollback(r: dict[str, Any], healthy: bool, why: str | None) -> None:
    """The outcome of the rollback of an instance whose new settings failed (``why``)."""
    if healthy:
        r.update(
            action=ROLLED_BACK,
            state="running",
            msg=f"new settings failed ({why}); rolled back to the last good settings, which are healthy",
        )
    else:
        rollback_msg = r.get("rollback", {}).get("msg") or r.get("msg")
        r.update(
            action=FAILED,
            state="down",
            msg=f"new settings failed ({why}) and the rollback failed too ({rollback_msg}): instance is DOWN",
        )


# -- a host lost mid-retune ------------------------------------------------------------------

# What is known of an instance whose phase was under way when the host stopped answering.
_LOST_IN_FLIGHT = {
    "stop": ("unknown", "stop sent, not proven dead: it may still run, or be DOWN"),
    "release": ("down", "proven dead, its GPU memory not proven free: DOWN"),
    "start": ("unknown", "relaunch sent, not proven healthy: it may serve the new settings, or be DOWN"),
}
_LOST_ROLLBACK_START = "relaunch of its last good settings sent, not proven healthy: it may serve them, or be DOWN"
_PROVEN_BEFORE = {
    RELAUNCHED: "relaunched and proven healthy before the host was lost",
    STARTED: "started and proven healthy before the host was lost",
    ROLLED_BACK: "rolled back and proven healthy before the host was lost",
}


def record_lost(r: dict[str, Any], op: str, in_flight: bool, rollback: bool, during: str) -> None:
    """What is known of the instance of record ``r`` once its host stopped answering ``during``
    (``the start phase of gpu0``): its ``op`` phase under way (``in_flight``, of a ``rollback``),
    proven before, or never reached. No further call is made to the host, so this is final."""
    if in_flight and op in _LOST_IN_FLIGHT:
        state, words = _LOST_IN_FLIGHT[op]
        if op == "start" and rollback:
            words = _LOST_ROLLBACK_START
        if rollback and r.get("msg"):
            words = f"new settings failed ({r['msg']}); rollback: {words}"
        r.update(action=FAILED, state=state, msg=f"{words} (the host was lost)", host_lost=words)
    elif r["action"] in _PROVEN_BEFORE:
        r["host_lost"] = _PROVEN_BEFORE[r["action"]] + (
            "; the clients' resume of its endpoints was sent, not confirmed" if in_flight and op == "resume" else ""
        )
    elif r["action"] in ("relaunch", "start"):
        # Never stopped (a drain of its endpoints under way changes nothing on the instance).
        still = "still stopped" if r["action"] == "start" else "still running as it was when last seen"
        r.update(action=SKIPPED, msg=f"not touched: the host was lost during {during}; {still}")
    elif in_flight and op == "record":
        r["host_lost"] = "its last good settings may not be recorded (the host was lost while recording them)"


def _secs(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds >= 10 or seconds == int(seconds) else f"{seconds:.1f}s"


def lost_words(
    op: str, names: list[str], deadline_s: float, margin_s: float, why: str | None = None, waited_s: float | None = None
) -> str:
    """The host's line in the summary: which call went unanswered, and for how long (or why the
    connection gave up first)."""
    of = f" of {', '.join(names)}" if names else ""
    parts = f"its deadline {_secs(deadline_s)} + sglang_retune_call_margin {_secs(margin_s)}"
    bound = f"{_secs(deadline_s + margin_s)} ({parts})"
    if why:
        into = f" {_secs(waited_s)} into it" if waited_s is not None else ""
        said = f"{why} during the {op} phase{of},{into} (its bound: {bound})"
    else:
        said = f"no answer to the {op} phase{of} within {bound}"
    return f"HOST LOST: {said}; no further call was made to the host"


LOST_AFTER = (
    "rerun once the host answers again: the rerun finishes the job; the host lock's lease is left to expire "
    "(sglang_retune_lock_ttl) or is taken over by a rerun from this controller"
)


# -- the host's report ------------------------------------------------------------------------


def blocked_msg(results: Mapping[str, Mapping[str, Any]], blocked: list[str]) -> str:
    return "failed closed, nothing changed on this host: " + "; ".join(
        f"{n}: {' '.join(results[n]['reasons'])}" for n in blocked
    )


def host_report(
    instances: list[dict[str, Any]],
    *,
    elapsed: float,
    round_trips: Mapping[str, int],
    clients: RetuneClients | None,
    host_notes: list[str],
    check_mode: bool,
    failed_msg: str | None,
) -> dict[str, Any]:
    """The retune's result for the host, from the instances' records (in inventory order)."""
    changed_actions = {RELAUNCHED, STARTED, ROLLED_BACK, WOULD_RELAUNCH, WOULD_START}
    touched = {RELAUNCHED, STARTED, ROLLED_BACK, FAILED}
    changed = any(r["action"] in changed_actions for r in instances) or any(
        r["action"] == FAILED and r.get("state") in ("down", "unknown") for r in instances
    )
    result: dict[str, Any] = {
        "changed": changed,
        "elapsed": elapsed,
        "instances": instances,
        "round_trips": dict(round_trips),
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
    wedged = [wedged_words(r) for r in instances if r.get("wedged")]
    if wedged:
        result["wedged"] = wedged
    result["clients"] = clients.report() if clients else []
    result["clients_stopped"] = clients.stopped() if clients else []
    notes = (clients.notes() if clients else []) + host_notes
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
    elif any(r["action"] in (FAILED, ROLLED_BACK, UNHEALTHY) for r in instances):
        result["failed"] = True
        result["msg"] = "; ".join(
            f"{r['name']}: {r.get('msg') or ' '.join(r['reasons'])}"
            for r in instances
            if r["action"] in (FAILED, ROLLED_BACK, UNHEALTHY)
        )
    else:
        result["msg"] = "; ".join([ok_msg(instances), *wedged])
    if check_mode:
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


def ok_msg(instances: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for r in instances:
        counts[r["action"]] = counts.get(r["action"], 0) + 1
    return ", ".join(f"{n} {a}" for a, n in sorted(counts.items())) or "no instances"
