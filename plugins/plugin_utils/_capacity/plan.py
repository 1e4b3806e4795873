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
    """SGLang's sizing of the pools and of max running requests, for one GPU of the instance."""
    release_tuple(release)
    errors: list[str] = []
    notes: list[str] = []
    total = gpu_total_mib / 1024.0
    mfs_default = settings.mem_fraction_static is None
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
    rest = avail - total * (1 - mfs)
    rest0 = rest
    spec = settings.spec
    d_tok = settings.draft_tokens()
    dp = settings.attn_dp()
    mrr = settings.max_running_requests
    requested_kind = "requested"
    if mrr is None and spec and settings.speculative_algorithm in SPEC_RESETS_MRR:
        mrr = SPEC_DEFAULT_MRR
        requested_kind = "default"
        notes.append("max_running_requests is reset to 48 for speculative decoding")
    mrr_dp = None if mrr is None else mrr // dp

    strategy: Strategy | None = None
    k: int | None = None
    pad = 0
    mamba_pool = inter_gib = 0.0
    per_slot = facts.mamba_bytes_per_slot
    if facts.hybrid:
        strategy = resolve_strategy(release, settings, facts.architecture)
        notes.extend(strategy.notes)
        if strategy.error:
            errors.append(f"would not fit: {strategy.error}")
        ratio = strategy.ratio
        radix_off = not strategy.radix_cache
        r = settings.mamba_full_memory_ratio
        r = DEFAULT_MAMBA_FULL_MEMORY_RATIO if r is None else float(r)
        explicit = settings.max_mamba_cache_size
        inter = 0
        family = mamba_family(release)
        if per_slot <= 0:
            errors.append("would not fit: the model's Mamba state size per slot is unknown (0 bytes)")
            per_slot = 1.0
        if family == 9:
            if spec:
                inter = mrr_dp or 0
                rest -= per_slot * inter * d_tok / GIB
            if explicit is not None:
                k = explicit // dp
            elif radix_off and mrr is not None:
                k = mrr // dp
            else:
                budget = rest * r / (1 + r)
                k = math.floor(budget * GIB / per_slot)
        elif family == 14:
            if explicit is not None:
                k = explicit // dp
                if spec:
                    inter = min(max(1, mrr_dp or 1), k // ratio)
            elif radix_off and mrr is not None:
                k = mrr // dp
                if spec:
                    inter = k
            else:
                budget = rest * r / (1 + r)
                if spec:
                    k = math.floor(budget * GIB / (per_slot * (1 + d_tok / ratio)))
                    inter = min(max(1, mrr_dp or 1), k // ratio)
                else:
                    k = math.floor(budget * GIB / per_slot)
            rest -= per_slot * max(inter, 0) * d_tok / GIB
        else:
            pad = 1
            if explicit is not None:
                k = explicit // dp
                if spec:
                    inter = min(max(1, mrr_dp or 1), k // ratio) + 1
            elif radix_off and mrr is not None:
                k = max(1, mrr // dp)
                if spec:
                    inter = k + 1
            else:
                budget_b = rest * r / (1 + r) * GIB
                if spec:
                    k = math.floor((budget_b - per_slot * (1 + d_tok)) / (per_slot * (1 + d_tok / ratio)))
                    inter = min(max(1, mrr_dp or 1), max(k, 0) // ratio) + 1
                else:
                    k = math.floor((budget_b - per_slot) / per_slot)
            rest -= per_slot * inter * d_tok / GIB
        inter_gib = per_slot * max(inter, 0) * d_tok / GIB
        if k <= 0:
            errors.append(_not_enough_mamba(k, rest, per_slot))
        mamba_pool = (max(k, 0) + pad) * per_slot / GIB
        rest -= mamba_pool

    tokens = 0
    kv_gib = 0.0
    if rest <= 0:
        errors.append(_no_kv(release, mfs, avail, total))
    elif facts.kv_bytes_per_token <= 0:
        errors.append("would not fit: the model's KV bytes per token are unknown (0 bytes)")
    else:
        tokens = math.floor(rest * GIB / facts.kv_bytes_per_token)
        if settings.max_total_tokens is not None and settings.max_total_tokens < tokens:
            tokens = settings.max_total_tokens
        page = max(1, settings.page_size or 1)
        tokens = tokens // page * page
        if tokens <= 0:
            errors.append(_no_kv(release, mfs, avail, total))
        kv_gib = tokens * facts.kv_bytes_per_token / GIB

    ctx = max(1, int(facts.context_length or 1))
    estimated = max(min(int(tokens / ctx * 512), 4096), 2048)
    limits: dict[str, int] = {}
    mamba_cap = None
    if facts.hybrid and k is not None and strategy is not None:
        mamba_cap = max(k, 0) // strategy.ratio
        limits["mamba"] = mamba_cap
    limits["kv"] = tokens // 2
    if mrr is not None:
        limits[requested_kind] = max(1, mrr // dp) if at_least(release, 14) else mrr // dp
    else:
        limits["default"] = estimated
    # 0.5.9: min(mrr or tokens // 2, pool), the pool being mrr or the estimate, capped by K // ratio;
    # 0.5.14+: min(mrr or the estimate, tokens // 2), capped by K // ratio. Either way the least limit.
    eff = min(limits.values())
    if mamba_cap is not None and eff <= 0 and at_least(release, 14) and not errors:
        errors.append(
            "would not fit: Hybrid (mamba/linear-attention) state cache is too small to serve any "
            f"requests. max_mamba_cache_size={k}, mamba_ratio={strategy.ratio if strategy else 1}, "
            f"resulting max_num_reqs={eff}."
        )
    binding = next((b for b in BINDINGS if limits.get(b) == eff), "kv")
    return CapacityPlan(
        release=release,
        gpu_total_mib=gpu_total_mib,
        mem_fraction_static=mfs,
        mem_fraction_static_default=mfs_default,
        total_gib=total,
        avail_after_weights_gib=avail,
        rest_gib=rest0,
        strategy=strategy.strategy if strategy else None,
        radix_cache=strategy.radix_cache if strategy else not settings.disable_radix_cache,
        overlap=strategy.overlap if strategy else not settings.disable_overlap_schedule,
        mamba_ratio=strategy.ratio if strategy else None,
        mamba_k=k,
        mamba_pool_gib=mamba_pool,
        mamba_intermediate_gib=inter_gib,
        kv_gib=kv_gib,
        kv_tokens=tokens,
        requested_max_running_requests=mrr,
        effective_max_running_requests=max(eff, 0),
        binding=binding,
        limits=limits,
        errors=tuple(errors),
        notes=tuple(dict.fromkeys(notes)),
    )


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
