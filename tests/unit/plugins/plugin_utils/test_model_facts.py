"""Model facts from a running instance's evidence (plugin_utils/_capacity/model_facts.py): the startup-line
parsers on lines copied from the SGLang reference (§5, "Log lines"), and the facts derived from
what the simulator prints and serves for the 7 x B200 run's first tuning."""

from __future__ import annotations

import re

import pytest
from simulated_instance import B200, SIM_B200_JOURNAL, SIM_B200_SERVER_INFO

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.inputs import GIB, Settings
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.model_facts import (
    JOURNAL_PATTERN,
    KVCacheLine,
    LoadWeightEnd,
    MambaCacheLine,
    SchedulerSummary,
    derive_model_facts,
    parse_kv_cache,
    parse_load_weight_begin,
    parse_load_weight_end,
    parse_mamba_cache,
    parse_mamba_cap_warning,
    parse_scheduler_summary,
    parse_startup_lines,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.plan import plan_capacity

# SGLang reference §5, "Startup lines in order" and "Exact templates" (the prefix [time TP0] as
# §5's formatting describes; the "..." of the reference filled with numbers of the same form).
REF_LOAD_BEGIN = "[2026-01-05 10:00:00 TP0] Load weight begin. avail mem=139.21 GB"
REF_LOAD_END_V9 = (
    "[2026-01-05 10:00:21 TP0] Load weight end. elapsed=20.51 s, type=Qwen3ForCausalLM, dtype=torch.bfloat16, "
    "avail mem=123.94 GB, mem usage=15.27 GB."
)
REF_LOAD_END_V23 = (  # "v23 drops dtype="
    "[2026-01-05 10:00:21] Load weight end. elapsed=20.51 s, type=Qwen3ForCausalLM, avail mem=123.94 GB, "
    "mem usage=15.27 GB."
)
REF_MAMBA = (  # no space before GB, a trailing space
    "[2026-01-05 10:00:22] Mamba Cache is allocated. max_mamba_cache_size: 283, conv_state size: 0.40GB, "
    "ssm_state size: 27.65GB "
)
REF_MAMBA_SPEC = (
    "Mamba Cache is allocated. max_mamba_cache_size: 155, conv_state size: 0.40GB, ssm_state size: 15.10GB "
    "intermediate_ssm_state_cache size: 12.40GB intermediate_conv_window_cache size: 0.33GB "
)
REF_KV_V9 = "[2026-01-05 10:00:22 TP0] KV Cache is allocated. #tokens: 1437920, K size: 49.37 GB, V size: 49.37 GB"
REF_KV_V14 = "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1437920, K size: 49.37 GB, V size: 49.37 GB"
REF_SUMMARY = (
    "[2026-01-05 10:01:02 TP0] max_total_num_tokens=1437920, chunked_prefill_size=8192, max_prefill_tokens=16384, "
    "max_running_requests=4096, context_len=40960, available_gpu_mem=12.34 GB"
)
# §8, sgl-project/sglang#36889.
REF_CAP = (
    "max_running_requests is capped to 2 by the mamba state cache (max_mamba_cache_size=10, 5 state slots per "
    "request). To raise it: increase --mamba-full-memory-ratio or --max-mamba-cache-size, or halve the state "
    "size with --mamba-ssm-dtype bfloat16."
)
REF_REDUCED = (
    "max_running_requests was reduced from the requested 48 to 31 (per dp worker) due to the available KV "
    "cache capacity."
)


def test_parsers_on_the_reference_lines() -> None:
    assert parse_load_weight_begin(REF_LOAD_BEGIN) == 139.21
    assert parse_load_weight_end(REF_LOAD_END_V9) == LoadWeightEnd(123.94, 15.27)
    assert parse_load_weight_end(REF_LOAD_END_V23) == LoadWeightEnd(123.94, 15.27)
    assert parse_mamba_cache(REF_MAMBA) == MambaCacheLine(283, 0.40, 27.65)
    spec = parse_mamba_cache(REF_MAMBA_SPEC)
    assert spec == MambaCacheLine(155, 0.40, 15.10, 12.40, 0.33)
    assert spec.intermediate_gib == pytest.approx(12.73)
    assert parse_kv_cache(REF_KV_V9) == KVCacheLine(1437920, 49.37, 49.37, None)
    assert parse_kv_cache(REF_KV_V14) == KVCacheLine(1437920, 49.37, 49.37, "torch.bfloat16")
    assert parse_scheduler_summary(REF_SUMMARY) == SchedulerSummary(1437920, 8192, 16384, 4096, 40960, 12.34)
    assert parse_mamba_cap_warning(REF_CAP) == (2, 10, 5)
    for other in ("Decode batch, #running-req: 3, #token: 412, token usage: 0.00", "Memory pool end. avail mem=3.1 GB"):
        assert parse_kv_cache(other) is None and parse_mamba_cache(other) is None
        assert parse_load_weight_end(other) is None and parse_scheduler_summary(other) is None


def test_every_reference_line_matches_the_journal_pattern() -> None:
    pattern = re.compile(JOURNAL_PATTERN)
    for line in (REF_LOAD_BEGIN, REF_LOAD_END_V9, REF_MAMBA, REF_KV_V9, REF_SUMMARY, REF_CAP, REF_REDUCED):
        assert pattern.search(line), line
    lines = parse_startup_lines([REF_LOAD_BEGIN, REF_LOAD_END_V9, REF_KV_V9, REF_SUMMARY, REF_REDUCED, "noise"])
    assert lines.kv_reduced == (48, 31)
    assert lines.found() == [
        "Load weight begin",
        "Load weight end",
        "KV Cache is allocated",
        "max_total_num_tokens=",
        "max_running_requests was reduced",
    ]


# The simulator's qwen3.6-27b profile (profiles.py): conv 10737418 + ssm 268435456 bytes per slot;
# KV 4 heads x (256 + 256) x (16 + 1 MTP) layers x 2 bytes; 51.8 + 0.85 GiB of weights.
PER_SLOT, CELL = 10_737_418 + 268_435_456, 4 * 512 * 17 * 2


def test_facts_of_the_b200_run_from_its_journal() -> None:
    derived = derive_model_facts("0.5.23", SIM_B200_JOURNAL, SIM_B200_SERVER_INFO, B200)
    assert derived.problems == []
    facts = derived.facts
    assert facts is not None and facts.hybrid
    # 2-decimal GB figures: within 0.1%.
    assert facts.mamba_bytes_per_slot == pytest.approx(PER_SLOT, rel=1e-3)
    assert facts.kv_bytes_per_token == pytest.approx(CELL, rel=1e-3)
    assert facts.weights_gib == 52.65 and facts.context_length == 262144
    assert facts.overhead_gib == pytest.approx(0.5, abs=0.01)
    assert derived.sources["mamba_bytes_per_slot"] == (
        "startup log: Mamba Cache is allocated ((conv + ssm) / 81 slots, one of them padding)"
    )
    assert derived.observed["logged_mamba_cap"] == {
        "max_running_requests": 16,
        "max_mamba_cache_size": 80,
        "slots_per_request": 5,
    }
    # The arithmetic with these facts reproduces what the instance reports.
    settings = Settings.from_args({**SIM_B200_SERVER_INFO, "max_running_requests": None})
    plan = plan_capacity("0.5.23", facts, B200, settings)
    assert (plan.mamba_k, plan.effective_max_running_requests, plan.binding) == (80, 16, "mamba")
    assert plan.kv_tokens == pytest.approx(941074, rel=1e-3)


def test_without_the_journal_server_info_gives_the_kv_cell_but_not_the_memory_before_the_weights() -> None:
    """memory_usage.startup_available is the free memory after the pools and the CUDA graphs (0.5.23
    managers/scheduler.py:1262-1276), not before the weights; kvcache is the KV pool alone."""
    info = {
        "max_total_num_tokens": 400000,
        "max_req_input_len": 40954,
        "internal_states": [
            {
                "effective_max_running_requests_per_dp": 4096,
                "memory_usage": {
                    "weight": 15.27,
                    "kvcache": 54.932,
                    "startup_available": 139.21,
                    "token_capacity": 400000,
                },
            }
        ],
    }
    derived = derive_model_facts("0.5.18", [], info, 143771)
    assert derived.facts is None
    assert derived.problems == ["memory in use before the weights: no 'Load weight' line in the journal"]
    assert derived.sources["kv_bytes_per_token"] == "/server_info: memory_usage kvcache (the KV pool) / token_capacity"
    assert derived.sources["context_length"] == "/server_info: max_req_input_len + 6"
    # With the journal's first Load weight line the facts are complete.
    begin = "[2026-01-05 10:00:00] Load weight begin. avail mem=139.21 GB"
    derived = derive_model_facts("0.5.18", [begin], info, 143771)
    assert derived.problems == [] and derived.facts is not None
    assert not derived.facts.hybrid
    assert derived.facts.kv_bytes_per_token == pytest.approx(54.932 * GIB / 400000)
    assert derived.facts.context_length == 40960
    assert derived.facts.overhead_gib == pytest.approx(143771 / 1024 - 139.21)


def test_a_hybrid_model_needs_its_mamba_line() -> None:
    journal = [line for line in SIM_B200_JOURNAL if "Mamba Cache" not in line]
    derived = derive_model_facts("0.5.23", journal, SIM_B200_SERVER_INFO, B200)
    assert derived.facts is None
    assert derived.problems == [
        "Mamba state per slot: the journal's 'Mamba Cache is allocated' line of the current run is missing "
        "(/server_info does not tell the Mamba pool from the KV cache)"
    ]


def test_before_0_5_18_the_mamba_pool_has_no_padding_slot() -> None:
    derived = derive_model_facts("0.5.14", [REF_MAMBA, REF_KV_V14, REF_LOAD_END_V9, REF_SUMMARY], None, 143771)
    assert derived.facts is not None
    assert derived.facts.mamba_bytes_per_slot == pytest.approx((0.40 + 27.65) * GIB / 283)
    assert derived.facts.context_length == 40960


def test_nothing_known_says_what_is_missing() -> None:
    derived = derive_model_facts("0.5.9", [], None, None)
    assert derived.facts is None
    assert derived.problems == [
        "weights: neither the journal's 'Load weight end' line nor /server_info memory_usage.weight",
        "the GPU's memory.total (nvidia-smi) is unknown",
        "KV bytes per token: no 'KV Cache is allocated' line in the journal and /server_info memory_usage "
        "does not give it",
        "context length: no 'context_len=' line in the journal, no sglang:context_len gauge",
    ]


@pytest.mark.parametrize(
    ("context_len", "kv_tokens", "expected"),
    [
        (4096, 100000, 4096),  # the context binds: max_req_input_len 4090, as real 0.5.23 reports it
        (40960, 400000, 40960),
        (262144, 20000, None),  # the KV pool binds: max_req_input_len says nothing of the context
    ],
)
def test_the_context_length_from_max_req_input_len_is_the_schedulers_inverse(
    context_len: int, kv_tokens: int, expected: int | None
) -> None:
    """The scheduler's max_req_input_len = min(context_len - 1, KV pool - 1) - 5 (0.5.23
    managers/tp_worker.py:568-572; 0.5.9 managers/tp_worker.py:287-291)."""
    memory = {"weight": 15.27, "kvcache": 54.932, "startup_available": 139.21, "token_capacity": kv_tokens}
    info = {
        "max_total_num_tokens": kv_tokens,
        "max_req_input_len": min(context_len - 1, kv_tokens - 1) - 5,
        "internal_states": [{"effective_max_running_requests_per_dp": 4096, "memory_usage": memory}],
    }
    begin = "[2026-01-05 10:00:00] Load weight begin. avail mem=139.21 GB"
    derived = derive_model_facts("0.5.23", [begin], info, 143771)
    if expected is None:
        assert derived.facts is None
        assert derived.problems == [
            "context length: no 'context_len=' line in the journal, no sglang:context_len gauge"
        ]
    else:
        assert derived.facts is not None and derived.facts.context_length == expected
        assert derived.sources["context_length"] == "/server_info: max_req_input_len + 6"
