"""The scheduler's startup lines for a memory plan, in the release's order and format, and the
``memory_usage`` figures the server reports for it: written once, here, for the worker (which
prints them at their moments of the start) and for the tests that need what a start prints.

Formats and order follow the vendored facts (``facts/<version>.json``): ``log_lines`` for the
format strings, ``scheduler_start`` for where the draft model's own runner loads (before the
target's pools on 0.5.14+, after its pools and CUDA graphs on 0.5.9), ``draft_log_lines`` for the
lines that runner writes too (its weight lines and its one-layer KV pool's line, the target's
#tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpusim import memory, release_facts

# The moments of a start, in order; the worker waits, moves its GPU memory and checks its headroom
# between them.
STAGES = (
    "weights",  # the target's weight lines (and the draft's, where it loads before the pools)
    "sizing",  # warnings of the pools' sizing (the KV cap, the running-requests caps)
    "pools",  # the Mamba and KV pool lines (the draft's KV pool after the target's on 0.5.14+)
    "pools_end",
    "graph_begin",
    "graph_end",
    "late_draft",  # 0.5.9: the draft's runner, after the target's pools and CUDA graphs
    "warnings",  # the other warnings, once the pools exist
    "summary",  # the scheduler's max_total_num_tokens= line (rank 0)
)


@dataclass
class StartupLines:
    stages: dict[str, list[tuple[str, str]]] = field(default_factory=lambda: {s: [] for s in STAGES})

    def add(self, stage: str, text: str, level: str = "info") -> None:
        self.stages[stage].append((level, text))

    def all(self) -> list[tuple[str, str]]:
        """Every line, in the order the start writes them: (level, text)."""
        return [line for stage in STAGES for line in self.stages[stage]]


def load_weight_begin(avail_gib: float) -> str:
    """A model runner's first line (the target's is written before its plan is known)."""
    return f"Load weight begin. avail mem={avail_gib:.2f} GB"


def _sizing(warning: str) -> bool:
    # Sizing (the KV cap, the running-requests caps) comes before the pools are built
    # (0.5.23 mem_cache/kv_cache_configurator.py:3140, 3184).
    return "max_total_tokens=" in warning or "max_running_requests" in warning


def startup_lines(
    inp: memory.MemoryInputs,
    plan: memory.MemoryPlan,
    args_for_log: dict[str, Any],
    *,
    rank0: bool = True,
    startup_s: float = 4.0,
) -> StartupLines:
    """What the scheduler of a start with inputs ``inp`` and plan ``plan`` writes after the target's
    ``Load weight begin`` (:func:`load_weight_begin`), by stage."""
    out = StartupLines()
    prof, version = inp.profile, inp.version
    # The formats' optional parts, as the release writes them (facts/<version>.json log_lines).
    dtype = (
        f"dtype=torch.{prof.torch_dtype}, " if release_facts.format_has(version, "load_weight_end", "dtype=") else ""
    )
    kv_dtype = f"dtype: torch.{prof.torch_dtype}, " if release_facts.format_has(version, "kv_cache", "dtype:") else ""
    draft_w = memory.draft_weights_gib(inp)
    late = memory.draft_after_target_pools(inp)
    early = draft_w > 0 and not late
    draft_lines = set(release_facts.draft_log_lines(version)) if draft_w > 0 else set()
    target_w = target_weights_gib(inp, plan)
    out.add(
        "weights",
        f"Load weight end. elapsed={0.5 * startup_s:.2f} s, type={prof.architectures[0]}, {dtype}"
        f"avail mem={plan.avail_after_weights_gib + plan.weights_gib - target_w:.2f} GB, "
        f"mem usage={target_w:.2f} GB.",
    )
    if early and "load_weight_end" in draft_lines:
        out.add("weights", load_weight_begin(plan.avail_after_weights_gib + draft_w))
        out.add(
            "weights",
            f"Load weight end. elapsed={0.02 * startup_s:.2f} s, type={prof.architectures[0]}MTP, {dtype}"
            f"avail mem={plan.avail_after_weights_gib:.2f} GB, mem usage={draft_w:.2f} GB.",
        )
    for warning in plan.warnings:
        if rank0:
            out.add("sizing" if _sizing(warning) else "warnings", warning, "warning")
    if plan.mamba_k is not None:
        line = (
            f"Mamba Cache is allocated. max_mamba_cache_size: {plan.mamba_k}, "
            f"conv_state size: {plan.conv_gib:.2f}GB, ssm_state size: {plan.ssm_gib:.2f}GB "
        )
        if inp.spec:
            line += (
                f"intermediate_ssm_state_cache size: {plan.inter_ssm_gib:.2f}GB "
                f"intermediate_conv_window_cache size: {plan.inter_conv_gib:.2f}GB "
            )
        out.add("pools", line)
    # On 0.5.14+ the target's pool holds its own layers and the draft's pool (layer [0] only, the
    # same #tokens, 0.5.23 mem_cache/kv_cache_configurator.py:2614-2622) logs its own line after it.
    share = target_kv_share(inp)
    parts = [share, 1.0 - share] if early and "kv_cache" in draft_lines else [share]
    for part in parts:
        out.add(
            "pools",
            f"KV Cache is allocated. {kv_dtype}#tokens: {plan.kv_tokens}, K size: {plan.k_gib * part:.2f} GB, "
            f"V size: {plan.v_gib * part:.2f} GB",
        )
    out.add("pools_end", f"Memory pool end. avail mem={plan.avail_after_pools_gib():.2f} GB")
    if inp.cuda_graph_enabled:
        out.add(
            "graph_begin",
            "Capture cuda graph begin. This can take up to several minutes. "
            f"avail mem={plan.avail_after_pools_gib():.2f} GB",
        )
        out.add(
            "graph_end",
            f"Capture cuda graph end. Time elapsed: {0.15 * startup_s:.2f} s. "
            f"mem usage={plan.graph_mib / 1024:.2f} GB. avail mem={plan.avail_after_graph_gib():.2f} GB.",
        )
    if late:
        # 0.5.9: the draft's runner (speculative/eagle_worker.py, is_draft_worker): its weights,
        # then its one-layer pool with the target's #tokens (model_runner_kv_cache_mixin.py:402-403).
        free = plan.avail_after_graph_gib()
        if "load_weight_end" in draft_lines:
            out.add("late_draft", load_weight_begin(free))
            out.add(
                "late_draft",
                f"Load weight end. elapsed={0.02 * startup_s:.2f} s, type={prof.architectures[0]}MTP, {dtype}"
                f"avail mem={free - draft_w:.2f} GB, mem usage={draft_w:.2f} GB.",
            )
        if "kv_cache" in draft_lines:
            out.add(
                "late_draft",
                f"KV Cache is allocated. {kv_dtype}#tokens: {plan.kv_tokens}, K size: {plan.late_draft_k_gib:.2f} GB, "
                f"V size: {plan.late_draft_v_gib:.2f} GB",
            )
        out.add("late_draft", f"Memory pool end. avail mem={plan.avail_after_late_draft_gib():.2f} GB")
    if rank0:
        # available_gpu_mem: the free memory once every runner is up (0.5.23 managers/scheduler.py:1262-1276).
        out.add(
            "summary",
            f"max_total_num_tokens={plan.kv_tokens}, chunked_prefill_size={args_for_log['chunked_prefill_size']}, "
            f"max_prefill_tokens={args_for_log['max_prefill_tokens']}, max_running_requests={plan.max_running}, "
            f"context_len={args_for_log['context_len']}, available_gpu_mem={plan.avail_after_late_draft_gib():.2f} GB",
        )
    return out


def target_weights_gib(inp: memory.MemoryInputs, plan: memory.MemoryPlan) -> float:
    """The target model's weights alone (the plan's pre-pool weights hold the draft's on 0.5.14+)."""
    early = memory.draft_weights_gib(inp) > 0 and not memory.draft_after_target_pools(inp)
    return plan.weights_gib - memory.draft_weights_gib(inp) if early else plan.weights_gib


def target_kv_share(inp: memory.MemoryInputs) -> float:
    """The target's part of the plan's KV pool: all of it, but on 0.5.14+ with MTP, where the pool
    is sized with the draft's layer in each token's cell."""
    draft_layers = inp.profile.draft_layers if inp.spec_mtp else 0
    if draft_layers and not memory.draft_after_target_pools(inp):
        return inp.profile.attention_layers / (inp.profile.attention_layers + draft_layers)
    return 1.0


def memory_usage(inp: memory.MemoryInputs, plan: memory.MemoryPlan) -> dict[str, float]:
    """``/server_info`` ``memory_usage``'s figures (GiB): the target's weights and its KV pool only
    (0.5.9 managers/scheduler.py:2655, 0.5.23 mem_cache/memory_pool.py:4359-4362), the Mamba pool,
    the CUDA graphs, and the free memory after the pools and graphs."""
    return {
        "weight_gib": target_weights_gib(inp, plan),
        "kv_gib": plan.kv_gib * target_kv_share(inp),
        "mamba_gib": plan.mamba_gib,
        "graph_gib": plan.graph_mib / 1024,
        "avail_start_gib": plan.avail_start_gib,
        "avail_end_gib": plan.avail_after_graph_gib(),
    }
