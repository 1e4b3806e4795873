"""The simulated SGLang instance the plugin tests check the collection against (the GPU simulator,
tests/doubles/gpusim): the GPUs' memory, the 7 x B200 run's first tuning, the simulator's memory
plan for a set of settings, and what it prints (the worker's startup lines, gpusim/startup.py) and
serves (api.py's /server_info) for them. The tests import it as ``simulated_instance`` (tests/unit/plugins/conftest.py
puts this folder on sys.path); only tests import the simulator, the product never does."""

from __future__ import annotations

from typing import Any

from gpusim import memory, profiles, startup
from gpusim.resolve import Resolved, _resolve_mamba
from gpusim.versions import Version

# nvidia-smi's memory.total (MiB).
H200, B200, RTX_PRO_6000 = 143771, 183359, 97887

# The 7 x B200 run's first tuning (inventories/demo/group_vars/sglang_servers.yml; the seeds' write-up of the
# real run): MTP (EAGLE, 4 draft tokens) and 80 Mamba slots at mamba_full_memory_ratio 0.4...
MTP_AND_80_SLOTS: dict[str, Any] = {
    "speculative_algorithm": "EAGLE",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
    "max_mamba_cache_size": 80,
    "mamba_full_memory_ratio": 0.4,
}
# ...with its reasoning parser and metrics on: extra_buffer by default, capped at 16 running
# requests, a full queue, the KV cache 2-3% used and ~27 GB per GPU idle.
FIRST_TUNING: dict[str, Any] = {**MTP_AND_80_SLOTS, "reasoning_parser": "qwen3", "enable_metrics": True}

# What the simulator (worker.py and api.py, which follow the reference) prints and serves for
# qwen3.6-27b on a B200 with SGLang 0.5.23, EAGLE (MTP, 4 draft tokens), 80 Mamba slots,
# mamba_full_memory_ratio 0.4 and SGLang's own mem_fraction_static: the demo's first tuning, as the
# 7 x B200 run had it before its retune: the target's weight lines, then the MTP draft's (its own
# runner, loaded before the pools on 0.5.14+), the pools, the draft's one-layer KV pool.
# (simulate() below writes the same lines but the cap warning.)
SIM_B200_JOURNAL = [
    "[2026-01-05 10:00:00] Load weight begin. avail mem=178.56 GB",
    "[2026-01-05 10:00:02] Load weight end. elapsed=2.00 s, type=Qwen3_5ForCausalLM, avail mem=126.76 GB, "
    "mem usage=51.80 GB.",
    "[2026-01-05 10:00:02] Load weight begin. avail mem=126.76 GB",
    "[2026-01-05 10:00:03] Load weight end. elapsed=0.05 s, type=Qwen3_5ForCausalLMMTP, avail mem=125.91 GB, "
    "mem usage=0.85 GB.",
    "[2026-01-05 10:00:03] max_running_requests is capped to 16 by the mamba state cache (max_mamba_cache_size=80, "
    "5 state slots per request). To raise it: increase --mamba-full-memory-ratio or --max-mamba-cache-size, or "
    "halve the state size with --mamba-ssm-dtype bfloat16.",
    "[2026-01-05 10:00:03] Mamba Cache is allocated. max_mamba_cache_size: 80, conv_state size: 0.81GB, "
    "ssm_state size: 20.25GB intermediate_ssm_state_cache size: 17.00GB intermediate_conv_window_cache size: 0.68GB ",
    "[2026-01-05 10:00:03] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 941074, K size: 28.72 GB, "
    "V size: 28.72 GB",
    "[2026-01-05 10:00:03] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 941074, K size: 1.79 GB, "
    "V size: 1.79 GB",
    "[2026-01-05 10:00:04] max_total_num_tokens=941074, chunked_prefill_size=16384, max_prefill_tokens=16384, "
    "max_running_requests=16, context_len=262144, available_gpu_mem=23.80 GB",
]
SIM_B200_SERVER_INFO: dict[str, Any] = {
    **MTP_AND_80_SLOTS,
    "mamba_radix_cache_strategy": "auto",
    "mem_fraction_static": 0.854,
    "max_running_requests": 48,
    "context_length": None,
    "status": "ready",
    "max_total_num_tokens": 941074,
    "max_req_input_len": 262138,
    "internal_states": [
        {
            "effective_max_running_requests_per_dp": 16,
            "max_mamba_cache_size": 80,
            "memory_usage": {
                "weight": 51.8,
                "kvcache": 57.439,
                "startup_available": 23.799,
                "token_capacity": 941074,
                "token_capacity_swa": None,
            },
        }
    ],
    "version": "0.5.23",
}


def memory_inputs(
    release: str,
    profile_name: str,
    gpu: int,
    *,
    args: dict[str, Any] | None = None,
    spec: bool = False,
    max_running_requests: int | None = None,
    draft_tokens: int = 4,
    **fields: Any,
) -> tuple[memory.MemoryInputs, dict[str, Any]]:
    """The simulator's memory inputs for a launch of ``profile_name`` on a ``gpu`` of that many MiB
    (``fields``: more of MemoryInputs, such as mem_fraction_static), and the launch's args as the
    simulator resolves them (page size 1 unless given; what Mamba's strategy turns off)."""
    profile = profiles.get_builtin(profile_name)
    assert profile is not None
    version = Version.of(release)
    resolved: dict[str, Any] = {"page_size": 1, **(args or {})}
    if spec and max_running_requests is None:
        max_running_requests = 48
    if spec and not version.at_least(14):
        resolved["disable_overlap_schedule"] = True  # 0.5.9: EAGLE turns the overlap scheduler off
    res = Resolved(args=resolved, spec=spec)
    res.overlap = not resolved.get("disable_overlap_schedule")
    if profile.is_hybrid:
        _resolve_mamba(resolved, res, version, profile)
    inp = memory.MemoryInputs(
        version=version,
        profile=profile,
        total_mib=gpu,
        others_mib=0,
        gpu_index=0,
        spec=spec,
        spec_mtp=spec and profile.mtp_capable,
        draft_tokens=draft_tokens if spec else 0,
        max_running_requests=max_running_requests,
        mamba_ratio=res.mamba_ratio,
        disable_radix_cache=bool(resolved.get("disable_radix_cache")),
        context_len=profile.context_length,
        **fields,
    )
    return inp, resolved


def simulated(release: str, profile_name: str, gpu: int, **kw: Any) -> tuple[memory.MemoryPlan, memory.MemoryInputs]:
    """The simulator's memory plan and its inputs (``kw``: those of memory_inputs)."""
    inp, _args = memory_inputs(release, profile_name, gpu, **kw)
    return memory.plan(inp), inp


def simulate(
    args: dict[str, Any],
    mem_fraction_static: float,
    release: str = "0.5.23",
    profile: str = "qwen3.6-27b",
    gpu: int = B200,
) -> tuple[list[str], dict[str, Any], memory.MemoryPlan, int]:
    """What the simulator prints (its worker's startup lines, written by gpusim/startup.py) and serves
    (api.py's /server_info) for these settings, its memory plan and its GPU's memory.used (MiB)."""
    spec = args.get("speculative_algorithm") is not None
    inp, a = memory_inputs(
        release,
        profile,
        gpu,
        args=args,
        spec=spec,
        max_running_requests=args.get("max_running_requests"),
        draft_tokens=int(args.get("speculative_num_draft_tokens") or 4),
        mem_fraction_static=mem_fraction_static,
        max_mamba_cache_size=args.get("max_mamba_cache_size"),
        mamba_full_memory_ratio=float(args.get("mamba_full_memory_ratio") or 0.9),
    )
    prof = inp.profile
    plan = memory.plan(inp)
    assert memory.check_headroom(inp, plan) is None, "the activations and CUDA graphs would not fit"
    # The lines the collection reads, as the simulator's worker writes them (gpusim/startup.py): the
    # target's weight lines, the draft's (its own runner: before the pools on 0.5.14+, after the
    # target's pools and graphs on 0.5.9), the pools, the scheduler's summary.
    args_for_log = {"chunked_prefill_size": 16384, "max_prefill_tokens": 16384, "context_len": prof.context_length}
    written = [startup.load_weight_begin(plan.avail_start_gib)]
    written += [text for _level, text in startup.startup_lines(inp, plan, args_for_log).all()]
    journal = [f"[2026-01-05 10:00:{i:02d}] {text}" for i, text in enumerate(written)]
    usage = startup.memory_usage(inp, plan)
    info = {
        **{k: v for k, v in a.items() if not k.startswith("_")},
        "mem_fraction_static": mem_fraction_static,
        "max_running_requests": inp.max_running_requests,
        "status": "ready",
        "max_total_num_tokens": plan.kv_tokens,
        # The scheduler's (0.5.23 managers/tp_worker.py:568-572).
        "max_req_input_len": min(prof.context_length - 1, plan.kv_tokens - 1) - 5,
        "internal_states": [
            {
                "effective_max_running_requests_per_dp": plan.max_running,
                "max_mamba_cache_size": plan.mamba_k,
                # The target's weights and KV pool; the free memory after the pools and graphs.
                "memory_usage": {
                    "weight": round(usage["weight_gib"], 3),
                    "kvcache": round(usage["kv_gib"], 3),
                    "startup_available": round(usage["avail_end_gib"], 3),
                    "token_capacity": plan.kv_tokens,
                },
            }
        ],
        "version": release,
    }
    return journal, info, plan, plan.final_mib
