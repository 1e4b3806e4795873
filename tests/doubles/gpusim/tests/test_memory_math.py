"""Argument resolution and memory math (reference section 6), computed in-process."""

from __future__ import annotations

import pytest
from conftest import SPEC

from gpusim import cli_parser, memory, resolve
from gpusim.config import Config
from gpusim.profiles import ModelProfile
from gpusim.versions import Version

H200 = {"name": "NVIDIA H200", "memory_total_mib": 143771}
B200 = {"name": "NVIDIA B200", "memory_total_mib": 183359}
RTX = {"name": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "memory_total_mib": 97887}


def setup(version: str, gpus: dict, argv: list[str], profile: str = "qwen3-8b", **extra):
    cfg = Config({"sglang_version": version, "gpus": gpus, "model": {"profile": profile}, **extra})
    raw = cli_parser.parse_args(["--model-path", "m", *argv], cfg.version)
    prof = cfg.profile_for("m")
    res = resolve.resolve(raw, cfg.version, cfg, prof)
    return cfg, prof, res


def plan(version: str, gpus: dict, argv: list[str], profile: str = "qwen3-8b", others: int = 0):
    cfg, prof, res = setup(version, gpus, argv, profile)
    a = res.args
    inp = memory.MemoryInputs(
        version=cfg.version,
        profile=prof,
        total_mib=cfg.gpus[0].memory_total_mib,
        others_mib=others,
        gpu_index=0,
        mem_fraction_static=a["mem_fraction_static"],
        tp_size=a["tp_size"],
        spec=res.spec,
        spec_mtp=res.spec_mtp,
        draft_tokens=res.draft_tokens,
        max_running_requests=a.get("max_running_requests"),
        max_mamba_cache_size=a.get("max_mamba_cache_size"),
        mamba_full_memory_ratio=res.mamba_full_memory_ratio,
        mamba_ssm_dtype=a.get("mamba_ssm_dtype"),
        mamba_ratio=res.mamba_ratio,
        disable_radix_cache=bool(a.get("disable_radix_cache")),
        page_size=a["page_size"],
        max_total_tokens=a.get("max_total_tokens"),
        context_len=res.context_len,
        cuda_graph_enabled=res.decode_graph,
    )
    return res, memory.plan(inp), inp


@pytest.mark.parametrize(
    ("version", "gpus", "expected"),
    [
        ("0.5.9", H200, 0.907),
        ("0.5.14", H200, 0.903),
        ("0.5.18", H200, 0.903),
        ("0.5.23", H200, 0.903),
        ("0.5.9", B200, 0.857),
        ("0.5.23", B200, 0.854),
        ("0.5.9", RTX, 0.863),
        ("0.5.23", RTX, 0.858),
    ],
)
def test_auto_mem_fraction_static(version, gpus, expected):
    _, _, res = setup(version, gpus, [])
    assert res.args["mem_fraction_static"] == expected


def test_auto_chunked_prefill_and_decode_bs():
    _, _, res = setup("0.5.23", B200, [])
    assert res.args["chunked_prefill_size"] == 16384 and res.args["cuda_graph_max_bs_decode"] == 512
    _, _, res = setup("0.5.9", H200, ["--tp-size", "4"])
    assert res.args["chunked_prefill_size"] == 8192 and res.args["cuda_graph_max_bs"] == 512
    small = {"name": "NVIDIA GeForce RTX 4090", "memory_total_mib": 24564}
    _, _, res = setup("0.5.18", small, [])
    assert res.args["chunked_prefill_size"] == 2048 and res.args["cuda_graph_max_bs_decode"] == 24
    _, _, res = setup("0.5.23", small, [])
    assert res.args["chunked_prefill_size"] == 4096 and res.args["cuda_graph_max_bs_decode"] == 48


def test_min_memory_total_over_all_gpus_drives_defaults():
    gpus = {**H200, "devices": [{"index": 3, "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559}]}
    _, _, res = setup("0.5.23", gpus, [])
    assert res.gpu_capacity_mib == 81559


def test_spec_defaults_v9_and_v23():
    _, _, res = setup("0.5.9", H200, SPEC)
    a = res.args
    assert a["speculative_algorithm"] == "EAGLE"
    assert a["max_running_requests"] == 48
    assert a["disable_overlap_schedule"] is True
    assert a["mem_fraction_static"] == round((143771 - 13440 - 2048) / 143771, 3)
    assert (
        "warning",
        "Max running requests is reset to 48 for speculative decoding. You can override this by "
        "explicitly setting --max-running-requests.",
    ) in res.messages
    _, _, res = setup(
        "0.5.23",
        H200,
        [
            "--speculative-algorithm",
            "EAGLE",
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "6",
        ],
    )
    assert res.args["speculative_num_draft_tokens"] == 4
    assert res.args["disable_overlap_schedule"] is False
    _, _, res = setup("0.5.23", H200, ["--speculative-algorithm", "EAGLE"])
    assert (
        res.args["speculative_num_steps"],
        res.args["speculative_eagle_topk"],
        res.args["speculative_num_draft_tokens"],
    ) == (3, 1, 4)


def test_served_model_name_and_seed_defaults():
    _, _, res = setup("0.5.23", H200, [])
    assert res.args["served_model_name"] == "m"
    assert isinstance(res.args["random_seed"], int)


def test_qwen36_mtp_b200_mamba_80_gives_16():
    res, p, _ = plan(
        "0.5.23", B200, [*SPEC, "--max-mamba-cache-size", "80", "--mamba-full-memory-ratio", "0.4"], "qwen3.6-27b"
    )
    assert res.mamba_strategy == "extra_buffer" and res.mamba_ratio == 5
    assert p.mamba_k == 80
    assert p.max_running == 16
    assert any("capped to 16 by the mamba state cache (max_mamba_cache_size=80, 5 state slots" in w for w in p.warnings)


def test_qwen36_mtp_b200_mamba_200_gives_40():
    _, p, _ = plan(
        "0.5.23",
        B200,
        [
            *SPEC,
            "--max-mamba-cache-size",
            "200",
            "--mamba-full-memory-ratio",
            "0.6",
            "--mem-fraction-static",
            "0.93",
            "--max-running-requests",
            "64",
        ],
        "qwen3.6-27b",
    )
    assert p.max_running == 40
    assert p.kv_tokens > 80


def test_v9_mtp_draft_loads_after_the_target_pools():
    # 0.5.9 builds the target's worker, pools and CUDA graphs included, before the draft's
    # (managers/scheduler.py:563-565; facts/0.5.9.json scheduler_start): the target's pool is sized
    # from its own weights and layers (model_runner_kv_cache_mixin.py:124-141), and the draft then
    # loads into what is left, with a one-layer pool of the same #tokens (:402-403). The figures are
    # the golden journal's (tests/unit/fixtures/journals/0.5.9-qwen3.6-27b-mtp.yml).
    argv = [*SPEC, "--max-mamba-cache-size", "80", "--mamba-full-memory-ratio", "0.4"]
    argv += ["--mem-fraction-static", "0.857", "--max-running-requests", "48"]
    _, p, inp = plan("0.5.9", B200, argv, "qwen3.6-27b")
    assert round(p.weights_gib, 2) == 51.80
    assert p.kv_tokens == 498658 and round(p.k_gib, 2) == 15.22
    assert memory.draft_after_target_pools(inp)
    assert round(p.late_draft_weights_gib, 2) == 0.85 and round(p.late_draft_k_gib, 2) == 0.95
    assert round(p.avail_after_graph_gib(), 2) == 23.26
    assert round(p.avail_after_graph_gib() - p.late_draft_weights_gib, 2) == 22.41
    assert p.final_mib == p.context_mib + p.weights_mib + p.pools_mib + p.graph_mib + p.late_draft_mib
    # 0.5.14+ load the draft first: its weights before the pools, its layer in each token's cell.
    _, p14, inp14 = plan("0.5.14", B200, argv, "qwen3.6-27b")
    assert not memory.draft_after_target_pools(inp14)
    assert round(p14.weights_gib, 2) == 52.65 and p14.late_draft_mib == 0


def test_qwen36_slot_size():
    _, prof, _ = setup("0.5.23", B200, [], "qwen3.6-27b")
    conv, ssm = prof.mamba_per_req_bytes(None)
    assert abs((conv + ssm) / 2**30 - 0.26) < 0.005
    _, ssm_b = prof.mamba_per_req_bytes("bfloat16")
    assert ssm_b == ssm // 2


def test_v14_blames_kv_cache_and_v9_disables_radix():
    _, p, _ = plan("0.5.14", B200, [*SPEC, "--max-mamba-cache-size", "80"], "qwen3.6-27b")
    assert p.max_running == 16
    assert p.warnings == [
        "max_running_requests was reduced from the requested 48 to 16 (per dp worker) due to the "
        "available KV cache capacity."
    ]
    res, p, _ = plan("0.5.9", B200, SPEC, "qwen3.6-27b")
    assert res.args["disable_radix_cache"] is True and res.mamba_ratio == 1
    assert p.mamba_k == 48 and p.max_running == 48


def test_reference_illustration_auto_k():
    """rest = 60 GiB, per_req = 0.1 GiB, r = 0.9, D = 4 (reference 6.3 table)."""
    prof = ModelProfile(
        name="x",
        architectures=["X"],
        model_type="x",
        weights_gib=0,
        num_layers=4,
        full_attention_layers=1,
        num_kv_heads=1,
        head_dim=64,
        context_length=4096,
        mamba_ssm_state_bytes=int(0.1 * 2**30),
        context_mib=0,
    )
    total = 100 * 1024

    # mem_fraction 0.6 on 100 GiB with nothing loaded leaves rest = 100 - 40 = 60 GiB.
    def k(version: str, spec: bool, ratio: int, mrr=None) -> tuple[int, int]:
        inp = memory.MemoryInputs(
            version=Version.of(version),
            profile=prof,
            total_mib=total,
            others_mib=0,
            gpu_index=0,
            mem_fraction_static=0.6,
            spec=spec,
            draft_tokens=4 if spec else 0,
            max_running_requests=mrr,
            mamba_ratio=ratio,
            context_len=4096,
        )
        p = memory.plan(inp)
        return p.mamba_k, p.max_running

    assert k("0.5.9", False, 3)[0] == 284
    assert k("0.5.18", False, 5) == (283, 56)
    assert k("0.5.18", True, 5, 48) == (155, 31)
    assert k("0.5.23", True, 4, 48) == (139, 34)


def test_dense_effective_max_running():
    _, p, _ = plan("0.5.23", H200, [])
    assert p.max_running == 4096
    _, p, _ = plan("0.5.23", H200, ["--max-running-requests", "64"])
    assert p.max_running == 64
    _, p, _ = plan("0.5.23", H200, ["--max-running-requests", "64", "--max-total-tokens", "100"])
    assert p.kv_tokens == 100 and p.max_running == 50


def test_memory_used_tracks_mem_fraction_static():
    _, p1, _ = plan("0.5.23", H200, ["--mem-fraction-static", "0.8"])
    _, p2, _ = plan("0.5.23", H200, ["--mem-fraction-static", "0.6"])
    assert abs(p1.final_mib - (143771 * 0.8 + 1600)) < 50
    assert abs(p2.final_mib - (143771 * 0.6 + 1600)) < 50


def test_other_holders_shrink_the_kv_pool_and_can_oom():
    _, alone, _ = plan("0.5.23", H200, [])
    _, shared, _ = plan("0.5.23", H200, [], others=40000)
    assert shared.kv_tokens < alone.kv_tokens
    with pytest.raises(memory.StartupError) as exc:
        plan("0.5.23", H200, [], others=130000)
    assert exc.value.exc_type == "torch.OutOfMemoryError"
    with pytest.raises(memory.StartupError) as exc:
        plan("0.5.23", H200, [], others=120000)
    assert "Loaded weights leave no GPU memory for the KV cache" in exc.value.message
    with pytest.raises(memory.StartupError) as exc:
        plan("0.5.9", H200, [], others=120000)
    assert exc.value.message == "Not enough memory. Please try to increase --mem-fraction-static."


def test_headroom_oom_rule():
    _, p, inp = plan("0.5.23", H200, ["--mem-fraction-static", "0.96"])
    assert memory.check_headroom(inp, p) is None
    _, p, inp = plan("0.5.23", H200, ["--mem-fraction-static", "0.97"])
    err = memory.check_headroom(inp, p)
    assert err is not None and "CUDA out of memory" in err.message
