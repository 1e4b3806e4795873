# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Operation ``observe``: what each instance of the host is doing, for the tuning advisor. It
changes nothing.

For every instance: its ``/server_info`` once, the startup lines of its current run from the
unit's journal (the weights, Mamba and KV allocation lines the controller derives the model's
memory facts from), and - unless the controller reads them from Prometheus - its ``/metrics``
every ``interval`` seconds for ``window`` seconds (running and queued requests, token and Mamba
usage, generation throughput and tokens). nvidia-smi's memory.used of every GPU is sampled at the
same ticks. With ``client_units``, the generation clients of the host that answer on their control
socket say, at the end of the window, what they send to each instance and whether their
concurrency follows the server's. It returns the raw observations; the controller classifies them
(``plugin_utils/_advisor/diagnose.py``).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from .evidence import EvidenceError, clip
from .host import Host, parallel
from .http_client import effective_max_running_requests, instance_url
from .metrics_text import metric_values
from .op_clients import clients_by_instance
from .op_measure import measure_instance, workload_shape
from .request import need
from .supervision import identity

# /metrics: gauges (the largest value over the instance's series: TP/DP ranks) and counters (the
# sum over the series: is_streaming, ...).
GAUGES = {
    "sglang:num_running_reqs": "num_running_reqs",
    "sglang:num_queue_reqs": "num_queue_reqs",
    "sglang:num_used_tokens": "num_used_tokens",
    "sglang:token_usage": "token_usage",
    "sglang:full_token_usage": "full_token_usage",
    "sglang:mamba_usage": "mamba_usage",
    "sglang:gen_throughput": "gen_throughput",
    "sglang:max_total_num_tokens": "max_total_num_tokens",
    "sglang:context_len": "context_len",
    "sglang:spec_accept_length": "spec_accept_length",
    "sglang:utilization": "utilization",
}
COUNTERS = {
    "sglang:generation_tokens_total": "generation_tokens_total",
    "sglang:num_requests_total": "num_requests_total",
    "sglang:prompt_tokens_total": "prompt_tokens_total",
    "sglang:realtime_tokens_total": "realtime_tokens_total",
}


def parse_metrics(text: str) -> dict[str, float]:
    """The metrics the advisor reads, from Prometheus text exposition."""
    return metric_values(text, GAUGES, COUNTERS)


def op_observe(req: dict[str, Any], host: Host) -> dict[str, Any]:
    """Each instance's identity and startup lines, its /server_info, then its /metrics and the
    GPUs' memory sampled over the window; the generation clients sending to it, if asked."""
    instances = req["instances"]
    window = max(0.0, float(need(req, "window")))
    interval = max(0.1, float(need(req, "interval")))
    sample = bool(need(req, "sample_metrics"))
    read_journal = bool(req.get("journal", True))
    pattern = str(need(req, "journal_pattern")) if read_journal else None
    units = host.units([i["unit"] for i in instances])
    results = {inst["name"]: _instance_facts(host, inst, units.get(inst["unit"], {}), pattern) for inst in instances}
    running = [i for i in instances if results[i["name"]]["running"]]
    _read_server_info(host, instances, running, results)
    gpus = _GpuMemory(host)
    read_metrics = _metrics_reader(host, interval)
    start = _sample_window(host, running, results, gpus, read_metrics, sample, window, interval)
    senders, clients_problems = _clients(req, host, instances, results)
    window_s = round(host.monotonic() - start, 3)
    if req.get("measure"):
        measured(req["measure"], running, results, senders, host, read_metrics)
    return {
        "instances": results,
        "clients_problems": clients_problems,
        "gpus": gpus.seen,
        "gpu_error": gpus.error,
        "window_s": window_s,
        "interval_s": interval,
        "sampled": sample,
    }


def _instance_facts(host: Host, inst: dict[str, Any], state: dict[str, str], pattern: str | None) -> dict[str, Any]:
    """What the unit says of the instance, and the startup lines of its current run (``pattern``
    None: the journal is not read)."""
    ident = identity(state)
    facts: dict[str, Any] = {
        "name": inst["name"],
        "unit": inst["unit"],
        "gpus": list(inst.get("gpus") or []),
        "port": inst.get("port"),
        **ident,
        "running": state.get("ActiveState") == "active" and ident["main_pid"] > 0,
        "samples": [],
        "metrics_errors": [],
    }
    if pattern is not None:
        lines, source, error = startup_journal(host, ident["invocation_id"], inst["unit"], pattern)
        facts["journal"] = lines
        facts["journal_source"] = source
        if error:
            facts["journal_error"] = error
    return facts


def _read_server_info(
    host: Host, instances: list[dict[str, Any]], running: list[dict[str, Any]], results: dict[str, dict[str, Any]]
) -> None:
    """Each running instance's /server_info (redacted), in parallel; why not, for the others."""

    def server_info(inst: dict[str, Any]) -> dict[str, Any]:
        status, body = host.http(instance_url(inst, "/server_info"), host.http_timeout, host.api_key)
        out: dict[str, Any] = {"server_info_status": status}
        if status == 200:
            try:
                out["server_info"] = host.redactor.obj(json.loads(body))
            except ValueError:
                out["server_info_error"] = f"not JSON: {clip(body, 300)!r}"
        else:
            out["server_info_error"] = host.redactor.text(clip(body, 300))
        return out

    for inst, info in zip(running, parallel(server_info, running)):
        results[inst["name"]].update(info)
    for inst in instances:
        if not results[inst["name"]]["running"]:
            results[inst["name"]]["server_info_error"] = "the unit is not running"


class _GpuMemory:
    """Each GPU's memory.used over the window (least, most, last); sampling stops at the first
    broken nvidia-smi, whose evidence error is kept."""

    def __init__(self, host: Host):
        self.host = host
        self.seen: dict[str, dict[str, Any]] = {}
        self.error: dict[str, Any] | None = None

    def sample(self) -> None:
        if self.error is not None:
            return
        try:
            for index, gpu in self.host.gpus().items():
                entry = self.seen.setdefault(
                    str(index),
                    {"total_mib": gpu["total_mib"], "used_mib_min": gpu["used_mib"], "used_mib_max": 0, "samples": 0},
                )
                entry["used_mib_min"] = min(entry["used_mib_min"], gpu["used_mib"])
                entry["used_mib_max"] = max(entry["used_mib_max"], gpu["used_mib"])
                entry["used_mib_last"] = gpu["used_mib"]
                entry["samples"] += 1
        except EvidenceError as exc:
            self.error = exc.to_dict()


def _metrics_reader(host: Host, interval: float) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """An instance's /metrics, parsed (``{"values": ...}``), or ``{"error": ...}``."""
    timeout = max(1.0, min(host.http_timeout, interval))

    def metrics(inst: dict[str, Any]) -> dict[str, Any]:
        status, body = host.http(instance_url(inst, "/metrics"), timeout, host.api_key)
        if status != 200:
            return {"error": f"/metrics answered {status}: {clip(host.redactor.text(body), 200)}"}
        return {"values": parse_metrics(body)}

    return metrics


def _sample_window(
    host: Host,
    running: list[dict[str, Any]],
    results: dict[str, dict[str, Any]],
    gpus: _GpuMemory,
    metrics: Callable[[dict[str, Any]], dict[str, Any]],
    sample: bool,
    window: float,
    interval: float,
) -> float:
    """The GPUs and each running instance's /metrics (``metrics``) every ``interval`` over
    ``window`` (once, the GPUs alone, without ``sample``); at most three distinct /metrics errors
    per instance. Returns when the window started."""
    start = host.monotonic()
    tick = 0
    while True:
        now = host.monotonic()
        gpus.sample()
        if sample and running:
            for inst, got in zip(running, parallel(metrics, running)):
                facts = results[inst["name"]]
                if "values" in got:
                    facts["samples"].append({"t": round(now - start, 3), **got["values"]})
                    continue
                error = got.get("error") or got.get("msg") or "failed"
                if error not in facts["metrics_errors"] and len(facts["metrics_errors"]) < 3:
                    facts["metrics_errors"].append(error)
        if not sample:
            return start
        next_tick = start + (tick + 1) * interval
        if next_tick > start + window + 1e-9:
            return start
        host.sleep(max(0.0, next_tick - host.monotonic()))
        tick += 1


def _clients(
    req: dict[str, Any], host: Host, instances: list[dict[str, Any]], results: dict[str, dict[str, Any]]
) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """Which generation clients send to each instance (when ``client_units`` are given), and the
    problems finding them out."""
    if not req.get("client_units"):
        return {}, []
    senders, problems = clients_by_instance({"client_units": req["client_units"], "instances": instances}, host)
    for name, endpoints in senders.items():
        if name in results:
            results[name]["clients"] = endpoints
    return senders, problems


def measured(
    spec: dict[str, Any],
    running: list[dict[str, Any]],
    results: dict[str, dict[str, Any]],
    senders: dict[str, list[dict[str, Any]]],
    host: Host,
    read_metrics: Callable[[dict[str, Any]], dict[str, Any]],
) -> None:
    """The stepped measurement (:mod:`.op_measure`) of the named instances, at once (each on its
    own GPUs), after the window: its samples and summary into each one's result."""
    names = set(spec.get("instances") or [])
    targets: list[dict[str, Any]] = []
    for inst in running:
        if inst["name"] not in names:
            continue
        eff = effective_max_running_requests(results[inst["name"]].get("server_info") or {})
        if eff is None:
            results[inst["name"]]["measure_error"] = "no effective max running requests in /server_info"
            continue
        targets.append({"inst": inst, "eff": eff})

    def one(item: dict[str, Any]) -> dict[str, Any]:
        inst: dict[str, Any] = item["inst"]
        shape = workload_shape(results[inst["name"]]["samples"])
        return measure_instance(
            inst, host, {**shape, **spec}, int(item["eff"]), senders.get(inst["name"]) or [], read_metrics
        )

    for item, got in zip(targets, parallel(one, targets)):
        name = str(item["inst"]["name"])
        results[name].update({"measure_error": got.get("msg") or "failed"} if got.get("failed") else got)
    for name in names - {str(t["inst"]["name"]) for t in targets}:
        if name in results and "measure_error" not in results[name]:
            results[name]["measure_error"] = "the unit is not running"


# ------------------------------------------------------------------------------------------------
# The startup lines of the current run
# ------------------------------------------------------------------------------------------------


def startup_journal(host: Host, invocation_id: str, unit: str, pattern: str) -> tuple[list[str], str, str | None]:
    """(lines, how they were read, error). A host object may bring its own reader as
    ``startup_journal(invocation_id, unit, pattern)`` (the unit tests' fake host does); the real
    host asks its supervisor for the lines of the service's current launch (the journal, or the
    program's log file)."""
    reader: Callable[[str, str, str], list[str]] | None = getattr(host, "startup_journal", None)
    if reader is not None:
        return list(reader(invocation_id, unit, pattern)), "host", None
    return host.service.startup_lines(invocation_id, unit, pattern, host.redactor)
