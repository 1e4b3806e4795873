"""What SGLang's memory arithmetic reads: the release (and how to compare releases), the model's
memory facts (:class:`ModelFacts`) and an instance's settings (:class:`Settings`). Pure data and
parsing, no I/O; the arithmetic itself is :mod:`_capacity.plan` and SGLang's per-release defaults
:mod:`_capacity.defaults`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

GIB = float(1 << 30)


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


# ------------------------------------------------------------------------------------------------
# The model and the settings
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    """What SGLang's memory math reads of a model, per GPU (tensor-parallel rank).

    Derive them from a running instance (:mod:`_capacity.model_facts`), never from a hand table.
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
