"""The tuning advisor: what limits each instance's throughput, with the evidence, and the change
to make - as an inventory patch the operator reviews; nothing is ever applied. Pure functions.

Diagnoses (per instance, over the observed window):

* ``mamba-bound`` - running requests pinned at the effective max (with a queue, or with the
  client's concurrency at the max), and the max is set by the Mamba state slots (``sglang:mamba_usage``
  full, ``K // slots per request`` binding). Proposed: settings that raise the effective max and
  fit in memory per :mod:`._capacity` - more ``max_mamba_cache_size``, ``mem_fraction_static`` up
  to what the GPU has idle, ``no_buffer`` / ``extra_buffer_lazy`` instead of ``extra_buffer`` where
  the release has the choice, ``max_running_requests`` raised with it.
* ``kv-bound`` - the KV cache is nearly full (``sglang:full_token_usage``; 0.5.9: ``sglang:token_usage``),
  or its half binds the max.
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

Throughput model, stated in every prediction: *expected* is read off the instance's own decode
step time as a function of its running requests, fitted to its window or to the opt-in stepped
measurement (:mod:`.throughput`), else the documented exponent; *at most* is throughput
proportional to running requests up to ``saturation_batch_tokens`` tokens per decode step (running
requests x ``speculative_num_draft_tokens`` with speculative decoding, else 1), an upper bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.evidence import (
    Evidence,
    current_settings,
    running_drift,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.search import ProposalSearch, client_proposal
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.throughput import instance_model
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.vocabulary import (
    CLIENT_BOUND,
    COMPUTE_BOUND,
    DIAGNOSES,
    KV_BOUND,
    MAMBA_BOUND,
    MAX_RUNNING_BOUND,
    UNKNOWN,
    InstanceAdvice,
    Policy,
    Proposal,
    fmt,
    knee,
    step_tokens,
    yaml_scalar,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.window import (
    WindowStats,
    window_series,
    window_stats,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.inputs import Settings
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.model_facts import (
    FactsResult,
    derive_model_facts,
    internal_state,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.plan import CapacityPlan, plan_capacity
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._releases.facts import release_facts

# The advisor's names, for its callers (the action plugin, the tests).
__all__ = [
    "CLIENT_BOUND",
    "COMPUTE_BOUND",
    "DIAGNOSES",
    "KV_BOUND",
    "MAMBA_BOUND",
    "MAX_RUNNING_BOUND",
    "UNKNOWN",
    "Evidence",
    "InstanceAdvice",
    "Policy",
    "Proposal",
    "advise_instance",
    "diagnose",
    "window_stats",
]


def _strategy_words(plan: CapacityPlan, settings: Settings) -> str:
    parts = []
    if plan.strategy:
        parts.append(plan.strategy if plan.radix_cache else "radix cache off")
    parts.append("overlap on" if plan.overlap else "overlap off")
    if settings.spec:
        parts.append(f"speculative decoding, {settings.draft_tokens()} draft tokens")
    return ", ".join(parts)


# Complexity checked by people: the diagnoses in priority order, one after the other.
def advise_instance(ev: Evidence, policy: Policy | None = None) -> InstanceAdvice:  # noqa: PLR0915
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
    facts = release_facts(ev.flag_table)
    kv_metric = facts.kv_usage_metric if facts is not None else None
    stats = window_stats(samples, eff, kv_tokens if isinstance(kv_tokens, int) else None, kv_metric)
    advice.stats = stats
    advice.series = window_series(samples)
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
    drift = running_drift(ev.args, info)
    settings = current_settings(ev.args, info, ev.env, drift)
    advice.drift = {key: [wanted, running] for key, (wanted, running) in drift.items()}
    if advice.drift:
        advice.problems.append(
            "the instance runs "
            + ", ".join(f"{key} {yaml_scalar(running)}" for key, (_wanted, running) in advice.drift.items())
            + " where the inventory has "
            + ", ".join(yaml_scalar(wanted) for wanted, _running in advice.drift.values())
            + " (not relaunched since the inventory changed, or an override): the advice is for what it runs"
        )
    advice.settings = {k: v for k, v in settings.__dict__.items() if v not in (None, False)}
    plan: CapacityPlan | None = None
    if derived.facts is not None and ev.gpu_total_mib:
        plan = plan_capacity(ev.release, derived.facts, ev.gpu_total_mib, settings)
        advice.capacity = plan.to_dict()
        advice.model_check = _model_check(plan, derived, eff, advice.problems)

    if not stats.running_max and not stats.queue_max:
        # Nothing ran: no limit was reached, and no throughput to scale (a gain over nothing).
        # The instance's facts and capacity above still stand.
        advice.why.append(
            f"the window was idle: sglang:num_running_reqs and sglang:num_queue_reqs were 0 in all {stats.samples} "
            "samples; measure while the job sends requests"
        )
        return advice
    cap = derived.observed.get("logged_mamba_cap")
    mamba_capped = isinstance(cap, Mapping) and cap.get("max_running_requests") == eff
    advice.diagnosis, advice.why = diagnose(stats, eff, settings, plan, info, ev, policy, mamba_capped)
    model = instance_model(obs, settings.spec, policy.fit_min_spread, policy.scaling_exponent, policy.fit_min_r2)
    if advice.diagnosis in (MAMBA_BOUND, MAX_RUNNING_BOUND, KV_BOUND):
        if plan is None or derived.facts is None or ev.gpu_total_mib is None:
            advice.problems.append("no proposal: the model's memory facts are not known (see model facts)")
            return advice
        if plan.errors:
            advice.problems.append(f"no proposal: the current settings do not reproduce: {plan.errors[0]}")
            return advice
        search = ProposalSearch(ev, derived.facts, settings, plan, stats, eff, policy, model)
        proposals = search.raise_kv() if advice.diagnosis == KV_BOUND else search.raise_running()
        if proposals:
            advice.proposal, advice.alternatives = proposals[0], proposals[1:4]
        else:
            advice.why.append("no change within the GPU's memory and the release's flags raises it")
    elif advice.diagnosis == CLIENT_BOUND:
        advice.proposal = client_proposal(stats, eff, settings, policy, model)
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
    mamba_capped: bool = False,
) -> tuple[str, list[str]]:
    """The diagnosis and the evidence for it, in the terms of a dashboard.

    What caps the running requests is ``effective_max_running_requests_per_dp`` against the
    running requests and the queue, and the memory arithmetic (or, without it, the 0.5.18+
    journal's "capped ... by the mamba state cache" line) says what sets it. ``sglang:mamba_usage``
    is occupancy (slots held by running and radix-cached requests over the pool, 0.5.23
    ``pool_stats_observer.py:270-293``): at the cap it need not be near 1, so it is shown, not used.
    """
    why: list[str] = []
    pinned = (stats.pinned_fraction or 0.0) >= policy.pinned_fraction
    backlog = (stats.queue_mean or 0.0) >= policy.queue_min
    kv_full = (stats.kv_usage_p90 or 0.0) >= policy.kv_full
    binding = plan.binding if plan is not None else None
    if binding is None and mamba_capped:
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
            f"sglang:num_running_reqs mean {fmt(stats.running_mean, 1)} (max {fmt(stats.running_max)}) "
            f"of effective max {eff}; at the max for {pct}% of the window"
        )
    why.append(f"sglang:num_queue_reqs mean {fmt(stats.queue_mean, 1)} (max {fmt(stats.queue_max)})")
    # A dense model has no Mamba pool (SGLang exports the gauge at 0 all the same): not shown.
    hybrid = plan.mamba_k is not None if plan is not None else (mamba_capped or (stats.mamba_usage_mean or 0.0) > 0)
    if stats.mamba_usage_mean is not None and hybrid:
        why.append(f"sglang:mamba_usage {stats.mamba_usage_mean:.2f} (occupancy of the Mamba pool)")
    if stats.kv_usage_mean is not None:
        why.append(f"{stats.kv_usage_metric} {stats.kv_usage_mean:.2f} (90th percentile {stats.kv_usage_p90 or 0:.2f})")
    tput = stats.gen_throughput_mean
    if tput is not None or stats.generation_rate is not None:
        why.append(
            f"sglang:gen_throughput mean {fmt(tput, 1)} tok/s; "
            f"rate(sglang:generation_tokens_total) {fmt(stats.generation_rate, 1)} tok/s"
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
            f"GPU memory.used at most {fmt(ev.gpu_used_mib_max)} of {fmt(ev.gpu_total_mib)} MiB (nvidia-smi): "
            f"{idle / 1024:.1f} GiB idle"
        )

    decode_knee = knee(settings, policy)
    if kv_full:
        return KV_BOUND, [*why, f"the KV cache is nearly full ({stats.kv_usage_metric} >= {policy.kv_full})"]
    if pinned:
        if eff >= decode_knee:
            return COMPUTE_BOUND, [
                *why,
                f"{eff} running x {step_tokens(settings)} tokens per step >= {policy.saturation_batch_tokens}: "
                "decode is past the point where more concurrency raises throughput",
            ]
        if binding == "kv":
            return KV_BOUND, [*why, "the KV cache sets the effective max"]
        if binding == "mamba":
            return MAMBA_BOUND, [*why, "the Mamba state slots set the effective max"]
        if binding in ("requested", "default"):
            return MAX_RUNNING_BOUND, [
                *why,
                "max_running_requests sets the effective max; "
                + ("Mamba slots and KV have room" if hybrid else "the KV cache has room"),
            ]
    if (stats.running_mean or 0.0) < policy.client_running_below * eff and not backlog:
        return CLIENT_BOUND, [*why, "the server has room for more requests and nothing waits: the clients send too few"]
    return COMPUTE_BOUND, [*why, "no memory limit binds: no tuning change is expected to help much"]
