"""The advisor's window: what an instance's metrics samples say (running, queued, usage,
throughput), in the metrics' own names and units. Pure functions.

KV usage is ``sglang:full_token_usage`` from 0.5.14 on: there ``sglang:token_usage`` is the
fullest of the KV, SWA and Mamba pools (0.5.23 ``pool_stats_observer.py:95-103,155``), so on a
hybrid model it follows the Mamba pool. Only 0.5.9 has no ``full_token_usage`` and a KV-only
``token_usage`` (:mod:`_releases.facts` says which, per release).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _series(samples: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    return [float(s[key]) for s in samples if isinstance(s.get(key), (int, float))]


@dataclass
class WindowStats:
    """What the samples of the window say, in the metrics' own names and units."""

    samples: int = 0
    duration_s: float = 0.0
    running_mean: float | None = None
    running_max: float | None = None
    pinned_fraction: float | None = None  # share of samples at the effective max (see Policy)
    refill_fraction: float | None = None  # of those, the share below it with the queue refilling
    queue_mean: float | None = None
    queue_max: float | None = None
    kv_usage_metric: str = "sglang:full_token_usage"  # what kv_usage_* were read from
    kv_usage_mean: float | None = None
    kv_usage_p90: float | None = None
    mamba_usage_mean: float | None = None  # occupancy: slots held (running and radix-cached) / pool
    gen_throughput_mean: float | None = None
    generation_rate: float | None = None  # sglang:generation_tokens_total per second
    tokens_per_request_p90: float | None = None  # KV tokens in use per running request
    demand_mean: float | None = None  # running + queued

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def kv_usage_key(samples: Sequence[Mapping[str, Any]], metric: str | None = None) -> str:
    """The sample key of KV usage: the release's (``metric``, from :mod:`_releases.facts`), else
    ``full_token_usage`` where the samples have it, else 0.5.9's ``token_usage``."""
    if metric:
        return metric.removeprefix("sglang:")
    return "full_token_usage" if _series(samples, "full_token_usage") else "token_usage"


def window_stats(
    samples: Sequence[Mapping[str, Any]],
    effective_max: int | None,
    kv_tokens: int | None,
    kv_usage_metric: str | None = None,
) -> WindowStats:
    stats = WindowStats(samples=len(samples))
    if not samples:
        return stats
    times = _series(samples, "t")
    stats.duration_s = (max(times) - min(times)) if times else 0.0
    running = _series(samples, "num_running_reqs")
    queue = _series(samples, "num_queue_reqs")
    stats.running_mean, stats.running_max = _mean(running), (max(running) if running else None)
    stats.queue_mean, stats.queue_max = _mean(queue), (max(queue) if queue else None)
    if running and effective_max:
        # SGLang's running gauge dips between a request's end and the next batch's admission from
        # the queue: a server with requests waiting for those slots is at its max all the same.
        at_max = refilling = 0
        for s in samples:
            run, queued = s.get("num_running_reqs"), s.get("num_queue_reqs") or 0
            if not isinstance(run, (int, float)):
                continue
            if run >= effective_max:
                at_max += 1
            elif queued > 0 and run + queued >= effective_max:
                refilling += 1
        stats.pinned_fraction = (at_max + refilling) / len(running)
        stats.refill_fraction = refilling / len(running)
    usage_key = kv_usage_key(samples, kv_usage_metric)
    stats.kv_usage_metric = f"sglang:{usage_key}"
    usage = _series(samples, usage_key)
    stats.kv_usage_mean, stats.kv_usage_p90 = _mean(usage), _quantile(usage, 0.9)
    stats.mamba_usage_mean = _mean(_series(samples, "mamba_usage"))
    # The gauge is the scheduler's last decode report: an idle server keeps its last value, which
    # is no production. Only the samples with requests running count.
    busy = [s for s in samples if isinstance(s.get("num_running_reqs"), (int, float)) and s["num_running_reqs"] > 0]
    stats.gen_throughput_mean = _mean(_series(busy, "gen_throughput"))
    total = [(float(s["t"]), float(s["generation_tokens_total"])) for s in samples if "generation_tokens_total" in s]
    if len(total) >= 2 and total[-1][0] > total[0][0]:
        # A counter that went down was reset (a restart): count from zero again.
        produced = sum(b[1] - a[1] if b[1] >= a[1] else b[1] for a, b in itertools.pairwise(total))
        stats.generation_rate = produced / (total[-1][0] - total[0][0])
    per_request = []
    for s in samples:
        run = s.get("num_running_reqs")
        if not isinstance(run, (int, float)) or run <= 0:
            continue
        used = s.get("num_used_tokens")
        if not isinstance(used, (int, float)):
            share = s.get(usage_key)
            cap = s.get("max_total_num_tokens") or kv_tokens
            used = share * cap if isinstance(share, (int, float)) and cap else None
        if isinstance(used, (int, float)):
            per_request.append(float(used) / float(run))
    stats.tokens_per_request_p90 = _quantile(per_request, 0.9)
    if running and queue and len(running) == len(queue):
        stats.demand_mean = _mean([r + q for r, q in zip(running, queue, strict=True)])
    elif running:
        stats.demand_mean = stats.running_mean
    return stats


def window_series(samples: Sequence[Mapping[str, Any]]) -> dict[str, list[float | None]]:
    """The window for a picture: per sample its time, running requests and generation throughput."""
    out: dict[str, list[float | None]] = {"t": [], "running": [], "gen_throughput": []}
    for s in samples:
        t = s.get("t")
        if not isinstance(t, (int, float)):
            continue
        out["t"].append(round(float(t), 3))
        for key, metric in (("running", "num_running_reqs"), ("gen_throughput", "gen_throughput")):
            value = s.get(metric)
            out[key].append(round(float(value), 2) if isinstance(value, (int, float)) else None)
    return out
