# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""A stalled instance: one that answers /health and /server_info but has stopped producing (SGLang
servers are reported to accept requests and then generate nothing, /health still 200).

Read from the instance's own /metrics, twice, ``interval`` seconds apart: requests in it (running
or waiting, ``sglang:num_running_reqs`` + ``sglang:num_queue_reqs``) at both reads, and
``sglang:realtime_tokens_total`` (summed over its modes: prefill_compute, prefill_cache, decode)
the same at both. That counter moves with every decode step and every prefill batch (0.5.9
``managers/scheduler_metrics_mixin.py:245,480``; every supported release defines it), unlike
``sglang:generation_tokens_total``, which moves only when a request finishes and so stays flat for
minutes on a healthy server running long requests. The second read is made only when the first
finds requests. Without /metrics (a server started without ``--enable-metrics``) or the metrics
named, nothing is concluded: the result says why it was not checked.

The gauges are the scheduler's last report. While idle, the scheduler reports them again only 30 s
after its last report (0.5.9 ``managers/scheduler_runtime_checker_mixin.py:253-258``; measured on
0.5.9: the last running count stays for about 30 s after the server went idle, its counter flat).
So requests and a flat counter may be the last report of a server that has just gone idle: a stall
is concluded only when a third read, made once that report is due (``REPORT_DUE_S`` after the
first read), still finds requests and the counter where it was at the first read. A stalled
scheduler reports nothing new either way.
"""

from __future__ import annotations

from typing import Any

from .evidence import clip
from .host import Host
from .http_client import instance_url
from .metrics_text import metric_values

TOKENS = "sglang:realtime_tokens_total"
# The idle scheduler's report is due 30 s after its last one, which came at or before the first
# read; 2 s more for its idle loop's turn.
REPORT_DUE_S = 32.0
REQUESTS = ("sglang:num_running_reqs", "sglang:num_queue_reqs")


def work_done(text: str) -> dict[str, float]:
    """From Prometheus text exposition: the requests in the server (the largest value of each gauge
    over its series - TP/DP ranks -, running plus waiting) and the tokens processed (the counter
    summed over its series). A metric the text lacks is absent from the result."""
    got = metric_values(text, {REQUESTS[0]: "running", REQUESTS[1]: "waiting"}, {TOKENS: "tokens"})
    if not ("running" in got and "waiting" in got):
        got.pop("running", None)
        got.pop("waiting", None)
    return got


def _read(host: Host, instance: dict[str, Any]) -> tuple[dict[str, float] | None, str]:
    status, body = host.http(instance_url(instance, "/metrics"), host.http_timeout, host.api_key)
    if status != 200:
        return None, f"/metrics answered {status or host.redactor.text(clip(body, 200))}"
    got = work_done(body)
    missing = [m for m, k in ((TOKENS, "tokens"), (" and ".join(REQUESTS), "running")) if k not in got]
    if missing:
        return None, f"/metrics has no {', '.join(missing)}"
    return got, ""


def probe_stall(host: Host, instance: dict[str, Any], interval: float) -> dict[str, Any]:
    """``stalled`` (why, in words) when the instance holds requests and processed no token over
    ``interval`` seconds; ``stall_check`` (why not) when that could not be read; else nothing."""
    if interval <= 0:
        return {}
    first_at = host.monotonic()
    first, why = _read(host, instance)
    if first is None:
        return {"stall_check": f"not checked: {why}"}
    if first["running"] + first["waiting"] <= 0:
        return {}
    # Read again after the interval, then once the idle scheduler's report is due: requests held
    # and the counter where it was at both (one that went down was restarted: a new process).
    last = first
    for step in range(2):
        host.sleep(interval if step == 0 else max(0.0, first_at + REPORT_DUE_S - host.monotonic()))
        read, why = _read(host, instance)
        if read is None:
            return {"stall_check": f"not checked: {why}"}
        if read["running"] + read["waiting"] <= 0 or read["tokens"] != first["tokens"]:
            return {}
        last = read
    waited = round(host.monotonic() - first_at)
    return {
        "stalled": f"stalled: {last['running']:.0f} running and {last['waiting']:.0f} waiting requests "
        f"and no token processed in {waited:g}s ({TOKENS} stayed at {last['tokens']:.0f})"
    }
