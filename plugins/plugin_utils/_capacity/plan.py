"""SGLang's memory arithmetic, by release: how much of a GPU goes to the Mamba state pool and the
KV cache, and how many requests an instance runs at once. Pure functions, no I/O.

It follows the reference's memory math (SGLang's own ``_handle_gpu_memory_settings``,
``handle_max_mamba_cache`` / ``kv_cache_configurator``, ``_resolve_max_num_reqs``); a rule shown
for 0.5.9, 0.5.14, 0.5.18 or 0.5.23 applies to that release and every later one until a later
rule replaces it.

Vocabulary (every size is per GPU, i.e. per tensor-parallel rank, as the rank-0 scheduler logs it):

* ``T`` - total GPU memory (``memory.total`` of nvidia-smi, MiB, as GiB).
* *overhead* - memory in use before the weights load (CUDA context, other processes).
* ``A`` - available after the weights load: ``T - overhead - weights``.
* ``rest`` - what the static pools get: ``A - T x (1 - mem_fraction_static)``.
* *per slot* (``per_req`` in SGLang) - Mamba state bytes of one slot: conv + ssm state over every
  Mamba layer.
* ``K`` - ``max_mamba_cache_size``, the number of Mamba slots (per DP-attention shard). From 0.5.18
  the pool holds one padding slot more.
* *ratio* - Mamba slots one running request holds (1 without radix cache, 3 with ``no_buffer``,
  4 or 5 with ``extra_buffer``, 4 with ``extra_buffer_lazy``).
* ``D`` - ``speculative_num_draft_tokens``: with speculative decoding each running request also
  holds ``D`` intermediate states.
* *cell* - KV bytes per token: K and V of every full-attention layer (draft layers included).
* *effective max running requests* - what ``/server_info`` reports as
  ``internal_states[0].effective_max_running_requests_per_dp``; its *binding* limit is
  ``"mamba"`` (``K // ratio``), ``"kv"`` (half the KV tokens), ``"requested"``
  (``--max-running-requests``) or ``"default"`` (SGLang's own: 48 with speculative decoding, else
  a request pool sized from the KV cache).

It reads differently from the test double's ``gpusim/memory.py``, on purpose: the simulator is an
independent reference that walks SGLang's start (load the model, allocate each pool from the
model's architecture: heads, layers, dtypes); this planner works from the facts measured on a
running instance (bytes per Mamba slot and per KV token, from its own startup lines,
:mod:`_capacity.model_facts`) and asks what other settings would give. Neither imports the other.

What SGLang picks by default for a release and settings (``mem_fraction_static``, the Mamba
strategy, slots per request) is :mod:`_capacity.defaults`; what the arithmetic reads (release,
:class:`ModelFacts`, :class:`Settings`) is :mod:`_capacity.inputs`. This module sizes the pools.

:func:`predict_effective_max_running_requests` is the one entry point for callers that ask
"what will this instance run with these settings?"; :func:`plan_capacity` is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.defaults import (
    DEFAULT_MAMBA_FULL_MEMORY_RATIO,
    SPEC_DEFAULT_MRR,
    SPEC_RESETS_MRR,
    Strategy,
    default_mem_fraction_static,
    resolve_strategy,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.inputs import (
    GIB,
    ModelFacts,
    Settings,
    at_least,
    release_tuple,
)

BINDINGS = ("mamba", "kv", "requested", "default")


# ------------------------------------------------------------------------------------------------
# Which sizing of the Mamba pool applies
# ------------------------------------------------------------------------------------------------


def mamba_family(release: str) -> int:
    """Which sizing of the Mamba pool applies: 9 (0.5.9-0.5.13), 14 (0.5.14-0.5.17) or 18
    (0.5.18 on: one padding slot, and the joint solve with speculative decoding)."""
    if at_least(release, 18):
        return 18
    return 14 if at_least(release, 14) else 9


# ------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CapacityPlan:
    """What an instance gets with these settings on this GPU (per GPU / DP-attention shard).

    ``errors`` holds the start-up failures SGLang would hit, each ``"would not fit: <SGLang's
    message>"``; with an error the sizes that follow it are not meaningful.
    """

    release: str
    gpu_total_mib: float
    mem_fraction_static: float
    mem_fraction_static_default: bool  # not set: SGLang's own choice (6.1)
    total_gib: float
    avail_after_weights_gib: float
    rest_gib: float  # for the static pools, before the Mamba pool
    strategy: str | None  # hybrid models: the resolved Mamba strategy
    radix_cache: bool
    overlap: bool
    mamba_ratio: int | None  # slots per running request
    mamba_k: int | None  # max_mamba_cache_size
    mamba_pool_gib: float  # (K + padding) slots
    mamba_intermediate_gib: float  # speculative decoding's intermediate states
    kv_gib: float
    kv_tokens: int  # max_total_num_tokens
    requested_max_running_requests: int | None  # the flag, or 48 with speculative decoding
    effective_max_running_requests: int
    binding: str  # mamba | kv | requested | default
    limits: dict[str, int] = field(default_factory=dict)  # each limit's value
    errors: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["errors"] = list(self.errors)
        out["notes"] = list(self.notes)
        out["limits"] = dict(self.limits)
        out["fits"] = self.fits
        for key in ("total_gib", "avail_after_weights_gib", "rest_gib", "mamba_pool_gib", "mamba_intermediate_gib"):
            out[key] = round(out[key], 3)
        out["kv_gib"] = round(self.kv_gib, 3)
        return out


def _not_enough_mamba(k: int, rest: float, per_slot: float) -> str:
    return (
        "would not fit: Not enough GPU memory for hybrid (mamba/linear-attention) state cache. "
        f"Computed max_mamba_cache_size={k} (total_rest_memory={rest:.2f} GB, "
        f"mamba_cache_per_req={per_slot / (1 << 20):.2f} MB). "
        "Try: (1) reduce --max-running-requests, (2) increase --mem-fraction-static, "
        "(3) reduce --speculative-num-draft-tokens, or (4) use GPUs with more memory."
    )


def _no_kv(release: str, mfs: float, avail: float, total: float) -> str:
    if at_least(release, 23):
        minimum = 1 - avail / total
        return (
            "would not fit: Loaded weights leave no GPU memory for the KV cache under "
            f"--mem-fraction-static={mfs}. Raise --mem-fraction-static above "
            f"{math.ceil(minimum * 1000) / 1000:.3f} (minimum viable = 1 - available/pre = {minimum:.4f}). "
            "If using speculative decoding, draft weights are now counted."
        )
    return "would not fit: Not enough memory. Please try to increase --mem-fraction-static."


def plan_capacity(release: str, facts: ModelFacts, gpu_total_mib: float, settings: Settings) -> CapacityPlan:
    """SGLang's sizing of the pools and of max running requests, for one GPU of the instance:
    the static budget, the Mamba pool (hybrid models), the KV pool, then the least limit."""
    release_tuple(release)
    errors: list[str] = []
    notes: list[str] = []
    budget = _static_budget(release, facts, gpu_total_mib, settings, errors)
    mrr, requested_kind = _requested_max_running_requests(settings, notes)
    mamba = _mamba_pools(release, facts, settings, budget.rest_gib, mrr, errors, notes)
    tokens, kv_gib = _kv_pool(release, facts, settings, mamba.rest_gib, budget, errors)
    limits = _limits(release, facts, settings, tokens, mamba, mrr, requested_kind)
    # 0.5.9: min(mrr or tokens // 2, pool), the pool being mrr or the estimate, capped by K // ratio;
    # 0.5.14+: min(mrr or the estimate, tokens // 2), capped by K // ratio. Either way the least limit.
    eff = min(limits.values())
    if "mamba" in limits and eff <= 0 and at_least(release, 14) and not errors:
        errors.append(
            "would not fit: Hybrid (mamba/linear-attention) state cache is too small to serve any "
            f"requests. max_mamba_cache_size={mamba.k}, mamba_ratio={mamba.ratio}, resulting max_num_reqs={eff}."
        )
    strategy = mamba.strategy
    return CapacityPlan(
        release=release,
        gpu_total_mib=gpu_total_mib,
        mem_fraction_static=budget.mfs,
        mem_fraction_static_default=settings.mem_fraction_static is None,
        total_gib=budget.total_gib,
        avail_after_weights_gib=budget.avail_gib,
        rest_gib=budget.rest_gib,
        strategy=strategy.strategy if strategy else None,
        radix_cache=strategy.radix_cache if strategy else not settings.disable_radix_cache,
        overlap=strategy.overlap if strategy else not settings.disable_overlap_schedule,
        mamba_ratio=strategy.ratio if strategy else None,
        mamba_k=mamba.k,
        mamba_pool_gib=mamba.pool_gib,
        mamba_intermediate_gib=mamba.intermediate_gib,
        kv_gib=kv_gib,
        kv_tokens=tokens,
        requested_max_running_requests=mrr,
        effective_max_running_requests=max(eff, 0),
        binding=next((b for b in BINDINGS if limits.get(b) == eff), "kv"),
        limits=limits,
        errors=tuple(errors),
        notes=tuple(dict.fromkeys(notes)),
    )


# ------------------------------------------------------------------------------------------------
# The steps of the plan
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Budget:
    """The GPU's memory (GiB), the fraction for the static pools, what the weights leave, and
    what is left for the pools."""

    total_gib: float
    mfs: float
    avail_gib: float
    rest_gib: float


def _static_budget(
    release: str, facts: ModelFacts, gpu_total_mib: float, settings: Settings, errors: list[str]
) -> _Budget:
    total = gpu_total_mib / 1024.0
    mfs = (
        default_mem_fraction_static(release, gpu_total_mib, settings, facts.mla)
        if settings.mem_fraction_static is None
        else float(settings.mem_fraction_static)
    )
    if not 0 < mfs < 1:
        errors.append(f"would not fit: mem_fraction_static={mfs} is not between 0 and 1")
    avail = total - facts.overhead_gib - facts.weights_gib
    if avail <= 0:
        errors.append(
            f"would not fit: CUDA out of memory: the weights ({facts.weights_gib:.2f} GiB) do not fit in the "
            f"{total - facts.overhead_gib:.2f} GiB left on the GPU"
        )
    return _Budget(total_gib=total, mfs=mfs, avail_gib=avail, rest_gib=avail - total * (1 - mfs))


def _requested_max_running_requests(settings: Settings, notes: list[str]) -> tuple[int | None, str]:
    """The flag, or SGLang's reset for speculative decoding; and which limit it is."""
    if settings.max_running_requests is None and settings.spec and settings.speculative_algorithm in SPEC_RESETS_MRR:
        notes.append("max_running_requests is reset to 48 for speculative decoding")
        return SPEC_DEFAULT_MRR, "default"
    return settings.max_running_requests, "requested"


@dataclass(frozen=True)
class _Mamba:
    """The Mamba pool of a hybrid model (nothing for others), and what it leaves for the KV cache."""

    rest_gib: float
    strategy: Strategy | None = None
    k: int | None = None
    pool_gib: float = 0.0
    intermediate_gib: float = 0.0

    @property
    def ratio(self) -> int:
        return self.strategy.ratio if self.strategy else 1


@dataclass(frozen=True)
class _SlotSizing:
    """What each release's sizing of the Mamba slots reads."""

    per_slot: float  # bytes of one slot
    ratio: int  # slots per running request
    share: float  # the Mamba pool's share of the rest: r / (1 + r)
    explicit: int | None  # max_mamba_cache_size, per DP-attention shard below
    by_mrr: bool  # no radix cache and max running requests known: K follows it
    mrr: int | None
    dp: int
    spec: bool
    draft_tokens: int

    @property
    def mrr_dp(self) -> int | None:
        return None if self.mrr is None else self.mrr // self.dp

    def intermediates(self, k: int) -> int:
        """Speculative decoding's intermediate states when K is known."""
        return min(max(1, self.mrr_dp or 1), k // self.ratio)

    def state_gib(self, slots: int) -> float:
        return self.per_slot * slots * self.draft_tokens / GIB


def _mamba_pools(
    release: str,
    facts: ModelFacts,
    settings: Settings,
    rest: float,
    mrr: int | None,
    errors: list[str],
    notes: list[str],
) -> _Mamba:
    if not facts.hybrid:
        return _Mamba(rest_gib=rest)
    strategy = resolve_strategy(release, settings, facts.architecture)
    notes.extend(strategy.notes)
    if strategy.error:
        errors.append(f"would not fit: {strategy.error}")
    per_slot = facts.mamba_bytes_per_slot
    if per_slot <= 0:
        errors.append("would not fit: the model's Mamba state size per slot is unknown (0 bytes)")
        per_slot = 1.0
    r = settings.mamba_full_memory_ratio
    r = DEFAULT_MAMBA_FULL_MEMORY_RATIO if r is None else float(r)
    sizing = _SlotSizing(
        per_slot=per_slot,
        ratio=strategy.ratio,
        share=r / (1 + r),
        explicit=settings.max_mamba_cache_size,
        by_mrr=not strategy.radix_cache and mrr is not None,
        mrr=mrr,
        dp=settings.attn_dp(),
        spec=settings.spec,
        draft_tokens=settings.draft_tokens(),
    )
    size_slots = {9: _slots_0_5_9, 14: _slots_0_5_14}.get(mamba_family(release), _slots_0_5_18)
    k, inter, pad, rest = size_slots(sizing, rest)
    if k <= 0:
        errors.append(_not_enough_mamba(k, rest, per_slot))
    pool = (max(k, 0) + pad) * per_slot / GIB
    return _Mamba(
        rest_gib=rest - pool,
        strategy=strategy,
        k=k,
        pool_gib=pool,
        intermediate_gib=sizing.state_gib(max(inter, 0)),
    )


# Each release family's sizing: (K, intermediate states, padding slots, rest after the states).


def _slots_0_5_9(s: _SlotSizing, rest: float) -> tuple[int, int, int, float]:
    """0.5.9-0.5.13: the intermediate states are taken first, then K from what is left."""
    inter = 0
    if s.spec:
        inter = s.mrr_dp or 0
        rest -= s.state_gib(inter)
    if s.explicit is not None:
        k = s.explicit // s.dp
    elif s.by_mrr:
        k = (s.mrr or 0) // s.dp
    else:
        k = math.floor(rest * s.share * GIB / s.per_slot)
    return k, inter, 0, rest


def _slots_0_5_14(s: _SlotSizing, rest: float) -> tuple[int, int, int, float]:
    """0.5.14-0.5.17: K and the intermediate states solved together, no padding."""
    inter = 0
    if s.explicit is not None:
        k = s.explicit // s.dp
        if s.spec:
            inter = s.intermediates(k)
    elif s.by_mrr:
        k = (s.mrr or 0) // s.dp
        if s.spec:
            inter = k
    elif s.spec:
        k = math.floor(rest * s.share * GIB / (s.per_slot * (1 + s.draft_tokens / s.ratio)))
        inter = s.intermediates(k)
    else:
        k = math.floor(rest * s.share * GIB / s.per_slot)
    return k, inter, 0, rest - s.state_gib(max(inter, 0))


def _slots_0_5_18(s: _SlotSizing, rest: float) -> tuple[int, int, int, float]:
    """0.5.18 on: one padding slot, and the joint solve with speculative decoding."""
    inter = 0
    budget_b = rest * s.share * GIB
    if s.explicit is not None:
        k = s.explicit // s.dp
        if s.spec:
            inter = s.intermediates(k) + 1
    elif s.by_mrr:
        k = max(1, (s.mrr or 0) // s.dp)
        if s.spec:
            inter = k + 1
    elif s.spec:
        k = math.floor((budget_b - s.per_slot * (1 + s.draft_tokens)) / (s.per_slot * (1 + s.draft_tokens / s.ratio)))
        inter = s.intermediates(max(k, 0)) + 1
    else:
        k = math.floor((budget_b - s.per_slot) / s.per_slot)
    return k, inter, 1, rest - s.state_gib(inter)


def _kv_pool(
    release: str, facts: ModelFacts, settings: Settings, rest: float, budget: _Budget, errors: list[str]
) -> tuple[int, float]:
    """The KV pool's tokens (max_total_num_tokens) from what the other pools leave, and its GiB."""
    no_kv = _no_kv(release, budget.mfs, budget.avail_gib, budget.total_gib)
    if rest <= 0:
        errors.append(no_kv)
        return 0, 0.0
    if facts.kv_bytes_per_token <= 0:
        errors.append("would not fit: the model's KV bytes per token are unknown (0 bytes)")
        return 0, 0.0
    tokens = math.floor(rest * GIB / facts.kv_bytes_per_token)
    if settings.max_total_tokens is not None and settings.max_total_tokens < tokens:
        tokens = settings.max_total_tokens
    page = max(1, settings.page_size or 1)
    tokens = tokens // page * page
    if tokens <= 0:
        errors.append(no_kv)
    return tokens, tokens * facts.kv_bytes_per_token / GIB


def _limits(
    release: str,
    facts: ModelFacts,
    settings: Settings,
    tokens: int,
    mamba: _Mamba,
    mrr: int | None,
    requested_kind: str,
) -> dict[str, int]:
    """Each limit on running requests: the Mamba slots, half the KV tokens, the flag or the estimate."""
    limits: dict[str, int] = {}
    if facts.hybrid and mamba.k is not None and mamba.strategy is not None:
        limits["mamba"] = max(mamba.k, 0) // mamba.strategy.ratio
    limits["kv"] = tokens // 2
    dp = settings.attn_dp()
    if mrr is not None:
        limits[requested_kind] = max(1, mrr // dp) if at_least(release, 14) else mrr // dp
    else:
        ctx = max(1, int(facts.context_length or 1))
        limits["default"] = max(min(int(tokens / ctx * 512), 4096), 2048)
    return limits


def predict_effective_max_running_requests(
    release: str, model_facts: ModelFacts, gpu_total_mib: float, settings: Settings
) -> CapacityPlan:
    """The effective max running requests (and the whole plan behind it: pools, binding limit,
    "would not fit" errors) an instance would start with.

    The facts come from the running instance (:func:`_capacity.model_facts.derive_model_facts`); the
    GPU's memory.total from nvidia-smi; the settings are the ones it would be launched with
    (:meth:`Settings.from_args` of the inventory's resolved args).
    """
    return plan_capacity(release, model_facts, gpu_total_mib, settings)
