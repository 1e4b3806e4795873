"""Prometheus text exposition in the shape prometheus_client's multiprocess collector produces."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)


def go_float(d: float) -> str:
    """prometheus_client's floatToGoString."""
    d = float(d)
    if d == math.inf:
        return "+Inf"
    if d == -math.inf:
        return "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{labels[k]}"' for k in sorted(labels))
    return "{" + inner + "}"


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.total += value
        self.n += 1
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1


class Registry:
    """Series keyed by (name, sorted labels); HELP/TYPE emitted once per metric name."""

    def __init__(self) -> None:
        self.help: dict[str, tuple[str, str]] = {}
        self.gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.hists: dict[tuple[str, tuple[tuple[str, str], ...]], Histogram] = {}

    def describe(self, name: str, kind: str, doc: str) -> None:
        self.help[name] = (kind, doc)

    def set(self, name: str, labels: dict[str, str], value: float) -> None:
        self.gauges[(name, tuple(sorted(labels.items())))] = float(value)

    def inc(self, name: str, labels: dict[str, str], value: float = 1.0) -> None:
        key = (name, tuple(sorted(labels.items())))
        self.counters[key] = self.counters.get(key, 0.0) + float(value)

    def observe(self, name: str, labels: dict[str, str], value: float, buckets: tuple[float, ...]) -> None:
        key = (name, tuple(sorted(labels.items())))
        if key not in self.hists:
            self.hists[key] = Histogram(buckets)
        self.hists[key].observe(value)

    def render(self) -> str:
        out: list[str] = []
        names = sorted({k[0] for k in self.gauges} | {k[0] for k in self.counters} | {k[0] for k in self.hists})
        for name in names:
            kind, doc = self.help.get(name, ("gauge", name))
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")
            for (n, lab), val in sorted(self.gauges.items()):
                if n == name:
                    out.append(f"{name}{_labels(dict(lab))} {go_float(val)}")
            for (n, lab), val in sorted(self.counters.items()):
                if n == name:
                    out.append(f"{name}{_labels(dict(lab))} {go_float(val)}")
            for (n, lab), h in sorted(self.hists.items()):
                if n != name:
                    continue
                base = dict(lab)
                out.append(f"{name}_sum{_labels(base)} {go_float(h.total)}")
                for b, c in zip(h.buckets, h.counts, strict=True):
                    out.append(f"{name}_bucket{_labels({**base, 'le': go_float(b)})} {go_float(c)}")
                out.append(f"{name}_bucket{_labels({**base, 'le': '+Inf'})} {go_float(h.n)}")
                out.append(f"{name}_count{_labels(base)} {go_float(h.n)}")
        return "\n".join(out) + "\n"


DOCS = {
    "sglang:num_running_reqs": ("gauge", "The number of running requests."),
    "sglang:num_queue_reqs": ("gauge", "The number of requests in the waiting queue."),
    "sglang:num_used_tokens": ("gauge", "The number of used tokens."),
    "sglang:token_usage": ("gauge", "The token usage."),
    "sglang:full_token_usage": ("gauge", "The token usage for full attention layers."),
    "sglang:gen_throughput": ("gauge", "The generation throughput (token/s)."),
    "sglang:cache_hit_rate": ("gauge", "The prefix cache hit rate."),
    "sglang:max_total_num_tokens": ("gauge", "Maximum total number of tokens in the KV cache pool."),
    "sglang:mamba_usage": ("gauge", "The token usage for Mamba layers."),
    "sglang:context_len": ("gauge", "Maximum context length."),
    "sglang:page_size": ("gauge", "KV cache page size in tokens."),
    "sglang:spec_accept_length": (
        "gauge",
        "Mean acceptance length of speculative decoding (accepted drafts + bonus token per forward).",
    ),
    "sglang:spec_accept_rate": ("gauge", "Speculative acceptance rate (`accepted drafts / proposed drafts` in batch)."),
    "sglang:num_retracted_reqs": ("gauge", "The number of retracted requests."),
    "sglang:num_paused_reqs": ("gauge", "The number of paused requests by async weight sync."),
    "sglang:realtime_tokens_total": (
        "counter",
        "Total number of tokens processed (updated on each log interval). "
        "mode: prefill_compute, prefill_cache, decode.",
    ),
    "sglang:prompt_tokens_total": ("counter", "Number of prefill tokens processed."),
    "sglang:generation_tokens_total": ("counter", "Number of generation tokens processed."),
    "sglang:num_requests_total": ("counter", "Number of requests processed."),
    "sglang:cached_tokens_total": ("counter", "Number of cached prompt tokens by source (device/host/storage)."),
    "sglang:time_to_first_token_seconds": ("histogram", "Histogram of time to first token in seconds."),
    "sglang:e2e_request_latency_seconds": ("histogram", "Histogram of End-to-end request latency in seconds"),
}


def new_registry() -> Registry:
    r = Registry()
    for name, (kind, doc) in DOCS.items():
        r.describe(name, kind, doc)
    return r
