"""SGLang's per-rank memory math: weights, Mamba state pool, KV pool, max running requests.

Follows reference section 6 (``profile_max_num_token`` / ``handle_max_mamba_cache`` in v9,
``kv_cache_configurator`` in v18+), with the version differences it documents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gpusim import release_facts
from gpusim.profiles import ModelProfile
from gpusim.versions import Version

GIB = float(1 << 30)


class StartupError(Exception):
    """A failure the real scheduler raises while building its pools."""

    def __init__(self, exc_type: str, message: str):
        super().__init__(message)
        self.exc_type = exc_type
        self.message = message


@dataclass
class MemoryInputs:
    version: Version
    profile: ModelProfile
    total_mib: int
    others_mib: int
    gpu_index: int
    mem_fraction_static: float
    tp_size: int = 1
    spec: bool = False
    spec_mtp: bool = False
    draft_tokens: int = 0
    max_running_requests: int | None = None
    max_mamba_cache_size: int | None = None
    mamba_full_memory_ratio: float = 0.9
    mamba_ssm_dtype: str | None = None
    mamba_ratio: int = 1
    disable_radix_cache: bool = False
    page_size: int = 1
    max_total_tokens: int | None = None
    context_len: int = 4096
    cuda_graph_enabled: bool = True
    cuda_graph_max_bs: int = 256


@dataclass
class MemoryPlan:
    total_gib: float
    avail_start_gib: float
    weights_gib: float
    avail_after_weights_gib: float
    mamba_k: int | None = None
    mamba_ratio: int = 1
    conv_gib: float = 0.0
    ssm_gib: float = 0.0
    inter_ssm_gib: float = 0.0
    inter_conv_gib: float = 0.0
    kv_tokens: int = 0
    k_gib: float = 0.0
    v_gib: float = 0.0
    max_running: int = 0
    graph_mib: int = 0
    warnings: list[str] = field(default_factory=list)
    context_mib: int = 512
    # 0.5.9 with MTP: the draft's weights and its one-layer KV pool, loaded after the target's pools
    # and CUDA graphs (zero where the draft loads before the pools and is counted above).
    late_draft_weights_gib: float = 0.0
    late_draft_k_gib: float = 0.0
    late_draft_v_gib: float = 0.0

    @property
    def mamba_gib(self) -> float:
        return self.conv_gib + self.ssm_gib + self.inter_ssm_gib + self.inter_conv_gib

    @property
    def kv_gib(self) -> float:
        return self.k_gib + self.v_gib

    @property
    def pools_mib(self) -> int:
        return round((self.mamba_gib + self.kv_gib) * 1024)

    @property
    def weights_mib(self) -> int:
        return round(self.weights_gib * 1024)

    @property
    def late_draft_mib(self) -> int:
        return round((self.late_draft_weights_gib + self.late_draft_k_gib + self.late_draft_v_gib) * 1024)

    @property
    def final_mib(self) -> int:
        return self.context_mib + self.weights_mib + self.pools_mib + self.graph_mib + self.late_draft_mib

    def avail_after_pools_gib(self) -> float:
        return self.avail_after_weights_gib - self.mamba_gib - self.kv_gib

    def avail_after_graph_gib(self) -> float:
        return self.avail_after_pools_gib() - self.graph_mib / 1024.0

    def avail_after_late_draft_gib(self) -> float:
        """What is free once every runner is up: the scheduler's ``available_gpu_mem``."""
        return self.avail_after_graph_gib() - self.late_draft_mib / 1024.0


def draft_weights_gib(inp: MemoryInputs) -> float:
    return inp.profile.draft_weights_gib / inp.tp_size if inp.spec_mtp else 0.0


def draft_after_target_pools(inp: MemoryInputs) -> bool:
    """Whether the draft model (MTP) loads after the target's pools and CUDA graphs, out of what
    they leave (0.5.9: managers/scheduler.py:563-565 builds the target's worker, pools included,
    before the draft's), rather than before the pools are sized (0.5.14+); facts/<version>.json
    ``scheduler_start``."""
    return draft_weights_gib(inp) > 0 and not release_facts.draft_before_target_pools(inp.version)


def weights_gib(inp: MemoryInputs) -> float:
    """The weights loaded before the target's pools are sized: the target's, and the draft's where
    it loads first."""
    w = inp.profile.weights_gib / inp.tp_size
    if not draft_after_target_pools(inp):
        w += draft_weights_gib(inp)
    return w


def cuda_oom(tried_gib: float, inp: MemoryInputs, free_gib: float, in_use_gib: float) -> StartupError:
    total = inp.total_mib / 1024.0
    return StartupError(
        "torch.OutOfMemoryError",
        f"CUDA out of memory. Tried to allocate {tried_gib:.2f} GiB. GPU {inp.gpu_index} has a total "
        f"capacity of {total:.2f} GiB of which {max(free_gib, 0) * 1024:.2f} MiB is free. Including "
        f"non-PyTorch memory, this process has {in_use_gib:.2f} GiB memory in use. Of the allocated "
        f"memory {max(in_use_gib - 0.5, 0):.2f} GiB is allocated by PyTorch, and 0.00 MiB is reserved by "
        "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
        "for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
    )


def plan(inp: MemoryInputs) -> MemoryPlan:
    """The scheduler's start, in SGLang's order: load the model, size the Mamba cache
    (``handle_max_mamba_cache``), then the KV pool from what is left (``profile_max_num_token``,
    ``init_memory_pool``), then max running requests. Raises StartupError for the failures the
    real scheduler would hit."""
    p = _load_model(inp)
    rest = p.avail_after_weights_gib - p.total_gib * (1 - inp.mem_fraction_static)
    if inp.profile.is_hybrid:
        rest = _handle_max_mamba_cache(inp, p, rest)
    if rest <= 0:
        raise _no_memory_for_kv(inp, p)
    _init_kv_pool(inp, p, rest)
    p.max_running = _max_running_requests(inp, p)
    if inp.cuda_graph_enabled:
        p.graph_mib = inp.profile.cuda_graph_mib
    return p


def _load_model(inp: MemoryInputs) -> MemoryPlan:
    """The CUDA context, then the weights; torch's out-of-memory error where they do not fit."""
    prof = inp.profile
    total = inp.total_mib / 1024.0
    ctx = prof.context_mib / 1024.0
    avail0 = total - inp.others_mib / 1024.0 - ctx
    if avail0 <= 0:
        raise cuda_oom(ctx, inp, total - inp.others_mib / 1024.0, 0.0)
    w = weights_gib(inp)
    if w > avail0:
        raise cuda_oom(min(w, 2.0) if w - avail0 < 2.0 else w - avail0, inp, avail0, ctx + min(w, avail0))
    return MemoryPlan(
        total_gib=total,
        avail_start_gib=avail0,
        weights_gib=w,
        avail_after_weights_gib=avail0 - w,
        context_mib=prof.context_mib,
    )


def _handle_max_mamba_cache(inp: MemoryInputs, p: MemoryPlan, rest: float) -> float:
    """The Mamba cache's slots (K) and speculative decoding's intermediate states, as each release
    allocates them; what is left for the KV pool."""
    conv_b, ssm_b = inp.profile.mamba_per_req_bytes(inp.mamba_ssm_dtype, inp.tp_size)
    per_req = float(conv_b + ssm_b)
    p.mamba_ratio = inp.mamba_ratio
    allocate = {9: _mamba_cache_0_5_9, 14: _mamba_cache_0_5_14}.get(inp.version.mamba_family, _mamba_cache_0_5_18)
    k, inter_reqs, pad, rest = allocate(inp, per_req, rest)
    if k <= 0:
        raise StartupError(
            "RuntimeError",
            "Not enough GPU memory for hybrid (mamba/linear-attention) state cache. "
            f"Computed max_mamba_cache_size={k} (total_rest_memory={rest:.2f} GB, "
            f"mamba_cache_per_req={per_req / (1 << 20):.2f} MB). "
            "Try: (1) reduce --max-running-requests, (2) increase --mem-fraction-static, "
            "(3) reduce --speculative-num-draft-tokens, or (4) use GPUs with more memory.",
        )
    d_tok = inp.draft_tokens if inp.spec else 0
    slots = k + pad
    p.mamba_k = k
    p.conv_gib = slots * conv_b / GIB
    p.ssm_gib = slots * ssm_b / GIB
    p.inter_ssm_gib = inter_reqs * d_tok * ssm_b / GIB
    p.inter_conv_gib = inter_reqs * d_tok * conv_b / GIB
    return rest - slots * per_req / GIB


# Each release's allocation: (K, requests with intermediate states, padding slots, rest after them).


def _mamba_cache_0_5_9(inp: MemoryInputs, per_req: float, rest: float) -> tuple[int, int, int, float]:
    """The intermediate states of max running requests come off first; K from the rest's share."""
    mrr, d_tok, r = inp.max_running_requests, inp.draft_tokens if inp.spec else 0, inp.mamba_full_memory_ratio
    inter_reqs = 0
    if inp.spec:
        inter_reqs = mrr or 0
        rest -= per_req * inter_reqs * d_tok / GIB
    if inp.max_mamba_cache_size is not None:
        return inp.max_mamba_cache_size, inter_reqs, 0, rest
    if inp.disable_radix_cache and mrr is not None:
        return mrr, inter_reqs, 0, rest
    return int((rest * r / (1 + r) * GIB) // per_req), inter_reqs, 0, rest


def _mamba_cache_0_5_14(inp: MemoryInputs, per_req: float, rest: float) -> tuple[int, int, int, float]:
    """K first (with speculative decoding, K and its share of intermediate states together), then
    the intermediate states of min(max running requests, K / ratio) come off the rest."""
    mrr, d_tok, r, ratio = (
        inp.max_running_requests,
        inp.draft_tokens if inp.spec else 0,
        inp.mamba_full_memory_ratio,
        inp.mamba_ratio,
    )
    if inp.max_mamba_cache_size is not None:
        k = inp.max_mamba_cache_size
        inter_reqs = min(max(1, mrr or 1), k // ratio) if inp.spec else 0
    elif inp.disable_radix_cache and mrr is not None:
        k = mrr
        inter_reqs = k if inp.spec else 0
    elif inp.spec:
        k = int((rest * r / (1 + r) * GIB) // (per_req * (1 + d_tok / ratio)))
        inter_reqs = min(max(1, mrr or 1), k // ratio)
    else:
        k, inter_reqs = int((rest * r / (1 + r) * GIB) // per_req), 0
    return k, inter_reqs, 0, rest - per_req * inter_reqs * d_tok / GIB


def _mamba_cache_0_5_18(inp: MemoryInputs, per_req: float, rest: float) -> tuple[int, int, int, float]:
    """One padding slot; with speculative decoding K and the states solved jointly, one more state."""
    mrr, d_tok, r, ratio = (
        inp.max_running_requests,
        inp.draft_tokens if inp.spec else 0,
        inp.mamba_full_memory_ratio,
        inp.mamba_ratio,
    )
    inter_reqs = 0
    if inp.max_mamba_cache_size is not None:
        k = inp.max_mamba_cache_size
        if inp.spec:
            inter_reqs = min(max(1, mrr or 1), k // ratio) + 1
    elif inp.disable_radix_cache and mrr is not None:
        k = max(1, mrr)
        if inp.spec:
            inter_reqs = k + 1
    else:
        budget_b = rest * r / (1 + r) * GIB
        if inp.spec:
            k = int((budget_b - per_req * (1 + d_tok)) // (per_req * (1 + d_tok / ratio)))
            inter_reqs = min(max(1, mrr or 1), max(k, 0) // ratio) + 1
        else:
            k = int((budget_b - per_req) // per_req)
    return k, inter_reqs, 1, rest - per_req * inter_reqs * d_tok / GIB


def _no_memory_for_kv(inp: MemoryInputs, p: MemoryPlan) -> StartupError:
    if inp.version.family >= 18:
        minimum = 1 - (p.avail_after_weights_gib / p.total_gib)
        return StartupError(
            "ValueError",
            "Loaded weights leave no GPU memory for the KV cache under "
            f"--mem-fraction-static={inp.mem_fraction_static}. Raise --mem-fraction-static above "
            f"{math.ceil(minimum * 1000) / 1000:.3f} (minimum viable = 1 - available/pre = "
            f"{minimum:.4f}). If using speculative decoding, draft weights are now counted.",
        )
    return StartupError("RuntimeError", "Not enough memory. Please try to increase --mem-fraction-static.")


def _init_kv_pool(inp: MemoryInputs, p: MemoryPlan, rest: float) -> None:
    """profile_max_num_token: #tokens from the rest and the bytes of one token's cell; then the
    pool (and, on 0.5.9 with MTP, the draft's own pool of the same #tokens, loaded after)."""
    prof = inp.profile
    kv_heads = max(1, prof.num_kv_heads // inp.tp_size)
    v_dim = prof.v_head_dim or prof.head_dim
    late_draft = draft_after_target_pools(inp)
    # 0.5.14+ size the target's pool with the draft's layers in each token's cell; 0.5.9 sizes it
    # with the target's own layers (model_runner_kv_cache_mixin.py:124-141) and the draft then
    # takes the same #tokens for its own pool (:402-403).
    layers = prof.attention_layers + (prof.draft_layers if inp.spec_mtp and not late_draft else 0)
    cell = kv_heads * (prof.head_dim + v_dim) * layers * prof.kv_dtype_bytes
    tokens = int(rest * GIB) // cell
    if inp.max_total_tokens is not None:
        if inp.max_total_tokens > tokens:
            p.warnings.append(
                f"max_total_tokens={inp.max_total_tokens} is larger than the profiled value {tokens}. "
                "Use the profiled value instead."
            )
        tokens = min(tokens, inp.max_total_tokens)
    page = max(1, inp.page_size or 1)
    tokens = tokens // page * page
    if tokens <= 0:
        raise StartupError("RuntimeError", "Not enough memory. Please try to increase --mem-fraction-static.")
    p.kv_tokens = tokens
    p.k_gib = tokens * kv_heads * prof.head_dim * layers * prof.kv_dtype_bytes / GIB
    p.v_gib = tokens * kv_heads * v_dim * layers * prof.kv_dtype_bytes / GIB
    if late_draft:
        p.late_draft_weights_gib = draft_weights_gib(inp)
        p.late_draft_k_gib = tokens * kv_heads * prof.head_dim * prof.draft_layers * prof.kv_dtype_bytes / GIB
        p.late_draft_v_gib = tokens * kv_heads * v_dim * prof.draft_layers * prof.kv_dtype_bytes / GIB


def _max_running_requests(inp: MemoryInputs, p: MemoryPlan) -> int:
    """The scheduler's max running requests per DP worker, with the warnings it logs."""
    mrr, tokens = inp.max_running_requests, p.kv_tokens
    hybrid = inp.profile.is_hybrid and p.mamba_k is not None
    estimated = max(min(int(tokens / inp.context_len * 512), 4096), 2048)
    if inp.version.family < 14:
        pool = mrr if mrr is not None else estimated
        if hybrid:
            pool = min(pool, (p.mamba_k or 0) // p.mamba_ratio)
        return min(mrr if mrr is not None else tokens // 2, pool)
    requested = max(1, mrr) if mrr is not None else None
    eff = min(requested if requested is not None else estimated, tokens // 2)
    capped_by_mamba = False
    if hybrid:
        cap = (p.mamba_k or 0) // p.mamba_ratio
        if cap < eff:
            capped_by_mamba = True
            if inp.version.mamba_cap_warning:
                p.warnings.append(
                    f"max_running_requests is capped to {cap} by the mamba state cache "
                    f"(max_mamba_cache_size={p.mamba_k}, {p.mamba_ratio} state slots per request). "
                    "To raise it: increase --mamba-full-memory-ratio or --max-mamba-cache-size, "
                    "or halve the state size with --mamba-ssm-dtype bfloat16."
                )
        eff = min(eff, cap)
        if eff <= 0:
            raise StartupError(
                "RuntimeError",
                "Hybrid (mamba/linear-attention) state cache is too small to serve any requests. "
                f"max_mamba_cache_size={p.mamba_k}, mamba_ratio={p.mamba_ratio}, resulting "
                f"max_num_reqs={eff}. Try: (1) reduce --max-running-requests, "
                "(2) increase --mem-fraction-static, or (3) use GPUs with more memory.",
            )
    if requested is not None and eff < requested and (not capped_by_mamba or not inp.version.mamba_cap_warning):
        p.warnings.append(
            f"max_running_requests was reduced from the requested {requested} to {eff} "
            "(per dp worker) due to the available KV cache capacity."
        )
    return eff


def check_headroom(inp: MemoryInputs, p: MemoryPlan) -> StartupError | None:
    """The activation/graph working set (and a draft loaded after the pools) must fit outside the
    static pool, or CUDA runs out."""
    headroom_mib = inp.total_mib * (1 - inp.mem_fraction_static)
    need_mib = inp.profile.activation_reserve_mib + p.graph_mib + p.late_draft_mib
    if need_mib <= headroom_mib:
        return None
    in_use = (p.final_mib) / 1024.0
    free = inp.total_mib / 1024.0 - inp.others_mib / 1024.0 - (p.final_mib - p.graph_mib) / 1024.0
    tried = max(need_mib - headroom_mib, 256) / 1024.0
    return cuda_oom(tried, inp, free, in_use)
