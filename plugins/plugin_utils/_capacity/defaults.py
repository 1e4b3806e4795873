"""What SGLang picks by default for a release and an instance's settings (the reference's §6.1 and
§6.3): ``chunked_prefill_size``, the decode CUDA-graph max batch size, the memory it reserves and
so ``mem_fraction_static``, the Mamba strategy ``auto`` resolves to (and what that switches off),
the slots one running request holds, and the defaults of the pool sizing. Pure functions, no I/O;
the pools themselves are sized by :mod:`._capacity`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.inputs import Settings, at_least
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._releases.facts import startup_refusals

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
DEFAULT_MAMBA_FULL_MEMORY_RATIO = 0.9


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


# Complexity checked by people: SGLang's own per-release cases, in its order, to compare with the source.
def reserved_mib(release: str, gpu_total_mib: float, settings: Settings, mla: bool = False) -> float:  # noqa: PLR0912
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


# Complexity checked by people: SGLang's strategy resolution case by case, in its order, to compare with the source.
def resolve_strategy(release: str, settings: Settings, architecture: str | None = None) -> Strategy:  # noqa: PLR0912, PLR0915
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
            # Only auto resolving to no_buffer turns the overlap scheduler off itself (0.5.23
            # arg_groups/overrides.py:477-486); an explicit no_buffer with it on is refused below.
            if strategy == "no_buffer" and radix and overlap:
                overlap = False
                notes.append("auto resolves to no_buffer, which turns the overlap scheduler off")
        elif strategy == "extra_buffer" and architecture in NO_EXTRA_BUFFER:
            error = f"{architecture} rejects the mamba strategy extra_buffer"
        refusals = startup_refusals(
            release,
            {
                "mamba_radix_cache_strategy": settings.mamba_scheduler_strategy or "auto",
                "disable_radix_cache": not radix,
                "disable_overlap_schedule": settings.disable_overlap_schedule,
                "page_size": settings.page_size,
                "speculative_num_draft_tokens": settings.speculative_num_draft_tokens,
            },
        )
        if refusals and error is None:
            error = refusals[0]
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
