"""SGLang's memory arithmetic (plugin_utils/_capacity/) against the worked examples of the
reference (SGLang's memory math, §6 of the SGLang reference the collection was written from,
copied here), and against the simulator's own implementation (tests/doubles/gpusim memory.py) on
its model profiles (simulated(): tests/unit/plugins/support/simulated_instance.py). Only tests import
the simulator; the product never does."""

from __future__ import annotations

import math
from typing import Any

import pytest
from simulated_instance import B200, H200, RTX_PRO_6000, simulated

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.defaults import (
    auto_chunked_prefill_size,
    auto_decode_max_bs,
    default_mem_fraction_static,
    prefill_graph_sizes,
    reserved_mib,
    resolve_strategy,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.inputs import GIB, ModelFacts, Settings
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.plan import (
    mamba_family,
    plan_capacity,
    predict_effective_max_running_requests,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.table import supported_versions
from gpusim import memory, profiles

# SGLang's memory math, §6.1 "Worked defaults with tp=1 and no spec ((G - reserved)/G)":
#   GPU                  v9                                   v14 / v18 / v23 (prefill graph enabled)
#   H200 143771          512+12288+512+128 = 13440 -> 0.907   13440+464 = 13904 -> 0.903
#   B200 183359          512+24576+1024+128 = 26240 -> 0.857  +592 -> 26832 -> 0.854
#   RTX PRO 6000 97887   13440 -> 0.863                       13904 -> 0.858
MEM_FRACTION_V9 = {H200: 0.907, B200: 0.857, RTX_PRO_6000: 0.863}
MEM_FRACTION_V14 = {H200: 0.903, B200: 0.854, RTX_PRO_6000: 0.858}
RESERVED_V9 = {H200: 13440, B200: 26240, RTX_PRO_6000: 13440}
RESERVED_V14 = {H200: 13904, B200: 26832, RTX_PRO_6000: 13904}


@pytest.mark.parametrize("gpu", [H200, B200, RTX_PRO_6000])
def test_default_mem_fraction_static_v9(gpu: int) -> None:
    assert default_mem_fraction_static("0.5.9", gpu) == MEM_FRACTION_V9[gpu]


@pytest.mark.parametrize("release", [v for v in supported_versions() if v != "0.5.9"])
@pytest.mark.parametrize("gpu", [H200, B200, RTX_PRO_6000])
def test_default_mem_fraction_static_from_v14_on(release: str, gpu: int) -> None:
    # Every supported release from 0.5.14 on follows the v14 column.
    assert default_mem_fraction_static(release, gpu) == MEM_FRACTION_V14[gpu]


def test_the_reserve_behind_the_worked_defaults() -> None:
    for gpu in (H200, B200, RTX_PRO_6000):
        assert reserved_mib("0.5.9", gpu, Settings()) == RESERVED_V9[gpu]
        assert reserved_mib("0.5.23", gpu, Settings()) == RESERVED_V14[gpu]
    # "about 58 sizes for 8192 tokens, so 464"; 592 for B200's 16384.
    assert len(prefill_graph_sizes(8192)) * 8 == 464 and len(prefill_graph_sizes(16384)) * 8 == 592


def test_the_auto_tiers_of_6_1() -> None:
    # | G (MiB) | chunked_prefill_size | decode max_bs (tp<4 / tp>=4) |
    assert auto_chunked_prefill_size("0.5.9", 16000) == 2048 and auto_decode_max_bs("0.5.9", 16000) == 8
    assert auto_chunked_prefill_size("0.5.19", 32000) == 2048 and auto_decode_max_bs("0.5.19", 32000, 4) == 80
    assert auto_chunked_prefill_size("0.5.20", 32000) == 4096 and auto_decode_max_bs("0.5.20", 32000) == 48
    assert auto_chunked_prefill_size("0.5.9", 40960) == 4096 and auto_decode_max_bs("0.5.9", 40960, 4) == 160
    assert auto_chunked_prefill_size("0.5.9", 81559) == 8192 and auto_decode_max_bs("0.5.9", 81559) == 256
    assert auto_chunked_prefill_size("0.5.9", H200) == 8192 and auto_decode_max_bs("0.5.9", H200, 8) == 512
    assert auto_chunked_prefill_size("0.5.9", B200) == 16384 and auto_decode_max_bs("0.5.9", B200) == 512


def test_v9_speculative_reserve_and_explicit_flags() -> None:
    # v9: +2048 (EAGLE-type) or +6144 (STANDALONE) after the floor; removed from v14.
    eagle = Settings(speculative_algorithm="EAGLE")
    assert default_mem_fraction_static("0.5.9", H200, eagle) == round((H200 - 13440 - 2048) / H200, 3)
    standalone = Settings(speculative_algorithm="STANDALONE")
    assert default_mem_fraction_static("0.5.9", H200, standalone) == round((H200 - 13440 - 6144) / H200, 3)
    assert default_mem_fraction_static("0.5.14", H200, eagle) == 0.903
    # 0.5.22+: the default decode max_bs is lowered to --max-running-requests when smaller.
    mrr = Settings(max_running_requests=64)
    assert default_mem_fraction_static("0.5.22", H200, mrr) == round((H200 - (13904 - 512 + 128)) / H200, 3)
    assert default_mem_fraction_static("0.5.21", H200, mrr) == 0.903


# SGLang's memory math, §6.3 illustration: "same rest = 60 GiB, per_req = 0.1 GiB, r = 0.9, so
# budget = 28.42 GiB; spec D = 4":
#   Setting                                                  K    K // ratio  effective mrr
#   v9 no spec, auto -> no_buffer (ratio 3)                  284  94          94
#   v9 spec, auto -> no_buffer -> radix off (ratio 1), 48    48   48          48
#   v18+ no spec, auto -> extra_buffer, overlap (ratio 5)    283  56          56
#   v18+ spec, auto -> extra_buffer, overlap (ratio 5), 48   155  31          31
#   v18+ spec, extra_buffer_lazy (ratio 4)                   139  34          34
ILLUSTRATION = [
    ("0.5.9", False, "auto", 3, 284, 94, 94),
    ("0.5.9", True, "auto", 1, 48, 48, 48),
    ("0.5.18", False, "auto", 5, 283, 56, 56),
    ("0.5.18", True, "auto", 5, 155, 31, 31),
    ("0.5.18", True, "extra_buffer_lazy", 4, 139, 34, 34),
]
# rest = A - T x (1 - mfs) = 60 GiB: T = 100 GiB, nothing in use before 30 GiB of weights, mfs 0.9.
ILLUSTRATION_FACTS = ModelFacts(
    hybrid=True,
    mamba_bytes_per_slot=0.1 * GIB,
    kv_bytes_per_token=64 * 1024,
    weights_gib=30.0,
    context_length=32768,
    overhead_gib=0.0,
)


@pytest.mark.parametrize(("release", "spec", "strategy", "ratio", "k", "cap", "eff"), ILLUSTRATION)
def test_the_mamba_illustration_of_6_3(
    release: str, spec: bool, strategy: str, ratio: int, k: int, cap: int, eff: int
) -> None:
    settings = Settings(mem_fraction_static=0.9, mamba_scheduler_strategy=strategy)
    if spec:
        settings = settings.with_changes(speculative_algorithm="EAGLE", speculative_num_draft_tokens=4)
    plan = plan_capacity(release, ILLUSTRATION_FACTS, 100 * 1024, settings)
    assert plan.fits, plan.errors
    assert plan.rest_gib == pytest.approx(60.0)
    assert (plan.mamba_ratio, plan.mamba_k, plan.mamba_k // plan.mamba_ratio) == (ratio, k, cap)
    assert plan.effective_max_running_requests == eff
    assert plan.binding == "mamba"
    if spec:
        assert plan.requested_max_running_requests == 48


@pytest.mark.parametrize("release", ["0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"])
def test_the_v18_rows_hold_for_every_later_release(release: str) -> None:
    spec = Settings(mem_fraction_static=0.9, speculative_algorithm="EAGLE", speculative_num_draft_tokens=4)
    assert plan_capacity(release, ILLUSTRATION_FACTS, 100 * 1024, spec).mamba_k == 155


def test_v14_sizing_has_no_padding_slot() -> None:
    # v14 auto with spec: K = floor(budget / (per_req x (1 + D/ratio))) = floor(28.42 / 0.18) = 157.
    spec = Settings(mem_fraction_static=0.9, speculative_algorithm="EAGLE", speculative_num_draft_tokens=4)
    plan = plan_capacity("0.5.14", ILLUSTRATION_FACTS, 100 * 1024, spec)
    assert plan.mamba_k == math.floor(60 * 0.9 / 1.9 / (0.1 * 1.8))
    assert mamba_family("0.5.14") == 14 and mamba_family("0.5.17") == 14 and mamba_family("0.5.13") == 9


# Slots per request, §6.3: radix off 1; no_buffer 3; extra_buffer 3+2 (overlap on) or 3+1;
# extra_buffer + spec: v9 4 (EAGLE turns overlap off), v14+ 5 with overlap on;
# extra_buffer_lazy 4; SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK (v18+): base 2 (no_buffer stays 3).
@pytest.mark.parametrize(
    ("release", "settings", "strategy", "ratio", "overlap", "radix"),
    [
        ("0.5.9", Settings(), "no_buffer", 3, False, True),
        ("0.5.9", Settings(disable_radix_cache=True), "no_buffer", 1, True, False),
        ("0.5.9", Settings(mamba_scheduler_strategy="extra_buffer"), "extra_buffer", 5, True, True),
        (
            "0.5.9",
            Settings(mamba_scheduler_strategy="extra_buffer", speculative_algorithm="EAGLE"),
            "extra_buffer",
            4,
            False,
            True,
        ),
        ("0.5.9", Settings(speculative_algorithm="EAGLE"), "no_buffer", 1, False, False),
        ("0.5.14", Settings(), "extra_buffer", 5, True, True),
        ("0.5.14", Settings(speculative_algorithm="EAGLE"), "extra_buffer", 5, True, True),
        ("0.5.14", Settings(speculative_algorithm="EAGLE", disable_overlap_schedule=True), "no_buffer", 3, False, True),
        ("0.5.14", Settings(disable_overlap_schedule=True, page_size=64), "extra_buffer", 4, False, True),
        (
            "0.5.14",
            Settings(mamba_scheduler_strategy="no_buffer", disable_overlap_schedule=True),
            "no_buffer",
            3,
            False,
            True,
        ),
        ("0.5.23", Settings(mamba_scheduler_strategy="extra_buffer_lazy"), "extra_buffer_lazy", 4, True, True),
        ("0.5.23", Settings(skip_decode_lock=True), "extra_buffer", 4, True, True),
        (
            "0.5.23",
            Settings(skip_decode_lock=True, mamba_scheduler_strategy="no_buffer", disable_overlap_schedule=True),
            "no_buffer",
            3,
            False,
            True,
        ),
        ("0.5.14", Settings(skip_decode_lock=True), "extra_buffer", 5, True, True),
    ],
)
def test_strategy_resolution_and_slots_per_request(
    release: str, settings: Settings, strategy: str, ratio: int, overlap: bool, radix: bool
) -> None:
    resolved = resolve_strategy(release, settings)
    assert (resolved.strategy, resolved.ratio, resolved.overlap, resolved.radix_cache) == (
        strategy,
        ratio,
        overlap,
        radix,
    )


@pytest.mark.parametrize("release", ["0.5.14", "0.5.23"])
def test_an_explicit_no_buffer_with_the_overlap_scheduler_on_would_not_start(release: str) -> None:
    """0.5.14+ assert it (the release's own message); only auto resolving to no_buffer turns overlap off."""
    refused = resolve_strategy(release, Settings(mamba_scheduler_strategy="no_buffer"))
    assert refused.error is not None
    assert "no_buffer do not support overlap schedule. Try to set disable_overlap_schedule=True." in refused.error
    plan = plan_capacity(release, ILLUSTRATION_FACTS, 100 * 1024, Settings(mamba_scheduler_strategy="no_buffer"))
    assert not plan.fits
    auto = resolve_strategy(release, Settings(disable_overlap_schedule=True))
    assert (auto.strategy, auto.overlap, auto.error) == ("no_buffer", False, None)
    assert resolve_strategy("0.5.9", Settings(mamba_scheduler_strategy="no_buffer")).error is None


def test_models_without_mamba_radix_support_and_extra_buffer_refusals() -> None:
    assert resolve_strategy("0.5.23", Settings(), "KimiLinearForCausalLM").ratio == 1
    assert resolve_strategy("0.5.23", Settings(), "NemotronHForCausalLM").strategy == "no_buffer"
    refused = resolve_strategy("0.5.9", Settings(mamba_scheduler_strategy="extra_buffer"), "NemotronHForCausalLM")
    assert refused.error == "NemotronHForCausalLM rejects the mamba strategy extra_buffer"


def test_would_not_fit_carries_sglangs_messages() -> None:
    facts = ILLUSTRATION_FACTS
    # The Mamba pool cannot have a slot (SGLang's message, §6.3).
    plan = plan_capacity("0.5.18", facts, 100 * 1024, Settings(mem_fraction_static=0.3005))
    assert not plan.fits
    assert plan.errors[0].startswith(
        "would not fit: Not enough GPU memory for hybrid (mamba/linear-attention) state cache. "
        "Computed max_mamba_cache_size=-1 "
    )
    # Explicit slots leave nothing for the KV cache: v9's text up to 0.5.22, v23's from 0.5.23 (§6.2).
    big = Settings(mem_fraction_static=0.9, max_mamba_cache_size=700)
    assert plan_capacity("0.5.22", facts, 100 * 1024, big).errors == (
        "would not fit: Not enough memory. Please try to increase --mem-fraction-static.",
    )
    (v23,) = plan_capacity("0.5.23", facts, 100 * 1024, big).errors
    assert v23.startswith(
        "would not fit: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.9. "
        "Raise --mem-fraction-static above 0.30"
    )
    # Weights larger than the GPU.
    heavy = ModelFacts(
        hybrid=False, mamba_bytes_per_slot=0, kv_bytes_per_token=1024, weights_gib=120, context_length=4096
    )
    assert "CUDA out of memory" in plan_capacity("0.5.23", heavy, 100 * 1024, Settings()).errors[0]


def test_too_few_slots_for_one_request() -> None:
    plan = plan_capacity(
        "0.5.23", ILLUSTRATION_FACTS, 100 * 1024, Settings(mem_fraction_static=0.9, max_mamba_cache_size=4)
    )
    assert plan.effective_max_running_requests == 0
    assert plan.errors[0].startswith(
        "would not fit: Hybrid (mamba/linear-attention) state cache is too small to serve any requests. "
        "max_mamba_cache_size=4, mamba_ratio=5"
    )


def test_max_running_requests_of_a_plain_model() -> None:
    facts = ModelFacts(
        hybrid=False, mamba_bytes_per_slot=0, kv_bytes_per_token=147456, weights_gib=15.27, context_length=40960
    )
    # v14+: min(clamp(tokens / context_len x 512, 2048, 4096), tokens // 2).
    plan = plan_capacity("0.5.23", facts, H200, Settings())
    assert plan.binding == "default" and plan.effective_max_running_requests == max(
        min(int(plan.kv_tokens / 40960 * 512), 4096), 2048
    )
    assert plan.mem_fraction_static == 0.903 and plan.mem_fraction_static_default
    # Requested, below both.
    plan = plan_capacity("0.5.9", facts, H200, Settings(max_running_requests=128))
    assert (plan.effective_max_running_requests, plan.binding) == (128, "requested")
    # Half the KV cache binds (max_total_tokens caps the pool).
    plan = plan_capacity("0.5.23", facts, H200, Settings(max_total_tokens=1000, page_size=64))
    assert plan.kv_tokens == 960 and (plan.effective_max_running_requests, plan.binding) == (480, "kv")
    # v9 without the flag: min(tokens // 2, the estimate).
    plan = plan_capacity("0.5.9", facts, H200, Settings(max_total_tokens=3000))
    assert (plan.effective_max_running_requests, plan.binding) == (1500, "kv")


def test_settings_from_args_of_any_release() -> None:
    settings = Settings.from_args(
        {
            "mamba_radix_cache_strategy": "no_buffer",
            "cuda_graph_max_bs_decode": 64,
            "tp_size": 2,
            "attn_dp_size": 2,
            "speculative_algorithm": "nextn",
            "max_mamba_cache_size": 200,
            "unrelated": "x",
        },
        {"SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK": "1"},
    )
    assert settings.mamba_scheduler_strategy == "no_buffer" and settings.cuda_graph_max_bs == 64
    assert (settings.tp_size, settings.dp_size, settings.enable_dp_attention) == (2, 2, True)
    assert settings.speculative_algorithm == "NEXTN" and settings.draft_tokens() == 4
    assert settings.skip_decode_lock and settings.attn_dp() == 2
    assert Settings.from_args({"mamba_scheduler_strategy": "extra_buffer"}).mamba_scheduler_strategy == "extra_buffer"
    assert Settings(speculative_algorithm="NGRAM").draft_tokens() == 12


def test_predict_is_the_plan() -> None:
    settings = Settings(mem_fraction_static=0.9, speculative_algorithm="EAGLE", speculative_num_draft_tokens=4)
    assert predict_effective_max_running_requests("0.5.23", ILLUSTRATION_FACTS, 100 * 1024, settings) == plan_capacity(
        "0.5.23", ILLUSTRATION_FACTS, 100 * 1024, settings
    )


# ------------------------------------------------------------------------------------------------
# Cross-check against the simulator's memory math on its profiles
# ------------------------------------------------------------------------------------------------


def facts_of(profile: profiles.ModelProfile, inp: memory.MemoryInputs) -> ModelFacts:
    conv, ssm = profile.mamba_per_req_bytes(inp.mamba_ssm_dtype, inp.tp_size)
    kv_heads = max(1, profile.num_kv_heads // inp.tp_size)
    # What the target's lines say: its cell counts the draft's layer where the draft loads before the
    # pools (0.5.14+); on 0.5.9 the draft loads after them, into a pool of its own.
    draft_first = inp.spec_mtp and not memory.draft_after_target_pools(inp)
    layers = profile.attention_layers + (profile.draft_layers if draft_first else 0)
    cell = kv_heads * (profile.head_dim + (profile.v_head_dim or profile.head_dim)) * layers * profile.kv_dtype_bytes
    return ModelFacts(
        hybrid=profile.is_hybrid,
        mamba_bytes_per_slot=float(conv + ssm),
        kv_bytes_per_token=float(cell),
        weights_gib=memory.weights_gib(inp),
        context_length=inp.context_len,
        overhead_gib=(profile.context_mib + inp.others_mib) / 1024.0,
        architecture=profile.architectures[0],
    )


CROSS = [
    ("0.5.9", "qwen3.6-27b", B200, {"mem_fraction_static": 0.857}),
    ("0.5.9", "qwen3.6-27b", B200, {"mem_fraction_static": 0.857, "spec": True}),
    ("0.5.9", "qwen3.6-27b", H200, {"mem_fraction_static": 0.9, "spec": True, "max_mamba_cache_size": 60}),
    ("0.5.14", "qwen3.6-27b", B200, {"mem_fraction_static": 0.854, "spec": True}),
    ("0.5.14", "qwen3.6-27b", H200, {"mem_fraction_static": 0.903}),
    ("0.5.18", "qwen3.6-27b", B200, {"mem_fraction_static": 0.854, "spec": True, "mamba_full_memory_ratio": 0.4}),
    ("0.5.23", "qwen3.6-27b", B200, {"mem_fraction_static": 0.854, "spec": True, "max_mamba_cache_size": 80}),
    (
        "0.5.23",
        "qwen3.6-27b",
        B200,
        {"mem_fraction_static": 0.93, "spec": True, "max_mamba_cache_size": 200, "max_running_requests": 64},
    ),
    (
        "0.5.23",
        "qwen3.6-27b",
        B200,
        {
            "mem_fraction_static": 0.93,
            "spec": True,
            "args": {"mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True},
        },
    ),
    ("0.5.23", "qwen3.6-27b", RTX_PRO_6000, {"mem_fraction_static": 0.858}),
    ("0.5.9", "qwen3-8b", RTX_PRO_6000, {"mem_fraction_static": 0.863}),
    ("0.5.23", "qwen3-8b", H200, {"mem_fraction_static": 0.903, "max_running_requests": 128}),
    ("0.5.23", "tiny", H200, {"mem_fraction_static": 0.5, "max_total_tokens": 5000, "page_size": 16}),
]


@pytest.mark.parametrize(("release", "profile_name", "gpu", "kw"), CROSS)
def test_the_same_numbers_as_the_simulator(release: str, profile_name: str, gpu: int, kw: dict[str, Any]) -> None:
    sim, inp = simulated(release, profile_name, gpu, **dict(kw))
    settings = Settings(
        mem_fraction_static=inp.mem_fraction_static,
        max_mamba_cache_size=inp.max_mamba_cache_size,
        mamba_full_memory_ratio=inp.mamba_full_memory_ratio,
        mamba_scheduler_strategy=str((kw.get("args") or {}).get("mamba_radix_cache_strategy", "auto")),
        speculative_algorithm="EAGLE" if inp.spec else None,
        speculative_num_draft_tokens=inp.draft_tokens or None,
        max_running_requests=kw.get("max_running_requests"),
        max_total_tokens=inp.max_total_tokens,
        page_size=inp.page_size,
        disable_overlap_schedule=bool((kw.get("args") or {}).get("disable_overlap_schedule")),
    )
    plan = predict_effective_max_running_requests(release, facts_of(inp.profile, inp), gpu, settings)
    assert plan.fits, plan.errors
    assert plan.mamba_ratio == (sim.mamba_ratio if inp.profile.is_hybrid else None)
    assert plan.mamba_k == sim.mamba_k
    assert plan.kv_tokens == sim.kv_tokens
    assert plan.effective_max_running_requests == sim.max_running
    assert plan.mamba_pool_gib + plan.mamba_intermediate_gib == pytest.approx(sim.mamba_gib)


def test_the_simulators_b200_retune_16_to_40() -> None:
    """The demo's first tuning (80 slots, MTP, auto mem fraction) and the 7 x B200 retune (200 slots,
    0.93, 64): 16 and 40 running requests, in the simulator and here."""
    for kw, expected in (
        ({"mem_fraction_static": 0.854, "spec": True, "max_mamba_cache_size": 80, "mamba_full_memory_ratio": 0.4}, 16),
        ({"mem_fraction_static": 0.93, "spec": True, "max_mamba_cache_size": 200, "max_running_requests": 64}, 40),
    ):
        sim, inp = simulated("0.5.23", "qwen3.6-27b", B200, **dict(kw))
        settings = Settings(
            mem_fraction_static=inp.mem_fraction_static,
            max_mamba_cache_size=inp.max_mamba_cache_size,
            speculative_algorithm="EAGLE",
            speculative_num_draft_tokens=4,
            max_running_requests=kw.get("max_running_requests"),
        )
        plan = plan_capacity("0.5.23", facts_of(inp.profile, inp), B200, settings)
        assert sim.max_running == plan.effective_max_running_requests == expected
        assert plan.binding == "mamba"
