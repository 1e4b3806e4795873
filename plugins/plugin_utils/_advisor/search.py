"""The advisor's proposals: the candidate settings for one instance, each checked by the memory
arithmetic (:mod:`_capacity.plan`), the release's flag table and the KV headroom, best first; and
the clients' concurrency for a client-bound instance.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.evidence import Evidence, client_demand_after
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.throughput import ThroughputModel
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.vocabulary import (
    Policy,
    Proposal,
    fmt,
    knee,
    throughput_factors,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.window import WindowStats
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.defaults import resolve_strategy
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.inputs import ModelFacts, Settings
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.plan import CapacityPlan, plan_capacity
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.checks import ServerArgsError, validate_args
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.table import load_table
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._releases.facts import (
    required_switches,
    startup_refusals,
)


def client_proposal(
    stats: WindowStats, eff: int, settings: Settings, policy: Policy, model: ThroughputModel
) -> Proposal:
    target = math.ceil(policy.client_headroom * eff)
    before = stats.gen_throughput_mean or stats.generation_rate
    decode_knee = knee(settings, policy)
    factor, expected = throughput_factors(eff, stats.running_mean or 0.0, decode_knee, model)
    proposal = Proposal(
        client_changes={"generation_concurrency": "auto", "generation_concurrency_factor": policy.client_headroom},
        effective_max_before=eff,
        effective_max_after=eff,
        throughput_factor=factor,
        throughput_before=before,
        throughput_after=before * factor if before is not None else None,
        throughput_factor_expected=expected,
        throughput_model=model.to_dict(),
        notes=[
            f"keep at least {target} requests in flight per instance ({policy.client_headroom} x the effective max "
            f"{eff}); the clients sent {fmt(stats.demand_mean, 1)} on average (running + queued)",
            "generation_concurrency auto follows each server's effective max after a relaunch; "
            f"or set a fixed generation_concurrency: {target}",
        ],
    )
    return proposal


class ProposalSearch:
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
        model: ThroughputModel,
    ) -> None:
        self.ev, self.facts, self.settings, self.plan = ev, facts, settings, plan
        self.stats, self.eff, self.policy, self.model = stats, eff, policy, model
        self.knee = knee(settings, policy)
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

    def required_switches(self, settings: Settings) -> dict[str, bool]:
        """What the release needs on with this strategy (no_buffer on 0.5.14+: the overlap
        scheduler off, or it refuses to start)."""
        needed = required_switches(
            self.ev.release,
            {
                "mamba_radix_cache_strategy": settings.mamba_scheduler_strategy,
                "disable_radix_cache": settings.disable_radix_cache,
                "disable_overlap_schedule": settings.disable_overlap_schedule,
            },
        )
        return {k: v for k, v in needed.items() if k in Settings.__dataclass_fields__}

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
        refusals = self.startup_refusals(changes)
        if refusals:
            notes.append(f"refused at startup by SGLang {self.ev.flag_table}: {refusals}")
            return None
        demand = self.stats.demand_mean
        new_max = plan.effective_max_running_requests
        known = client_demand_after(self.ev.observation, demand, new_max)
        if known is not None:
            sends, words = known
            running_after = min(running_after, sends)
            notes.append(
                f"the generation clients on the host will send {fmt(sends, 1)} requests at the new max ("
                + "; ".join(words)
                + ")"
                + (
                    f": the prediction counts that many running; keep at least {new_max} in flight per instance "
                    "to use the new max (generation_concurrency / generation_concurrency_factor)"
                    if sends < new_max
                    else ""
                )
            )
        elif (self.stats.queue_mean or 0.0) >= self.policy.queue_min:
            if demand is not None and demand < running_after:
                running_after = demand
                notes.append(
                    f"the clients sent {fmt(demand, 1)} requests on average (running + queued): the prediction "
                    f"counts that many running; keep at least {new_max} in flight per instance to use the new max "
                    "(generation_concurrency / generation_concurrency_factor)"
                )
        else:
            notes.append(
                "nothing was queued: the prediction assumes the clients follow the server's max "
                "(generation_concurrency auto does)"
            )
        occupancy = self.occupancy()
        if occupancy < 0.95:
            running_after *= occupancy
            notes.append(
                f"over the window {fmt(self.stats.running_mean, 1)} requests ran of the {fmt(self.held_before(), 1)} "
                f"the server could hold for the clients ({occupancy:.0%}: the rest between their prefill and "
                "decode): the prediction counts the same share of the new limit"
            )
        factor, expected = throughput_factors(running_after, self.stats.running_mean or 0.0, self.knee, self.model)
        if self.plan.overlap and not plan.overlap:
            factor *= 1 - self.policy.overlap_off_cost
            expected *= 1 - self.policy.overlap_off_cost
        usage = None
        if plan.kv_tokens and self.tokens_per_request:
            usage = plan.effective_max_running_requests * self.tokens_per_request / plan.kv_tokens
        notes.append(
            "throughput model: at most proportional to running requests while decode is memory-bound, up to "
            f"{self.policy.saturation_batch_tokens} tokens per decode step ({self.knee} running requests here); "
            f"expected: {self.model.words()}"
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
            throughput_factor_expected=expected,
            throughput_model=self.model.to_dict(),
            plan=plan.to_dict(),
            notes=notes,
        )

    def held_before(self) -> float:
        """What the server could run for the clients over the window: the effective max, the
        requests the KV cache held at their size, and what the clients sent, whichever is least."""
        held = float(self.eff)
        if self.tokens_per_request and self.plan.kv_tokens:
            held = min(held, self.plan.kv_tokens / self.tokens_per_request)
        if self.stats.demand_mean:
            held = min(held, self.stats.demand_mean)
        return max(held, 1.0)

    def occupancy(self) -> float:
        """The share of what the server could hold that ran (short requests spend part of their
        time queued for their prefill): at most 1."""
        if not self.stats.running_mean:
            return 1.0
        return min(1.0, self.stats.running_mean / self.held_before())

    def startup_refusals(self, changes: dict[str, list[Any]]) -> list[str]:
        """What the release would refuse at startup with the changes applied to the instance's
        settings (the validator's check, :func:`_releases.facts.startup_refusals`)."""
        merged = {**self.ev.args, **{k: v[1] for k, v in changes.items()}}
        try:
            normalized, _warnings = validate_args(merged, self.ev.flag_table, where="proposal")
        except ServerArgsError:
            normalized = {k: v[1] for k, v in changes.items()}
        return startup_refusals(self.ev.flag_table, normalized)

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
        if new.disable_overlap_schedule != old.disable_overlap_schedule:
            out["disable_overlap_schedule"] = [old.disable_overlap_schedule, new.disable_overlap_schedule]
        return out

    @staticmethod
    def rank(p: Proposal) -> tuple[float, bool, int, int]:
        """Best first: the most throughput; at equal throughput one that keeps the effective max
        (room for clients that send more later), then the least invasive, then fewer slots."""
        lowers = (p.effective_max_after or 0) < (p.effective_max_before or 0)
        invasive = 2 * any(k.startswith("mamba_") and k.endswith("strategy") for k in p.changes) + int(
            "mem_fraction_static" in p.changes
        )
        slots = (p.changes.get("max_mamba_cache_size") or [0, 0])[1] or 0
        expected = p.throughput_factor_expected if p.throughput_factor_expected is not None else p.throughput_factor
        return (-round(expected or 0.0, 3), lowers, invasive, slots)

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
                    base = base.with_changes(**self.required_switches(base))
                    resolved = resolve_strategy(self.ev.release, base, self.facts.architecture)
                    if not resolved.overlap and self.plan.overlap:
                        notes.append(
                            f"{strategy} runs without SGLang's overlap scheduler (disable_overlap_schedule: true, "
                            f"which 0.5.14+ require with it): counted as {self.policy.overlap_off_cost:.0%} less "
                            "throughput per step"
                            if base.disable_overlap_schedule and not self.settings.disable_overlap_schedule
                            else f"{strategy} turns SGLang's overlap scheduler off: counted as "
                            f"{self.policy.overlap_off_cost:.0%} less throughput per step"
                        )
                if mfs != mfs_now:
                    notes.append(
                        f"mem_fraction_static {mfs}: {fmt((mfs - mfs_now) * (self.ev.gpu_total_mib or 0) / 1024, 1)} "
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
        if self.facts.hybrid and k_now:
            # Fewer Mamba slots: as many as the running requests used, and a fifth more (never
            # below the cap the running requests reached).
            k_new = max(ratio, math.ceil(running_peak * 1.2) * ratio)
            if k_new < k_now:
                for mfs in sorted({mfs_now, top}):
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
