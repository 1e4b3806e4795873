"""The tuning advisor: what limits each instance's throughput, with the evidence, and the change
to make - as an inventory patch the operator reviews; nothing is ever applied. Pure functions.

Diagnoses (per instance, over the observed window):

* ``mamba-bound`` - running requests pinned at the effective max (with a queue, or with the
  client's concurrency at the max), and the max is set by the Mamba state slots (``sglang:mamba_usage``
  full, ``K // slots per request`` binding). Proposed: settings that raise the effective max and
  fit in memory per :mod:`._capacity` - more ``max_mamba_cache_size``, ``mem_fraction_static`` up
  to what the GPU has idle, ``no_buffer`` / ``extra_buffer_lazy`` instead of ``extra_buffer`` where
  the release has the choice, ``max_running_requests`` raised with it.
* ``kv-bound`` - the KV cache is nearly full (``sglang:token_usage``), or its half binds the max.
  Proposed: more memory for the KV cache (``mem_fraction_static``, fewer Mamba slots where they
  are idle) - never more Mamba slots.
* ``max-running-bound`` - pinned at the max while the Mamba slots and the KV cache have room: the
  max is ``max_running_requests`` (set, or SGLang's 48 with speculative decoding). Proposed: a
  higher ``max_running_requests`` (and the Mamba slots it needs), within memory.
* ``client-bound`` - running below the max with no queue: the clients send too few requests.
  Proposed: the generation role's ``generation_concurrency`` / ``generation_concurrency_factor``,
  no server flag.
* ``compute-bound`` - none of these (or the batch already past the point where decode stops being
  memory-bound): no tuning change is expected to help much; nothing is proposed.
* ``unknown`` - not enough evidence (the instance is down, no samples, no /server_info).

Throughput model (an assumption, stated in every prediction): while decode is memory-bandwidth
bound, an instance's generation throughput is proportional to its running requests; it stops
growing once a decode step carries ``saturation_batch_tokens`` tokens (running requests x tokens
per step: ``speculative_num_draft_tokens`` with speculative decoding, else 1). Predicted throughput
= observed throughput x min(new running, knee) / min(observed running, knee). It ignores the
per-request slowdown of larger batches, so it is an upper bound.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity import (
    CapacityPlan,
    ModelFacts,
    Settings,
    plan_capacity,
    resolve_strategy,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flag_checks import ServerArgsError, validate_args
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flag_table import load_table
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._model_facts import (
    FactsResult,
    derive_model_facts,
    internal_state,
)

MAMBA_BOUND = "mamba-bound"
KV_BOUND = "kv-bound"
MAX_RUNNING_BOUND = "max-running-bound"
CLIENT_BOUND = "client-bound"
COMPUTE_BOUND = "compute-bound"
UNKNOWN = "unknown"
DIAGNOSES = (MAMBA_BOUND, KV_BOUND, MAX_RUNNING_BOUND, CLIENT_BOUND, COMPUTE_BOUND, UNKNOWN)

# Settings read from /server_info as SGLang resolved them, except those SGLang itself changes
# while resolving (they are derived again from what was asked).
_RESOLVED_BY_SGLANG = ("disable_overlap_schedule", "disable_radix_cache", "max_running_requests")
# Settings SGLang keeps as launched: where /server_info reports another value than the inventory's,
# the instance runs other settings than the inventory has (not relaunched since the inventory
# changed, or an extra-vars override such as advise --trial's canary): the running value counts.
_RUNNING_WINS = ("max_mamba_cache_size", "mem_fraction_static", "mamba_full_memory_ratio")


@dataclass(frozen=True)
class Policy:
    """The advisor's thresholds and limits (defaults documented in docs/advisor.md)."""

    # At the effective max in at least this share of the samples: running = the max, or the slots a
    # finished request freed being refilled from the queue (running + queued >= the max, a queue).
    pinned_fraction: float = 0.8
    queue_min: float = 1.0  # mean queued requests that count as a backlog
    mamba_full: float = 0.9  # sglang:mamba_usage (mean) that counts as full
    kv_full: float = 0.9  # sglang:token_usage (90th percentile) that counts as full
    client_running_below: float = 0.9  # mean running below this share of the max: not pinned
    saturation_batch_tokens: int = 256  # decode tokens per step where throughput stops growing
    max_mem_fraction_static: float = 0.93  # never proposed above (the 7 x B200 run proved 0.93)
    gpu_margin_mib: int = 4096  # idle GPU memory (nvidia-smi) left unused when raising the fraction
    kv_target_usage: float = 0.85  # predicted peak KV usage a proposal may reach
    client_headroom: float = 1.25  # client concurrency per instance: this x the effective max
    overlap_off_cost: float = 0.05  # throughput lost per step when a change turns the overlap scheduler off
    max_slots: int = 8192  # the largest max_mamba_cache_size searched


# ------------------------------------------------------------------------------------------------
# The window
# ------------------------------------------------------------------------------------------------


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
    token_usage_mean: float | None = None
    token_usage_p90: float | None = None
    mamba_usage_mean: float | None = None
    gen_throughput_mean: float | None = None
    generation_rate: float | None = None  # sglang:generation_tokens_total per second
    tokens_per_request_p90: float | None = None  # KV tokens in use per running request
    demand_mean: float | None = None  # running + queued

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def window_stats(samples: Sequence[Mapping[str, Any]], effective_max: int | None, kv_tokens: int | None) -> WindowStats:
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
    usage_key = "token_usage" if _series(samples, "token_usage") else "full_token_usage"
    usage = _series(samples, usage_key)
    stats.token_usage_mean, stats.token_usage_p90 = _mean(usage), _quantile(usage, 0.9)
    stats.mamba_usage_mean = _mean(_series(samples, "mamba_usage"))
    stats.gen_throughput_mean = _mean(_series(samples, "gen_throughput"))
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
            share = s.get("token_usage", s.get("full_token_usage"))
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


# ------------------------------------------------------------------------------------------------
# One instance
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evidence:
    """One instance as observed: the agent's ``observe`` result for it, and its inventory."""

    host: str
    name: str
    release: str
    flag_table: str  # the flag table the inventory's settings are checked against
    args: Mapping[str, Any]  # the resolved inventory settings (server_validate)
    observation: Mapping[str, Any]  # observe's per-instance result (server_info, journal, samples)
    gpu_total_mib: float | None
    gpu_used_mib_max: float | None
    env: Mapping[str, str] = field(default_factory=dict)
    window_s: float = 0.0
    interval_s: float = 0.0
    source: str = "sampled /metrics"  # or "prometheus"


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
    throughput_factor: float | None = None
    throughput_before: float | None = None
    throughput_after: float | None = None
    plan: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        for key in ("throughput_factor", "throughput_before", "throughput_after", "predicted_token_usage"):
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
        }


def current_settings(
    args: Mapping[str, Any], server_info: Mapping[str, Any] | None, env: Mapping[str, str]
) -> Settings:
    """What the instance runs: the inventory's settings, and for the ones it leaves unset the
    values the server resolved (mem_fraction_static, speculative_num_draft_tokens, ...)."""
    merged: dict[str, Any] = {}
    for key, value in (server_info or {}).items():
        if key in _RESOLVED_BY_SGLANG or isinstance(value, (dict, list)):
            continue
        merged[key] = value
    merged.update({k: v for k, v in args.items() if v is not None})
    merged.update({k: running for k, (_inventory, running) in running_drift(args, server_info).items()})
    return Settings.from_args(merged, env)


def running_drift(args: Mapping[str, Any], server_info: Mapping[str, Any] | None) -> dict[str, tuple[Any, Any]]:
    """{setting: (the inventory's, the running)} where /server_info reports another value than the
    inventory sets, for the settings SGLang keeps as launched."""
    out: dict[str, tuple[Any, Any]] = {}
    for key in _RUNNING_WINS:
        wanted, running = args.get(key), (server_info or {}).get(key)
        if wanted is None or not isinstance(running, (int, float)) or isinstance(running, bool):
            continue
        try:
            same = math.isclose(float(wanted), float(running), rel_tol=1e-9, abs_tol=1e-9)
        except (TypeError, ValueError):
            same = False
        if not same:
            out[key] = (wanted, running)
    return out


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if abs(value - round(value)) < 1e-9:
        return str(round(value))
    return f"{value:.{digits}f}"


def _strategy_words(plan: CapacityPlan, settings: Settings) -> str:
    parts = []
    if plan.strategy:
        parts.append(plan.strategy if plan.radix_cache else "radix cache off")
    parts.append("overlap on" if plan.overlap else "overlap off")
    if settings.spec:
        parts.append(f"speculative decoding, {settings.draft_tokens()} draft tokens")
    return ", ".join(parts)


def _step_tokens(settings: Settings) -> int:
    return max(1, settings.draft_tokens()) if settings.spec else 1


def _knee(settings: Settings, policy: Policy) -> int:
    return max(1, policy.saturation_batch_tokens // _step_tokens(settings))


def advise_instance(ev: Evidence, policy: Policy | None = None) -> InstanceAdvice:
    """Diagnose one instance and, where a tuning change would help, propose the best one."""
    policy = policy or Policy()
    obs = ev.observation
    advice = InstanceAdvice(host=ev.host, name=ev.name, release=ev.release, diagnosis=UNKNOWN)
    info = obs.get("server_info") if isinstance(obs.get("server_info"), Mapping) else None
    state = internal_state(info)
    eff = state.get("effective_max_running_requests_per_dp")
    eff = eff if isinstance(eff, int) else None
    kv_tokens = info.get("max_total_num_tokens") if info else None
    samples = [s for s in obs.get("samples") or [] if isinstance(s, Mapping)]
    stats = window_stats(samples, eff, kv_tokens if isinstance(kv_tokens, int) else None)
    advice.stats = stats
    if obs.get("metrics_errors"):
        advice.problems.extend(str(e) for e in obs["metrics_errors"])
    if info is None:
        advice.why.append(f"no /server_info: {obs.get('server_info_error') or 'the instance did not answer'}")
        return advice
    if eff is None:
        advice.why.append("/server_info has no internal_states[0].effective_max_running_requests_per_dp")
        return advice
    if stats.samples < 2 or stats.running_mean is None:
        advice.why.append(
            f"{stats.samples} metrics sample(s) with sglang:num_running_reqs over the window "
            "(is --enable-metrics on? does Prometheus scrape it?)"
        )
        return advice

    context_metric = next((s.get("context_len") for s in samples if s.get("context_len")), None)
    derived: FactsResult = derive_model_facts(
        ev.release, obs.get("journal") or [], info, ev.gpu_total_mib, context_metric
    )
    advice.facts = derived.to_dict()
    advice.problems.extend(f"model facts: {p}" for p in derived.problems)
    settings = current_settings(ev.args, info, ev.env)
    for key, (wanted, running) in running_drift(ev.args, info).items():
        advice.problems.append(
            f"the instance runs {key} {_yaml_scalar(running)}, the inventory has {_yaml_scalar(wanted)} "
            "(not relaunched with the inventory's settings, or an override): the advice is for what it runs"
        )
    advice.settings = {k: v for k, v in settings.__dict__.items() if v not in (None, False)}
    plan: CapacityPlan | None = None
    if derived.facts is not None and ev.gpu_total_mib:
        plan = plan_capacity(ev.release, derived.facts, ev.gpu_total_mib, settings)
        advice.capacity = plan.to_dict()
        advice.model_check = _model_check(plan, derived, eff, advice.problems)

    advice.diagnosis, advice.why = diagnose(stats, eff, settings, plan, info, ev, policy)
    if advice.diagnosis in (MAMBA_BOUND, MAX_RUNNING_BOUND, KV_BOUND):
        if plan is None or derived.facts is None or ev.gpu_total_mib is None:
            advice.problems.append("no proposal: the model's memory facts are not known (see model facts)")
            return advice
        if plan.errors:
            advice.problems.append(f"no proposal: the current settings do not reproduce: {plan.errors[0]}")
            return advice
        search = _Search(ev, derived.facts, settings, plan, stats, eff, policy)
        proposals = search.raise_kv() if advice.diagnosis == KV_BOUND else search.raise_running()
        if proposals:
            advice.proposal, advice.alternatives = proposals[0], proposals[1:4]
        else:
            advice.why.append("no change within the GPU's memory and the release's flags raises it")
    elif advice.diagnosis == CLIENT_BOUND:
        advice.proposal = _client_proposal(stats, eff, settings, policy)
    return advice


def _model_check(plan: CapacityPlan, derived: FactsResult, eff: int, problems: list[str]) -> bool:
    """Does the arithmetic reproduce what the instance reports? (K, KV tokens within 1%, the max)"""
    observed = derived.observed
    mismatches = []
    if plan.errors:
        mismatches.append(plan.errors[0])
    k_obs = observed.get("max_mamba_cache_size")
    if k_obs is not None and plan.mamba_k is not None and k_obs != plan.mamba_k:
        mismatches.append(f"max_mamba_cache_size {plan.mamba_k} computed, {k_obs} reported")
    tokens_obs = observed.get("max_total_num_tokens")
    if tokens_obs and abs(plan.kv_tokens - tokens_obs) > 0.01 * tokens_obs:
        mismatches.append(f"KV tokens {plan.kv_tokens} computed, {tokens_obs} reported")
    if plan.effective_max_running_requests != eff:
        mismatches.append(
            f"effective max running requests {plan.effective_max_running_requests} computed, {eff} reported"
        )
    if mismatches:
        problems.append(
            "the memory arithmetic does not reproduce this instance (" + "; ".join(mismatches) + "): "
            "predictions are less certain"
        )
    return not mismatches


def diagnose(
    stats: WindowStats,
    eff: int,
    settings: Settings,
    plan: CapacityPlan | None,
    info: Mapping[str, Any],
    ev: Evidence,
    policy: Policy,
) -> tuple[str, list[str]]:
    """The diagnosis and the evidence for it, in the terms of a dashboard."""
    why: list[str] = []
    pinned = (stats.pinned_fraction or 0.0) >= policy.pinned_fraction
    backlog = (stats.queue_mean or 0.0) >= policy.queue_min
    mamba_full = (stats.mamba_usage_mean or 0.0) >= policy.mamba_full
    kv_full = (stats.token_usage_p90 or 0.0) >= policy.kv_full
    binding = plan.binding if plan is not None else None
    if binding is None:
        k = internal_state(info).get("max_mamba_cache_size")
        if mamba_full and isinstance(k, int):
            binding = "mamba"
    pct = round(100 * (stats.pinned_fraction or 0.0))
    if pinned:
        refill = round(100 * (stats.refill_fraction or 0.0))
        why.append(
            f"sglang:num_running_reqs = {eff} = effective max {eff} for {pct}% of the window"
            + (f" ({refill}% just below it, the queue refilling slots freed by finished requests)" if refill else "")
        )
    else:
        why.append(
            f"sglang:num_running_reqs mean {_fmt(stats.running_mean, 1)} (max {_fmt(stats.running_max)}) "
            f"of effective max {eff}; at the max for {pct}% of the window"
        )
    why.append(f"sglang:num_queue_reqs mean {_fmt(stats.queue_mean, 1)} (max {_fmt(stats.queue_max)})")
    if stats.mamba_usage_mean is not None:
        why.append(f"sglang:mamba_usage {stats.mamba_usage_mean:.2f}")
    if stats.token_usage_mean is not None:
        why.append(
            f"sglang:token_usage {stats.token_usage_mean:.2f} (90th percentile {stats.token_usage_p90 or 0:.2f})"
        )
    tput = stats.gen_throughput_mean
    if tput is not None or stats.generation_rate is not None:
        why.append(
            f"sglang:gen_throughput mean {_fmt(tput, 1)} tok/s; "
            f"rate(sglang:generation_tokens_total) {_fmt(stats.generation_rate, 1)} tok/s"
        )
    if plan is not None and not plan.errors:
        limit = {
            "mamba": f"max_mamba_cache_size {plan.mamba_k} // {plan.mamba_ratio} Mamba slots per running request "
            f"({_strategy_words(plan, settings)})",
            "kv": f"half of the KV cache's {plan.kv_tokens} tokens",
            "requested": f"max_running_requests {plan.requested_max_running_requests}",
            "default": (
                f"SGLang's default max_running_requests {plan.requested_max_running_requests} (speculative decoding)"
                if plan.requested_max_running_requests is not None
                else "SGLang's default request pool"
            ),
        }[plan.binding]
        why.append(f"/server_info effective_max_running_requests_per_dp {eff} = {limit}")
    if ev.gpu_total_mib and ev.gpu_used_mib_max is not None:
        idle = ev.gpu_total_mib - ev.gpu_used_mib_max
        why.append(
            f"GPU memory.used at most {_fmt(ev.gpu_used_mib_max)} of {_fmt(ev.gpu_total_mib)} MiB (nvidia-smi): "
            f"{idle / 1024:.1f} GiB idle"
        )

    knee = _knee(settings, policy)
    if kv_full:
        return KV_BOUND, [*why, f"the KV cache is nearly full (token usage >= {policy.kv_full})"]
    if pinned:
        if eff >= knee:
            return COMPUTE_BOUND, [
                *why,
                f"{eff} running x {_step_tokens(settings)} tokens per step >= {policy.saturation_batch_tokens}: "
                "decode is past the point where more concurrency raises throughput",
            ]
        if binding == "kv":
            return KV_BOUND, [*why, "the KV cache sets the effective max"]
        if binding == "mamba" or mamba_full:
            return MAMBA_BOUND, [*why, "the Mamba state slots set the effective max"]
        if binding in ("requested", "default"):
            return MAX_RUNNING_BOUND, [
                *why,
                "max_running_requests sets the effective max; Mamba slots and KV have room",
            ]
    if (stats.running_mean or 0.0) < policy.client_running_below * eff and not backlog:
        return CLIENT_BOUND, [*why, "the server has room for more requests and nothing waits: the clients send too few"]
    return COMPUTE_BOUND, [*why, "no memory limit binds: no tuning change is expected to help much"]


def _client_proposal(stats: WindowStats, eff: int, settings: Settings, policy: Policy) -> Proposal:
    target = math.ceil(policy.client_headroom * eff)
    before = stats.gen_throughput_mean or stats.generation_rate
    knee = _knee(settings, policy)
    running = max(stats.running_mean or 0.0, 1e-9)
    factor = min(eff, knee) / min(running, knee)
    proposal = Proposal(
        client_changes={"generation_concurrency": "auto", "generation_concurrency_factor": policy.client_headroom},
        effective_max_before=eff,
        effective_max_after=eff,
        throughput_factor=factor,
        throughput_before=before,
        throughput_after=before * factor if before is not None else None,
        notes=[
            f"keep at least {target} requests in flight per instance ({policy.client_headroom} x the effective max "
            f"{eff}); the clients sent {_fmt(stats.demand_mean, 1)} on average (running + queued)",
            "generation_concurrency auto follows each server's effective max after a relaunch; "
            f"or set a fixed generation_concurrency: {target}",
        ],
    )
    return proposal


# ------------------------------------------------------------------------------------------------
# The search
# ------------------------------------------------------------------------------------------------


class _Search:
    """Candidate settings for one instance, each checked by the memory arithmetic, the release's
    flag table and the KV headroom; best first."""

    def __init__(
        self,
        ev: Evidence,
        facts: ModelFacts,
        settings: Settings,
        plan: CapacityPlan,
        stats: WindowStats,
        eff: int,
        policy: Policy,
    ) -> None:
        self.ev, self.facts, self.settings, self.plan = ev, facts, settings, plan
        self.stats, self.eff, self.policy = stats, eff, policy
        self.knee = _knee(settings, policy)
        self.table = load_table()
        # KV the running requests need: what they used per request, at most this share of the cache;
        # and never fewer tokens than one request of the full context (or than now, if already fewer).
        self.tokens_per_request = stats.tokens_per_request_p90 or 0.0
        self.min_tokens = min(facts.context_length, plan.kv_tokens)
        self.throughput = stats.gen_throughput_mean or stats.generation_rate

    # -- limits -------------------------------------------------------------------------------

    def mfs_max(self) -> float:
        """The highest mem_fraction_static the GPU's idle memory allows (never lower than now)."""
        now = self.plan.mem_fraction_static
        total, used = self.ev.gpu_total_mib, self.ev.gpu_used_mib_max
        if not total or used is None:
            return now
        idle = total - used - self.policy.gpu_margin_mib
        top = min(self.policy.max_mem_fraction_static, now + idle / total)
        top = math.floor(top * 100 + 1e-9) / 100
        return max(now, top)

    def strategy_options(self) -> list[str | None]:
        """None (as now) and the strategies the release's table offers that need fewer slots."""
        options: list[str | None] = [None]
        if not self.facts.hybrid or not self.plan.radix_cache:
            return options
        flag = self._strategy_flag()
        choices = set(flag.choices or ()) if flag is not None else set()
        now = self.plan.strategy
        if now == "extra_buffer":
            options += [s for s in ("extra_buffer_lazy", "no_buffer") if s in choices]
        elif now == "extra_buffer_lazy" and "no_buffer" in choices:
            options.append("no_buffer")
        return options

    def _strategy_flag(self) -> Any:
        flags = self.table.flags(self.ev.flag_table) if self.table.supports(self.ev.flag_table) else {}
        return flags.get("mamba_radix_cache_strategy") or flags.get("mamba_scheduler_strategy")

    def strategy_key(self) -> str:
        for key in ("mamba_radix_cache_strategy", "mamba_scheduler_strategy"):
            if key in self.ev.args:
                return key
        flag = self._strategy_flag()
        return str(flag.name) if flag is not None else "mamba_radix_cache_strategy"

    # -- evaluation ---------------------------------------------------------------------------

    def kv_ok(self, plan: CapacityPlan) -> bool:
        if plan.errors or plan.kv_tokens < self.min_tokens:
            return False
        need = plan.effective_max_running_requests * self.tokens_per_request
        return need <= self.policy.kv_target_usage * plan.kv_tokens

    def evaluate(self, settings: Settings) -> CapacityPlan:
        return plan_capacity(self.ev.release, self.facts, self.ev.gpu_total_mib or 0.0, settings)

    def proposal(self, new: Settings, plan: CapacityPlan, running_after: float, notes: list[str]) -> Proposal | None:
        changes = self.changes(new)
        if not changes:
            return None
        try:
            validate_args({k: v[1] for k, v in changes.items()}, self.ev.flag_table, where="proposal")
        except ServerArgsError as exc:
            notes.append(f"refused by the flag table of SGLang {self.ev.flag_table}: {exc.problems}")
            return None
        demand = self.stats.demand_mean
        new_max = plan.effective_max_running_requests
        if (self.stats.queue_mean or 0.0) >= self.policy.queue_min:
            if demand is not None and demand < running_after:
                running_after = demand
                notes.append(
                    f"the clients sent {_fmt(demand, 1)} requests on average (running + queued): the prediction "
                    f"counts that many running; keep at least {new_max} in flight per instance to use the new max "
                    "(generation_concurrency / generation_concurrency_factor)"
                )
        else:
            notes.append(
                "nothing was queued: the prediction assumes the clients follow the server's max "
                "(generation_concurrency auto does)"
            )
        running_before = max(self.stats.running_mean or 0.0, 1e-9)
        factor = min(running_after, self.knee) / min(running_before, self.knee)
        if self.plan.overlap and not plan.overlap:
            factor *= 1 - self.policy.overlap_off_cost
        usage = None
        if plan.kv_tokens and self.tokens_per_request:
            usage = plan.effective_max_running_requests * self.tokens_per_request / plan.kv_tokens
        notes.append(
            "throughput model: proportional to running requests while decode is memory-bound, up to "
            f"{self.policy.saturation_batch_tokens} tokens per decode step ({self.knee} running requests here)"
        )
        return Proposal(
            changes=changes,
            effective_max_before=self.eff,
            effective_max_after=plan.effective_max_running_requests,
            binding_after=plan.binding,
            kv_tokens_after=plan.kv_tokens,
            predicted_token_usage=usage,
            throughput_factor=factor,
            throughput_before=self.throughput,
            throughput_after=self.throughput * factor if self.throughput is not None else None,
            plan=plan.to_dict(),
            notes=notes,
        )

    def changes(self, new: Settings) -> dict[str, list[Any]]:
        """Settings that differ, under the names the inventory (or the release) uses."""
        old = self.settings
        out: dict[str, list[Any]] = {}
        if new.max_mamba_cache_size != old.max_mamba_cache_size:
            out["max_mamba_cache_size"] = [old.max_mamba_cache_size, new.max_mamba_cache_size]
        if new.mem_fraction_static != old.mem_fraction_static:
            out["mem_fraction_static"] = [old.mem_fraction_static, new.mem_fraction_static]
        if new.max_running_requests != old.max_running_requests:
            out["max_running_requests"] = [old.max_running_requests, new.max_running_requests]
        if new.mamba_scheduler_strategy != old.mamba_scheduler_strategy:
            out[self.strategy_key()] = [old.mamba_scheduler_strategy, new.mamba_scheduler_strategy]
        return out

    @staticmethod
    def rank(p: Proposal) -> tuple[float, int, int]:
        invasive = 2 * any(k.startswith("mamba_") and k.endswith("strategy") for k in p.changes) + int(
            "mem_fraction_static" in p.changes
        )
        slots = (p.changes.get("max_mamba_cache_size") or [0, 0])[1] or 0
        return (-round(p.throughput_factor or 0.0, 3), invasive, slots)

    # -- raise the effective max (mamba-bound, max-running-bound) ----------------------------

    def raise_running(self) -> list[Proposal]:
        found: dict[str, Proposal] = {}
        mfs_now = self.plan.mem_fraction_static
        mfs_options = [mfs_now]
        top = self.mfs_max()
        if top > mfs_now + 0.004:
            mfs_options.append(top)
        for strategy in self.strategy_options():
            for mfs in mfs_options:
                notes: list[str] = []
                base = self.settings.with_changes(mem_fraction_static=mfs)
                if strategy is not None:
                    base = base.with_changes(mamba_scheduler_strategy=strategy)
                    resolved = resolve_strategy(self.ev.release, base, self.facts.architecture)
                    if not resolved.overlap and self.plan.overlap:
                        notes.append(
                            f"{strategy} turns SGLang's overlap scheduler off: counted as "
                            f"{self.policy.overlap_off_cost:.0%} less throughput per step"
                        )
                if mfs != mfs_now:
                    notes.append(
                        f"mem_fraction_static {mfs}: {_fmt((mfs - mfs_now) * (self.ev.gpu_total_mib or 0) / 1024, 1)} "
                        "GiB more for the pools, within the memory nvidia-smi saw idle"
                    )
                candidate = self.best_slots(base) if self.facts.hybrid else self.best_running(base)
                if candidate is None:
                    continue
                new, plan = candidate
                if plan.effective_max_running_requests <= self.eff:
                    continue
                prop = self.proposal(new, plan, plan.effective_max_running_requests, notes)
                if prop is not None:
                    found.setdefault(json.dumps(prop.changes, sort_keys=True), prop)
        return sorted(found.values(), key=self.rank)

    def with_slots(self, base: Settings, k: int) -> Settings:
        ratio = resolve_strategy(self.ev.release, base, self.facts.architecture).ratio
        running = max(1, k // ratio)
        mrr = self._max_running(base, running)
        return base.with_changes(max_mamba_cache_size=k, max_running_requests=mrr)

    def _max_running(self, base: Settings, running: int) -> int | None:
        """max_running_requests so that it does not bind below ``running``: unchanged when it is
        already at least that (or unset without speculative decoding), else ``running``."""
        now = base.max_running_requests
        if now is None and not base.spec:
            return None
        limit = now if now is not None else 48
        return now if limit >= running else running

    def best_slots(self, base: Settings) -> tuple[Settings, CapacityPlan] | None:
        """The fewest Mamba slots reaching the highest effective max that fits (up to the knee)."""
        ratio = resolve_strategy(self.ev.release, base, self.facts.architecture).ratio
        lo, hi = ratio, max(ratio, self.policy.max_slots)
        if not self.kv_ok(self.evaluate(self.with_slots(base, lo))):
            return None
        while lo < hi:  # the largest K whose plan fits: fewer KV tokens as K grows
            mid = (lo + hi + 1) // 2
            if self.kv_ok(self.evaluate(self.with_slots(base, mid))):
                lo = mid
            else:
                hi = mid - 1
        top = self.evaluate(self.with_slots(base, lo)).effective_max_running_requests
        target = min(top, max(self.knee, self.eff + 1))
        k = min(lo, target * ratio)
        while k > ratio:  # fewest slots with the same effective max
            if self.evaluate(self.with_slots(base, k - 1)).effective_max_running_requests < target:
                break
            k -= 1
        new = self.with_slots(base, k)
        plan = self.evaluate(new)
        if not self.kv_ok(plan):
            return None
        return new, plan

    def best_running(self, base: Settings) -> tuple[Settings, CapacityPlan] | None:
        """Models without Mamba state: the highest max_running_requests the KV cache holds."""
        best = None
        for running in range(self.eff + 1, max(self.knee, self.eff + 1) + 1):
            new = base.with_changes(max_running_requests=running)
            plan = self.evaluate(new)
            if not self.kv_ok(plan) or plan.effective_max_running_requests < running:
                break
            best = (new, plan)
        return best

    # -- more KV (kv-bound) -------------------------------------------------------------------

    def raise_kv(self) -> list[Proposal]:
        found: dict[str, Proposal] = {}
        tokens_now = max(self.plan.kv_tokens, 1)
        running_now = max(self.stats.running_mean or 0.0, 1e-9)
        mfs_now = self.plan.mem_fraction_static
        candidates: list[tuple[Settings, list[str]]] = []
        top = self.mfs_max()
        if top > mfs_now + 0.004:
            candidates.append(
                (
                    self.settings.with_changes(mem_fraction_static=top),
                    [f"mem_fraction_static {top}: more for the KV cache"],
                )
            )
        k_now = self.plan.mamba_k
        ratio = self.plan.mamba_ratio or 1
        running_peak = math.ceil(self.stats.running_max or self.eff)
        if self.facts.hybrid and k_now and (self.stats.mamba_usage_mean or 1.0) < self.policy.mamba_full:
            # Fewer Mamba slots: as many as the running requests used, and a fifth more.
            k_new = max(ratio, math.ceil(running_peak * 1.2) * ratio)
            if k_new < k_now:
                for mfs in {mfs_now, top}:
                    new = self.settings.with_changes(max_mamba_cache_size=k_new, mem_fraction_static=mfs)
                    candidates.append((new, [f"max_mamba_cache_size {k_new}: the Mamba slots were idle"]))
        for new, notes in candidates:
            plan = self.evaluate(new)
            if plan.errors or plan.kv_tokens <= tokens_now:
                continue
            if self.facts.hybrid and (plan.mamba_k or 0) > (k_now or 0):
                continue  # never more Mamba slots for a KV-bound instance
            running_after = min(plan.effective_max_running_requests, running_now * plan.kv_tokens / tokens_now)
            prop = self.proposal(new, plan, running_after, list(notes))
            if prop is not None:
                prop.notes.insert(
                    0,
                    f"KV tokens {tokens_now} -> {plan.kv_tokens}: the running requests the KV cache limits "
                    "grow with it",
                )
                found.setdefault(json.dumps(prop.changes, sort_keys=True), prop)
        return sorted(found.values(), key=self.rank)


# ------------------------------------------------------------------------------------------------
# The fleet: report and inventory patch
# ------------------------------------------------------------------------------------------------


def _group_key(a: Mapping[str, Any]) -> str:
    prop = a.get("proposal") or {}
    return json.dumps(
        [
            a.get("release"),
            a.get("settings"),
            a.get("diagnosis"),
            prop.get("changes"),
            prop.get("client_changes"),
        ],
        sort_keys=True,
        default=str,
    )


def _names(members: Sequence[Mapping[str, Any]]) -> str:
    by_host: dict[str, list[str]] = {}
    for m in members:
        by_host.setdefault(str(m["host"]), []).append(str(m["name"]))
    return ", ".join(f"{h}/{','.join(n)}" for h, n in by_host.items())


def fleet_report(
    advices: Iterable[Mapping[str, Any]],
    inventory: Mapping[str, Mapping[str, Any]] | None = None,
    meta: Mapping[str, Any] | None = None,
    host_problems: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The fleet's advice: the instances grouped by identical settings, diagnosis and proposal,
    and the inventory patch (per host ``sglang_server_host_args``; ``generation`` group variables).

    ``inventory`` maps each host to its layers: ``sglang_server_host_args``, ``sglang_server_args``
    (the group's) and ``instance_args`` ({instance: args} of ``sglang_server_instances``).
    """
    items = [dict(a) for a in advices]
    groups: dict[str, list[dict[str, Any]]] = {}
    for a in items:
        groups.setdefault(_group_key(a), []).append(a)
    out_groups = []
    for members in groups.values():
        first = members[0]
        out_groups.append(
            {
                "instances": [f"{m['host']}/{m['name']}" for m in members],
                "label": _names(members),
                "release": first.get("release"),
                "diagnosis": first.get("diagnosis"),
                "why": first.get("why"),
                "proposal": first.get("proposal"),
                "alternatives": first.get("alternatives") or [],
                "problems": sorted({p for m in members for p in m.get("problems") or []}),
            }
        )
    out_groups.sort(key=lambda g: (DIAGNOSES.index(g["diagnosis"]) if g["diagnosis"] in DIAGNOSES else 99, g["label"]))
    patch, patch_notes = build_patch(items, inventory or {})
    counts: dict[str, int] = {}
    for a in items:
        counts[a["diagnosis"]] = counts.get(a["diagnosis"], 0) + 1
    return {
        "format": 1,
        **dict(meta or {}),
        "diagnoses": counts,
        "groups": out_groups,
        "instances": items,
        "patch": patch,
        "patch_notes": patch_notes,
        "host_problems": dict(host_problems or {}),
        "advice_produced": bool(items),
    }


def build_patch(
    advices: Sequence[Mapping[str, Any]], inventory: Mapping[str, Mapping[str, Any]]
) -> tuple[dict[str, Any], list[str]]:
    """``{"host_vars": {host: {"sglang_server_host_args": {...}}}, "group_vars": {...}}``: each host's
    whole ``sglang_server_host_args`` with the proposed changes (Ansible replaces a dict variable,
    it does not merge it), and the generation clients' concurrency for client-bound instances."""
    notes: list[str] = []
    host_vars: dict[str, Any] = {}
    group_vars: dict[str, Any] = {}
    by_host: dict[str, list[Mapping[str, Any]]] = {}
    for a in advices:
        if (a.get("proposal") or {}).get("changes"):
            by_host.setdefault(str(a["host"]), []).append(a)
        client = (a.get("proposal") or {}).get("client_changes")
        if client:
            group_vars.setdefault("generation", {}).update(client)
    for host, members in sorted(by_host.items()):
        proposals = {json.dumps(m["proposal"]["changes"], sort_keys=True) for m in members}
        chosen = min(members, key=lambda m: m["proposal"].get("effective_max_after") or 0)
        if len(proposals) > 1:
            notes.append(
                f"{host}: its instances got different proposals; the patch has the most conservative one "
                f"({chosen['name']}'s) - check it against the others: {', '.join(sorted(proposals))}"
            )
        layers = inventory.get(host) or {}
        host_args = dict(layers.get("sglang_server_host_args") or {})
        changed: dict[str, list[Any]] = dict(chosen["proposal"]["changes"])
        previous = {key: host_args[key] for key in changed if key in host_args}
        for key, (_old, new) in changed.items():
            host_args[key] = new
        for inst, args in (layers.get("instance_args") or {}).items():
            shadowed = sorted(set(changed) & set(args or {}))
            if shadowed:
                notes.append(
                    f"{host}: instance {inst} sets {', '.join(shadowed)} in sglang_server_instances, which wins "
                    "over sglang_server_host_args: change it there"
                )
        host_vars[host] = {
            "sglang_server_host_args": host_args,
            "_changes": changed,
            "_previous": previous,
            "_why": f"{_names(members)}: {chosen['diagnosis']}",
        }
    return {"host_vars": host_vars, "group_vars": group_vars}, notes


def _yaml_scalar(value: Any) -> str:
    """JSON is YAML: strings quoted, numbers, booleans and null as YAML reads them."""
    return json.dumps(value, sort_keys=True)


def patch_yaml(report: Mapping[str, Any]) -> str:
    """The patch as a YAML file the operator reviews, with the reason and the old value of every
    changed key in comments."""
    patch = report.get("patch") or {}
    lines = [
        "---",
        "# sglang-fleet tuning advice" + (f", {report['created']}" if report.get("created") else "") + ".",
        "# Written by playbooks/advise.yml; nothing was applied. Review it, copy each block into the",
        "# inventory file it names, then: ansible-playbook retune.yml --check --diff",
    ]
    for note in report.get("patch_notes") or []:
        lines.append(f"# NOTE: {note}")
    host_vars = patch.get("host_vars") or {}
    group_vars = patch.get("group_vars") or {}
    if not host_vars and not group_vars:
        lines.append("# No tuning change is proposed.")
    lines.append("host_vars:" + (" {}" if not host_vars else ""))
    for host, entry in host_vars.items():
        lines.append(f"  {host}:  # host_vars/{host}.yml")
        lines.append(f"    # {entry.get('_why')}")
        changes = entry.get("_changes") or {}
        previous = entry.get("_previous") or {}
        lines.append("    sglang_server_host_args:")
        for key, value in entry["sglang_server_host_args"].items():
            comment = ""
            if key in previous:
                comment = f"  # was {_yaml_scalar(previous[key])}"
            elif key in changes:
                ran = changes[key][0]
                comment = "  # added; the server ran " + ("SGLang's default" if ran is None else _yaml_scalar(ran))
            lines.append(f"      {key}: {_yaml_scalar(value)}{comment}")
    lines.append("group_vars:" + (" {}" if not group_vars else ""))
    for group, values in group_vars.items():
        lines.append(f"  {group}:  # group_vars/{group}.yml (the hosts that run the generation client)")
        for key, value in values.items():
            lines.append(f"    {key}: {_yaml_scalar(value)}")
    return "\n".join(lines) + "\n"


def _change_words(changes: Mapping[str, Sequence[Any]]) -> list[str]:
    return [
        f"{key}: {'unset' if old is None else _yaml_scalar(old)} -> {_yaml_scalar(new)}"
        for key, (old, new) in changes.items()
    ]


def report_text(report: Mapping[str, Any], patch_path: str | None = None) -> str:
    """The report for people: per group of instances, the diagnosis, why (metrics to check on a
    dashboard), the proposal and what it is predicted to give."""
    head = "sglang-fleet advice"
    if report.get("window_s") is not None:
        head += f" ({report.get('source', 'sampled /metrics')}, window {_fmt(report['window_s'])} s"
        if report.get("interval_s"):
            head += f", every {_fmt(report['interval_s'])} s"
        head += ")"
    lines = [head + "; nothing was changed", ""]
    for group in report.get("groups") or []:
        count = len(group["instances"])
        lines.append(
            f"{group['label']} ({count} instance{'s' if count != 1 else ''}, SGLang {group['release']}): "
            f"{str(group['diagnosis']).upper()}"
        )
        for i, line in enumerate(group.get("why") or []):
            lines.append(("  why: " if i == 0 else "       ") + line)
        prop = group.get("proposal")
        if prop:
            if prop.get("changes"):
                lines.append("  proposal (inventory, sglang_server_host_args):")
                lines += [f"       {w}" for w in _change_words(prop["changes"])]
            if prop.get("client_changes"):
                lines.append("  proposal (generation clients, not the servers):")
                lines += [f"       {k}: {_yaml_scalar(v)}" for k, v in prop["client_changes"].items()]
            predicted = (
                f"  predicted: effective max running requests {prop.get('effective_max_before')} -> "
                f"{prop.get('effective_max_after')}"
            )
            if prop.get("binding_after"):
                predicted += f" (then bound by {prop['binding_after']})"
            if prop.get("kv_tokens_after"):
                predicted += f"; KV {prop['kv_tokens_after']} tokens"
            if prop.get("predicted_token_usage") is not None:
                predicted += f", token usage ~{prop['predicted_token_usage']:.2f} at the new max"
            lines.append(predicted)
            if prop.get("throughput_factor") is not None:
                tput = f"  throughput x{prop['throughput_factor']:.2f}"
                if prop.get("throughput_before") is not None and prop.get("throughput_after") is not None:
                    before, after = _fmt(prop["throughput_before"], 0), _fmt(prop["throughput_after"], 0)
                    tput += f" ({before} -> {after} tok/s per instance)"
                lines.append(tput)
            lines += [f"  note: {n}" for n in prop.get("notes") or []]
        elif group["diagnosis"] not in (COMPUTE_BOUND, UNKNOWN):
            lines.append("  proposal: none")
        else:
            lines.append("  proposal: none (no tuning change is expected to help)")
        for alt in (group.get("alternatives") or [])[:3]:
            lines.append(
                f"  alternative: {'; '.join(_change_words(alt.get('changes') or {}))} -> effective max "
                f"{alt.get('effective_max_after')}, throughput x{(alt.get('throughput_factor') or 0):.2f}"
            )
        lines += [f"  problem: {p}" for p in group.get("problems") or []]
        lines.append("")
    for host, problem in (report.get("host_problems") or {}).items():
        lines.append(f"{host}: no advice: {problem}")
    for note in report.get("patch_notes") or []:
        lines.append(f"note: {note}")
    if patch_path:
        lines.append(
            f"patch: {patch_path} (review it, copy it into the inventory, then "
            "ansible-playbook retune.yml --check --diff)"
        )
    return "\n".join(lines).rstrip("\n") + "\n"


def evidence_from_observation(
    host: str,
    instance: Mapping[str, Any],
    observation: Mapping[str, Any],
    gpus: Mapping[str, Mapping[str, Any]],
    window_s: float,
    interval_s: float,
    source: str = "sampled /metrics",
) -> Evidence:
    """:class:`Evidence` from a resolved instance (server_validate) and observe's result."""
    indexes = [str(g) for g in instance.get("gpus") or []]
    seen = [gpus[i] for i in indexes if i in gpus]
    total = min((float(g["total_mib"]) for g in seen), default=None)
    used = max((float(g["used_mib_max"]) for g in seen), default=None)
    return Evidence(
        host=host,
        name=str(instance["name"]),
        release=str(instance.get("version")),
        flag_table=str(instance.get("flag_table") or instance.get("version")),
        args=dict(instance.get("args") or {}),
        env=dict(instance.get("env") or {}),
        observation=observation,
        gpu_total_mib=total,
        gpu_used_mib_max=used,
        window_s=window_s,
        interval_s=interval_s,
        source=source,
    )
