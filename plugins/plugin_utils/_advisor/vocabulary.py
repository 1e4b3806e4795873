"""The advisor's vocabulary: the diagnoses, its policy (thresholds and limits), a proposal and
an instance's advice, and the number formats its texts share.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.throughput import ThroughputModel
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.window import WindowStats
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.inputs import Settings

MAMBA_BOUND = "mamba-bound"
KV_BOUND = "kv-bound"
MAX_RUNNING_BOUND = "max-running-bound"
CLIENT_BOUND = "client-bound"
COMPUTE_BOUND = "compute-bound"
UNKNOWN = "unknown"
DIAGNOSES = (MAMBA_BOUND, KV_BOUND, MAX_RUNNING_BOUND, CLIENT_BOUND, COMPUTE_BOUND, UNKNOWN)


@dataclass(frozen=True)
class Policy:
    """The advisor's thresholds and limits (defaults documented in docs/advisor.md)."""

    # At the effective max in at least this share of the samples: running = the max, or the slots a
    # finished request freed being refilled from the queue (running + queued >= the max, a queue).
    pinned_fraction: float = 0.8
    queue_min: float = 1.0  # mean queued requests that count as a backlog
    # Not used for the diagnosis: sglang:mamba_usage is occupancy, at the cap it need not be near 1.
    # Kept so that existing sglang_advise_policy overrides still load.
    mamba_full: float = 0.9
    kv_full: float = 0.9  # KV usage (full_token_usage; 0.5.9 token_usage), 90th percentile, counted as full
    client_running_below: float = 0.9  # mean running below this share of the max: not pinned
    saturation_batch_tokens: int = 256  # decode tokens per step where throughput stops growing
    max_mem_fraction_static: float = 0.93  # never proposed above (the 7 x B200 run proved 0.93)
    gpu_margin_mib: int = 4096  # idle GPU memory (nvidia-smi) left unused when raising the fraction
    kv_target_usage: float = 0.85  # predicted peak KV usage a proposal may reach
    client_headroom: float = 1.25  # client concurrency per instance: this x the effective max
    overlap_off_cost: float = 0.05  # throughput lost per step when a change turns the overlap scheduler off
    max_slots: int = 8192  # the largest max_mamba_cache_size searched
    # The expected throughput: running requests x r give throughput x r ** this (a run measured:
    # 32 -> 72 running requests per RTX PRO 6000, 670 -> 1180 tok/s per GPU: 1.76 = 2.25 ** 0.70).
    scaling_exponent: float = 0.7
    # The measured model (throughput.py): the running requests of the window (or of the
    # measurement) must span at least this ratio (highest / lowest level) to fit the step time.
    fit_min_spread: float = 1.5
    fit_min_r2: float = 0.9  # a fit whose step times stray further from a straight line is not used


@dataclass
class Proposal:
    """A change and what it is predicted to give."""

    changes: dict[str, list[Any]] = field(default_factory=dict)  # setting -> [now, proposed]
    client_changes: dict[str, Any] = field(default_factory=dict)  # generation role variables
    effective_max_before: int | None = None
    effective_max_after: int | None = None
    binding_after: str | None = None
    kv_tokens_after: int | None = None
    predicted_token_usage: float | None = None
    throughput_factor: float | None = None  # at most: throughput proportional to running requests
    throughput_before: float | None = None
    throughput_after: float | None = None
    throughput_factor_expected: float | None = None  # the measured model's, else Policy.scaling_exponent's
    throughput_model: dict[str, Any] | None = None  # throughput.ThroughputModel.to_dict()
    plan: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        for key in (
            "throughput_factor",
            "throughput_before",
            "throughput_after",
            "throughput_factor_expected",
            "predicted_token_usage",
        ):
            if isinstance(out[key], float):
                out[key] = round(out[key], 3)
        return out


@dataclass
class InstanceAdvice:
    host: str
    name: str
    release: str
    diagnosis: str
    why: list[str] = field(default_factory=list)
    proposal: Proposal | None = None
    alternatives: list[Proposal] = field(default_factory=list)
    stats: WindowStats = field(default_factory=WindowStats)
    facts: dict[str, Any] = field(default_factory=dict)
    capacity: dict[str, Any] | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    model_check: bool | None = None
    drift: dict[str, list[Any]] = field(default_factory=dict)  # setting -> [the inventory's, the running]
    series: dict[str, list[Any]] = field(default_factory=dict)  # window.window_series (the pictures)

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "name": self.name,
            "release": self.release,
            "diagnosis": self.diagnosis,
            "why": list(self.why),
            "proposal": self.proposal.to_dict() if self.proposal else None,
            "alternatives": [p.to_dict() for p in self.alternatives],
            "stats": self.stats.to_dict(),
            "facts": self.facts,
            "capacity": self.capacity,
            "settings": self.settings,
            "problems": list(self.problems),
            "model_check": self.model_check,
            "drift": dict(self.drift),
            "series": dict(self.series),
        }


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if abs(value - round(value)) < 1e-9:
        return str(round(value))
    return f"{value:.{digits}f}"


def yaml_scalar(value: Any) -> str:
    """JSON is YAML: strings quoted, numbers, booleans and null as YAML reads them."""
    return json.dumps(value, sort_keys=True)


def step_tokens(settings: Settings) -> int:
    return max(1, settings.draft_tokens()) if settings.spec else 1


def knee(settings: Settings, policy: Policy) -> int:
    return max(1, policy.saturation_batch_tokens // step_tokens(settings))


def throughput_factors(
    running_after: float, running_before: float, decode_knee: int, model: ThroughputModel
) -> tuple[float, float]:
    """(at most, expected): the throughput factor of running ``running_after`` requests rather than
    ``running_before`` - proportional up to the knee (memory-bound decode, an upper bound), and
    the instance's measured step-time curve (:mod:`.throughput`; its fallback, the
    policy's exponent, counts up to the knee too)."""
    ratio = min(running_after, decode_knee) / min(max(running_before, 1e-9), decode_knee)
    if model.fitted:
        expected = model.factor(running_after, running_before)
        return max(ratio, expected), expected
    return ratio, ratio**model.exponent


def instance_names(members: Sequence[Mapping[str, Any]]) -> str:
    """``host/gpu0,gpu1, other/gpu0``: instances named by host."""
    by_host: dict[str, list[str]] = {}
    for m in members:
        by_host.setdefault(str(m["host"]), []).append(str(m["name"]))
    return ", ".join(f"{h}/{','.join(n)}" for h, n in by_host.items())
