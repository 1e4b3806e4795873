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

:func:`predict_effective_max_running_requests` is the one entry point for callers that ask
"what will this instance run with these settings?"; :func:`plan_capacity` is the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

GIB = float(1 << 30)

# Speculative algorithms that reset an unset --max-running-requests to 48 (all releases).
SPEC_RESETS_MRR = frozenset({"EAGLE", "EAGLE3", "STANDALONE", "NEXTN", "NGRAM"})
SPEC_DEFAULT_MRR = 48
# EAGLE-type algorithms: 0.5.9 turns the overlap scheduler off for them, and reserves 2 GiB more.
SPEC_EAGLE = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE"})
# Architectures without Mamba radix-cache support: SGLang disables the radix cache for them.
NO_MAMBA_RADIX = frozenset({"KimiLinearForCausalLM", "BailingMoeV2_5ForCausalLM"})
# Architectures that reject the extra_buffer strategy.
NO_EXTRA_BUFFER = frozenset(
    {"NemotronHForCausalLM", "FalconH1ForCausalLM", "Lfm2ForCausalLM", "JetNemotronForCausalLM"}
)
STRATEGIES = ("auto", "no_buffer", "extra_buffer", "extra_buffer_lazy")
DEFAULT_MAMBA_FULL_MEMORY_RATIO = 0.9

BINDINGS = ("mamba", "kv", "requested", "default")


# ------------------------------------------------------------------------------------------------
# Releases
# ------------------------------------------------------------------------------------------------


def release_tuple(release: str) -> tuple[int, int, int]:
    """``"0.5.23"`` -> ``(0, 5, 23)``; ValueError for anything else."""
    parts = str(release).strip().lstrip("v").split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"unparsable SGLang release {release!r} (expected MAJOR.MINOR.PATCH)")
    return int(parts[0]), int(parts[1]), int(parts[2])


def at_least(release: str, patch: int) -> bool:
    """``release`` is 0.5.``patch`` or later."""
    return release_tuple(release) >= (0, 5, patch)


def mamba_family(release: str) -> int:
    """Which sizing of the Mamba pool applies: 9 (0.5.9-0.5.13), 14 (0.5.14-0.5.17) or 18
    (0.5.18 on: one padding slot, and the joint solve with speculative decoding)."""
    if at_least(release, 18):
        return 18
    return 14 if at_least(release, 14) else 9


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    """What SGLang's memory math reads of a model, per GPU (tensor-parallel rank).

    Derive them from a running instance (:mod:`._model_facts`), never from a hand table.
    """

    hybrid: bool
    mamba_bytes_per_slot: float  # conv + ssm state of one Mamba slot; 0 if not hybrid
    kv_bytes_per_token: float  # the KV cell: K and V of every full-attention layer
    weights_gib: float  # weights loaded per rank (draft weights included)
    context_length: int
    overhead_gib: float = 0.5  # in use before the weights load (CUDA context, other processes)
    architecture: str | None = None
    mla: bool = False  # MLA attention: the prefill-graph reserve is 1536 MiB (0.5.14+)


@dataclass(frozen=True)
class Settings:
    """The settings of one instance that the memory math reads (SGLang's names; None = unset,
    SGLang's default applies)."""

    mem_fraction_static: float | None = None
    max_mamba_cache_size: int | None = None
    mamba_full_memory_ratio: float | None = None
    mamba_scheduler_strategy: str = "auto"  # 0.5.14+: --mamba-radix-cache-strategy
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    max_running_requests: int | None = None
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    page_size: int | None = None
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    max_total_tokens: int | None = None
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int | None = None
    cuda_graph_max_bs: int | None = None  # 0.5.14+: --cuda-graph-max-bs-decode
    disable_cuda_graph: bool = False
    cuda_graph_backend_decode: str | None = None
    cuda_graph_backend_prefill: str | None = None
    enable_piecewise_cuda_graph: bool = False
    moe_a2a_backend: str | None = None
    skip_decode_lock: bool = False  # env SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK (0.5.18+)

    @classmethod
    def from_args(cls, args: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Settings:
        """From settings keyed by SGLang's names (inventory args, or ``/server_info``), any
        release's spelling; keys that do not matter here are ignored."""

        def first(*names: str) -> Any:
            for name in names:
                value = args.get(name)
                if value is not None:
                    return value
            return None

        def num(value: Any, kind: type) -> Any:
            return None if value is None else kind(value)

        attn_dp = first("attn_dp_size", "attention_data_parallel_size")
        dp = int(first("dp_size", "data_parallel_size") or 1)
        dp_attention = bool(args.get("enable_dp_attention")) or (attn_dp is not None and int(attn_dp) > 1)
        if attn_dp is not None and int(attn_dp) > 1:
            dp = int(attn_dp)
        skip = str((env or {}).get("SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK", "")).lower() in ("1", "true")
        alg = first("speculative_algorithm")
        return cls(
            mem_fraction_static=num(first("mem_fraction_static"), float),
            max_mamba_cache_size=num(first("max_mamba_cache_size"), int),
            mamba_full_memory_ratio=num(first("mamba_full_memory_ratio"), float),
            mamba_scheduler_strategy=str(first("mamba_radix_cache_strategy", "mamba_scheduler_strategy") or "auto"),
            speculative_algorithm=str(alg).upper() if alg else None,
            speculative_num_draft_tokens=num(first("speculative_num_draft_tokens"), int),
            max_running_requests=num(first("max_running_requests"), int),
            disable_radix_cache=bool(args.get("disable_radix_cache")),
            disable_overlap_schedule=bool(args.get("disable_overlap_schedule")),
            page_size=num(first("page_size"), int),
            tp_size=int(first("tp_size", "tensor_parallel_size") or 1),
            pp_size=int(first("pp_size", "pipeline_parallel_size") or 1),
            dp_size=dp,
            enable_dp_attention=dp_attention,
            max_total_tokens=num(first("max_total_tokens"), int),
            chunked_prefill_size=num(first("chunked_prefill_size"), int),
            max_prefill_tokens=num(first("max_prefill_tokens"), int),
            cuda_graph_max_bs=num(first("cuda_graph_max_bs_decode", "cuda_graph_max_bs"), int),
            disable_cuda_graph=bool(args.get("disable_cuda_graph")),
            cuda_graph_backend_decode=first("cuda_graph_backend_decode"),
            cuda_graph_backend_prefill=first("cuda_graph_backend_prefill"),
            enable_piecewise_cuda_graph=bool(args.get("enable_piecewise_cuda_graph")),
            moe_a2a_backend=first("moe_a2a_backend"),
            skip_decode_lock=skip,
        )

    def with_changes(self, **changes: Any) -> Settings:
        return replace(self, **changes)

    @property
    def spec(self) -> bool:
        return self.speculative_algorithm is not None

    def draft_tokens(self) -> int:
        """``D``: with speculative decoding and no value, SGLang's default (12 for NGRAM, else 4:
        3 steps, top-k 1, steps + 1 draft tokens)."""
        if not self.spec:
            return 0
        if self.speculative_num_draft_tokens is not None:
            return int(self.speculative_num_draft_tokens)
        return 12 if self.speculative_algorithm == "NGRAM" else 4

    def attn_dp(self) -> int:
        """The DP size the Mamba pool and the request pool are split by (DP attention only)."""
        return max(1, self.dp_size) if self.enable_dp_attention else 1


# ------------------------------------------------------------------------------------------------
# 6.1: auto chunked_prefill_size, decode CUDA-graph max bs, mem_fraction_static
# ------------------------------------------------------------------------------------------------


def auto_chunked_prefill_size(release: str, gpu_total_mib: float) -> int:
    """SGLang's default ``chunked_prefill_size`` for the smallest GPU's memory.total (MiB)."""
    g = gpu_total_mib
    if g < 20480:
        return 2048
    if g < 35840:
        return 4096 if at_least(release, 20) else 2048
    if g < 61440:
        return 4096
    if g < 163840:
        return 8192
    return 16384


def auto_decode_max_bs(release: str, gpu_total_mib: float, tp_size: int = 1) -> int:
    """SGLang's default decode CUDA-graph max batch size (``cuda_graph_max_bs``)."""
    g, wide = gpu_total_mib, tp_size >= 4
    if g < 20480:
        return 8
    if g < 35840:
        if at_least(release, 20):
            return 160 if wide else 48
        return 80 if wide else 24
    if g < 61440:
        return 160 if wide else 32
    if g < 163840:
        return 512 if wide else 256
    return 512


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """The prefill (piecewise) CUDA-graph token sizes up to ``max_tokens``: 58 for 8192 tokens
    and 74 for 16384, the counts behind the reference's 464 and 592 MiB."""
    sizes = [
        *range(4, 33, 4),
        *range(48, 257, 16),
        *range(288, 513, 32),
        *range(576, 1025, 64),
        *range(1280, 4097, 256),
        *range(4608, max_tokens + 1, 512),
    ]
    return [s for s in sizes if s <= max_tokens]


def reserved_mib(release: str, gpu_total_mib: float, settings: Settings, mla: bool = False) -> float:
    """The MiB SGLang keeps out of the static pools when it picks ``mem_fraction_static``."""
    v14 = at_least(release, 14)
    chunk = settings.chunked_prefill_size
    if chunk is None:
        chunk = auto_chunked_prefill_size(release, gpu_total_mib)
    top_prefill = chunk if chunk > 0 else (settings.max_prefill_tokens or 16384)
    activations = max(top_prefill, 2048) * 1.5
    max_bs = settings.cuda_graph_max_bs
    if max_bs is None:
        max_bs = auto_decode_max_bs(release, gpu_total_mib, settings.tp_size)
        mrr = settings.max_running_requests
        if at_least(release, 22) and mrr is not None and mrr < max_bs:
            max_bs = mrr
    reserved = 512 + activations + settings.tp_size * settings.pp_size / 8 * 1024
    if v14:
        decode_graph = not (settings.disable_cuda_graph or settings.cuda_graph_backend_decode == "disabled")
        prefill_graph = not (settings.disable_cuda_graph or settings.cuda_graph_backend_prefill == "disabled")
        if decode_graph:
            reserved += max_bs * 2
        if prefill_graph:
            if mla:
                reserved += 1536
            else:
                top = chunk if chunk > 0 else 8192
                if settings.max_total_tokens is not None:
                    top = min(top, settings.max_total_tokens)
                reserved += len(prefill_graph_sizes(top)) * 8
    else:
        reserved += max_bs * 2
        if settings.enable_piecewise_cuda_graph and not settings.disable_cuda_graph:
            reserved += len(prefill_graph_sizes(chunk if chunk > 0 else 8192)) * 8
    if settings.enable_dp_attention and settings.dp_size > 1:
        reserved += max_bs * settings.dp_size * 3
        if max_bs > 300:
            reserved += max_bs * settings.dp_size * 1.5
    if gpu_total_mib > 61440:
        reserved = max(reserved, 10240)
    if not v14 and settings.speculative_algorithm is not None:
        if settings.speculative_algorithm == "STANDALONE":
            reserved += 6144
        elif settings.speculative_algorithm in SPEC_EAGLE:
            reserved += 2048
    if at_least(release, 18) and settings.moe_a2a_backend == "deepep":
        reserved += 2048
    return reserved


def default_mem_fraction_static(
    release: str, gpu_total_mib: float, settings: Settings | None = None, mla: bool = False
) -> float:
    """``mem_fraction_static`` when the flag is unset: ``round((G - reserved) / G, 3)``."""
    settings = settings or Settings()
    reserved = reserved_mib(release, gpu_total_mib, settings, mla)
    return round((gpu_total_mib - reserved) / gpu_total_mib, 3)


# ------------------------------------------------------------------------------------------------
# 6.3: strategy and slots per request
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Strategy:
    """How SGLang resolves the Mamba strategy for these settings."""

    strategy: str  # no_buffer, extra_buffer or extra_buffer_lazy
    radix_cache: bool  # False: one slot per request
    overlap: bool  # the overlap scheduler stays on
    ratio: int  # Mamba slots per running request
    notes: tuple[str, ...] = ()
    error: str | None = None


def resolve_strategy(release: str, settings: Settings, architecture: str | None = None) -> Strategy:
    """Strategy resolution (``auto``), what it switches off, and the slots per request."""
    notes: list[str] = []
    strategy = settings.mamba_scheduler_strategy or "auto"
    radix = not settings.disable_radix_cache
    overlap = not settings.disable_overlap_schedule
    error = None
    if architecture in NO_MAMBA_RADIX and radix:
        radix = False
        notes.append(f"{architecture} has no Mamba radix-cache support: the radix cache is disabled")
    if strategy == "extra_buffer_lazy" and not at_least(release, 13):
        error = f"mamba strategy extra_buffer_lazy is not in SGLang {release} (0.5.13+)"
    if not at_least(release, 14):
        if settings.speculative_algorithm in SPEC_EAGLE and overlap:
            overlap = False
            notes.append("speculative decoding (EAGLE family) turns the overlap scheduler off on this release")
        if strategy == "auto":
            strategy = "no_buffer"
        if strategy == "extra_buffer" and architecture in NO_EXTRA_BUFFER:
            error = f"{architecture} rejects the mamba strategy extra_buffer"
        if strategy == "no_buffer" and radix:
            if settings.spec:
                radix = False
                notes.append("no_buffer with speculative decoding disables the radix cache (1 slot per request)")
            elif overlap:
                overlap = False
                notes.append("no_buffer turns the overlap scheduler off")
    else:
        page = settings.page_size or 1
        if strategy == "auto":
            supports = architecture not in NO_EXTRA_BUFFER
            strategy = "extra_buffer" if (overlap or page > 1) and supports else "no_buffer"
        elif strategy == "extra_buffer" and architecture in NO_EXTRA_BUFFER:
            error = f"{architecture} rejects the mamba strategy extra_buffer"
        if strategy == "no_buffer" and radix and overlap:
            overlap = False
            notes.append("no_buffer turns the overlap scheduler off")
    if not radix:
        ratio = 1
    else:
        base = 3
        if at_least(release, 18) and settings.skip_decode_lock and strategy != "no_buffer":
            base = 2
        extra = 0
        if strategy == "extra_buffer":
            extra = 2 if overlap else 1
        elif strategy == "extra_buffer_lazy":
            extra = 1
        ratio = base + extra
    return Strategy(strategy, radix, overlap, ratio, tuple(notes), error)


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

    The facts come from the running instance (:func:`._model_facts.derive_model_facts`); the
    GPU's memory.total from nvidia-smi; the settings are the ones it would be launched with
    (:meth:`Settings.from_args` of the inventory's resolved args).
    """
    return plan_capacity(release, model_facts, gpu_total_mib, settings)
