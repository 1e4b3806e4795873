# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The advisor's stepped measurement (opt-in, part of ``observe``): a few seconds of the agent's
own requests at a few concurrencies against each named instance, its ``/metrics`` sampled all
along, so that the controller can fit the instance's decode step time against its running
requests where the window did not vary them (``plugin_utils/_advisor/throughput.py``).

The host's generation clients that send to the instance are drained first (the retune's drain:
nothing new is sent there, requests in flight get ``drain_timeout`` seconds, the rest go
elsewhere) and always resumed after; the instance must be idle before the first step, else the
measurement says what still ran and measures nothing. The load is ``/generate`` requests that
answer once, each sized to about one step's tokens; their connections are closed at the end of
each step. 0.5.23 aborts such a request when its client goes away; 0.5.9 finishes it (and aborts
only streaming ones), so each level starts once the instance works on nothing (``_quiet``).
"""

from __future__ import annotations

from typing import Any

from .host import Host
from .http_client import instance_url
from .op_clients import op_drain, op_resume

DEFAULT_LEVELS = (0.25, 0.5, 1.0)  # shares of the effective max running requests
DEFAULT_STEP_S = 4.0
DEFAULT_SETTLE = 0.4  # share of each step left out (the gauges lag the new level)
DEFAULT_DRAIN_TIMEOUT = 10.0
DEFAULT_MAX_NEW_TOKENS = 1024
BY = "sglang-fleet advise (measurement)"
DEFAULT_PROMPT_TOKENS = 200
QUIET_S = 1.0  # a token counter still this long: nothing runs (a decode step takes milliseconds)


def workload_shape(samples: list[dict[str, Any]]) -> dict[str, int]:
    """The mean prompt and completion of the requests that finished over the window (the
    counters' growth): the measurement's requests take that shape, so that its steps carry the
    same share of prefill as the instance's own work. Empty when none finished."""
    have = [
        s
        for s in samples
        if all(k in s for k in ("num_requests_total", "prompt_tokens_total", "generation_tokens_total"))
    ]
    if len(have) < 2:
        return {}
    first, last = have[0], have[-1]
    done = last["num_requests_total"] - first["num_requests_total"]
    if done < 1:
        return {}
    prompt = (last["prompt_tokens_total"] - first["prompt_tokens_total"]) / done
    output = (last["generation_tokens_total"] - first["generation_tokens_total"]) / done
    if prompt < 1 or output < 1:
        return {}
    shape = {"prompt_tokens": round(prompt), "max_new_tokens": round(output)}
    running = [s["num_running_reqs"] for s in samples if s.get("num_running_reqs")]
    tput = [s["gen_throughput"] for s in samples if s.get("gen_throughput")]
    if running and tput:
        shape["request_tokens_per_s"] = round((sum(tput) / len(tput)) / (sum(running) / len(running)), 3)
    return shape


def _count(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def concurrencies(levels: list[float], effective_max: int) -> list[int]:
    """The distinct concurrencies of the levels (shares of the max), lowest first, at least 1."""
    return sorted({max(1, min(effective_max, round(float(share) * effective_max))) for share in levels})


def _request(spec: dict[str, Any], step_s: float) -> dict[str, Any]:
    """The measurement's request body.

    Token ids, not text: the prompt's length is exact whatever the tokenizer; every request's own
    (SteadyLoad numbers them); the window's prompt, and as many tokens (ignore_eos) as one request
    got in a step's time over the window (at most the window's completion): few requests end
    within a step, and those of the last step are done soon after. One answer per request: little
    work per token on either side (a stream's is not the GPU's)."""
    prompt = max(1, int(spec.get("prompt_tokens", DEFAULT_PROMPT_TOKENS)))
    max_new = max(1, int(spec.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)))
    rate = spec.get("request_tokens_per_s")
    if isinstance(rate, (int, float)) and rate > 0:
        max_new = min(max_new, max(16, round(rate * step_s)))
    return {
        "input_ids": [100 + i % 1000 for i in range(prompt)],
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
    }


def _drain(host: Host, clients: dict[str, list[str]], lease: float, drain_timeout: float) -> str | None:
    """The instance's clients on this host drained; why not, if one could not be."""
    if not clients:
        return None
    drain = {"clients": clients, "lease": lease, "client_drain_timeout": drain_timeout, "by": BY}
    drained = op_drain(drain, host)["clients"]
    failed = {u: a.get("error") for u, a in drained.items() if not a.get("ok")}
    return f"could not drain the generation clients {failed}: nothing measured" if failed else None


def _quiet(inst: dict[str, Any], host: Host, read_metrics: Any, deadline: float) -> tuple[bool, dict[str, Any]]:
    """Wait until the instance works on nothing: its gauges say no request runs or waits, or its
    token counter (``sglang:realtime_tokens_total``, which moves at every decode step and prefill
    batch) stays put for ``QUIET_S``. The gauges are the scheduler's last report, which an idle
    scheduler renews only 30 s later (0.5.9 ``managers/scheduler_runtime_checker_mixin.py:253-258``),
    so a server that has just finished its last request can show it for that long. The last values
    read, with ``(ok, values)``."""
    seen: dict[str, Any] = {}
    still: list[float] = []  # [the counter's value, when it was first read at that value]

    def quiet() -> bool:
        got = read_metrics(inst)
        seen.clear()
        seen.update(got.get("values") or {"error": got.get("error")})
        if not (seen.get("num_running_reqs") or 0) and not (seen.get("num_queue_reqs") or 0) and "error" not in seen:
            return True
        tokens, now = seen.get("realtime_tokens_total"), host.monotonic()
        if not isinstance(tokens, (int, float)):
            return False
        if not still or still[0] != tokens:
            still[:] = [tokens, now]
            return False
        return now - still[1] >= QUIET_S

    ok, _waited = host.wait(quiet, deadline)
    return ok, seen


def _wait_idle(inst: dict[str, Any], host: Host, read_metrics: Any, drain_timeout: float, drained: bool) -> str | None:
    """Wait until the instance works on nothing; why not, if it still does."""
    ok, idle = _quiet(inst, host, read_metrics, host.monotonic() + drain_timeout + 5.0)
    if ok:
        return None
    return (
        f"the instance still ran {_count(idle.get('num_running_reqs'))} requests "
        f"({_count(idle.get('num_queue_reqs'))} queued) "
        + ("after its clients on this host were drained" if drained else "with no client on this host")
        + " (clients elsewhere?): nothing measured"
    )


def _step(
    inst: dict[str, Any],
    host: Host,
    read_metrics: Any,
    level: int,
    timing: tuple[float, float, float, float],
    body: dict[str, Any],
    out: dict[str, Any],
) -> None:
    """One level of load for ``step_s``: /metrics every ``interval``, kept after ``settle``."""
    start, step_s, interval, settle = timing
    load = host.load(instance_url(inst, "/generate"), body, level, stream=False)
    began = host.monotonic()
    try:
        while True:
            now = host.monotonic()
            if now - began > step_s:
                break
            got = read_metrics(inst)
            if now - began >= settle * step_s and "values" in got:
                out["measure_samples"].append({"t": round(now - start, 3), "level": level, **got["values"]})
            ticks = 1 + int((host.monotonic() - began) / interval)
            host.sleep(max(0.0, began + interval * ticks - host.monotonic()))
    finally:
        load.stop()
    if load.errors:
        out["measure"].setdefault("load_errors", []).extend(load.errors)


def _resume(host: Host, clients: dict[str, list[str]], summary: dict[str, Any]) -> None:
    if not clients:
        return
    resumed = op_resume({"clients": clients, "by": BY}, host)["clients"]
    failed = {u: a.get("error") for u, a in resumed.items() if not a.get("ok")}
    if failed:
        summary["resume_failed"] = failed  # the drain lapses by itself after its lease


def measure_instance(
    inst: dict[str, Any],
    host: Host,
    spec: dict[str, Any],
    effective_max: int,
    endpoints: list[dict[str, Any]],
    read_metrics: Any,
) -> dict[str, Any]:
    """Drain the instance's clients, step the load, resume the clients: ``{"measure_samples":
    [...], "measure": {...}}`` or ``{"measure_error": why, ...}``. ``read_metrics(inst)`` is
    observe's /metrics reader."""
    step_s = float(spec.get("step_s", DEFAULT_STEP_S))
    interval = max(0.05, float(spec.get("interval", 0.25)))
    settle = min(0.9, max(0.0, float(spec.get("settle", DEFAULT_SETTLE))))
    drain_timeout = float(spec.get("drain_timeout", DEFAULT_DRAIN_TIMEOUT))
    levels = concurrencies(list(spec.get("levels") or DEFAULT_LEVELS), effective_max)
    body = _request(spec, step_s)
    clients: dict[str, list[str]] = {}
    for e in endpoints:
        clients.setdefault(str(e["unit"]), []).append(str(e["url"]))
    summary: dict[str, Any] = {
        "levels": levels,
        "step_s": step_s,
        "interval_s": interval,
        "prompt_tokens": len(body["input_ids"]),
        "max_new_tokens": body["sampling_params"]["max_new_tokens"],
        "drained": sorted(clients),
    }
    out: dict[str, Any] = {"measure": summary, "measure_samples": []}
    start = host.monotonic()
    try:
        why = _drain(host, clients, drain_timeout + len(levels) * step_s + 60.0, drain_timeout)
        why = why or _wait_idle(inst, host, read_metrics, drain_timeout, bool(clients))
        if why:
            out["measure_error"] = why
            return out
        for index, level in enumerate(levels):
            if index:
                # The last level's requests, where the release does not abort them when their
                # client goes away (0.5.9, for requests that do not stream), end before this one.
                ok, left = _quiet(inst, host, read_metrics, host.monotonic() + step_s + 5.0)
                if not ok:
                    summary.setdefault("not_quiet", []).append({"before_level": level, **left})
            _step(inst, host, read_metrics, level, (start, step_s, interval, settle), body, out)
    finally:
        _resume(host, clients, summary)
        summary["elapsed_s"] = round(host.monotonic() - start, 3)
    return out
