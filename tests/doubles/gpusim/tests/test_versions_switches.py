"""Version switches: the captured releases, and each behaviour change dated at its release.

Dates from the reference: section 1 (parser), 2.3 (shutdown), 3 (HTTP), 5 (log lines), 6 (memory).
"""

from __future__ import annotations

import pytest

from gpusim import cli_parser, resolve
from gpusim.config import Config
from gpusim.versions import KNOWN_VERSIONS, Version

SMALL = {"name": "NVIDIA GeForce RTX 4090", "memory_total_mib": 24564}
H200 = {"name": "NVIDIA H200", "memory_total_mib": 143771}


def test_known_versions_are_the_dumped_releases():
    assert KNOWN_VERSIONS == (
        (0, 5, 9),
        (0, 5, 14),
        (0, 5, 18),
        (0, 5, 19),
        (0, 5, 20),
        (0, 5, 21),
        (0, 5, 22),
        (0, 5, 23),
    )


@pytest.mark.parametrize(
    ("version", "table", "family"),
    [
        ("0.5.9", "0.5.9", 9),
        ("0.5.13", "0.5.9", 9),
        ("0.5.14", "0.5.14", 14),
        ("0.5.17", "0.5.14", 14),
        ("0.5.18", "0.5.18", 18),
        ("0.5.19", "0.5.19", 19),
        ("0.5.20", "0.5.20", 20),
        ("0.5.21", "0.5.21", 21),
        ("0.5.22", "0.5.22", 22),
        ("0.5.23", "0.5.23", 23),
        ("0.5.24", "0.5.23", 23),
    ],
)
def test_flag_table_is_the_nearest_lower_captured_release(version, table, family):
    v = Version.of(version)
    assert (v.flags_table, v.family) == (table, family)


# property -> the first release where it holds (all later releases too).
FIRST_RELEASE = {
    "prog_is_sglang_serve": 10,
    "entrypoint_warning": 10,
    "subprocess_watchdog": 10,
    "shutdown_req": 14,
    "exit_zero_after_drain": 19,
    "straggler_warning": 20,
    "ready_endpoint": 20,
    "kill_tree_log": 13,
    "mem_v14": 14,
    "small_gpu_v20": 20,
    "decode_bs_capped_by_mrr": 22,
    "mamba_ratio_default_none": 20,
    "mamba_cap_warning": 18,
    "accept_rate_v11": 11,
    "meta_reasoning_tokens": 14,
    "model_info_v18": 18,
    "server_info_startup_time": 18,
    "memory_usage_v18": 18,
    "tokenizer_metric_engine_type": 14,
    "metric_is_streaming": 18,
    "metrics_startup_constants": 14,
    "flush_cache_v23": 23,
}


@pytest.mark.parametrize("patch", range(9, 25))
@pytest.mark.parametrize(("switch", "first"), sorted(FIRST_RELEASE.items()))
def test_switches_turn_on_at_their_release(switch, first, patch):
    assert getattr(Version((0, 5, patch)), switch) is (patch >= first)


@pytest.mark.parametrize("patch", range(9, 25))
def test_valued_switches(patch):
    v = Version((0, 5, patch))
    assert v.kill_tree_wait_timeout == (60 if patch >= 19 else None)
    assert v.mamba_family == (9 if patch < 14 else 14 if patch < 18 else 18)
    assert v.prefill_layout == (9 if patch < 10 else 10 if patch < 11 else 11 if patch < 21 else 21)
    assert v.retractions_key == ("num_retractions" if patch >= 12 else "total_retractions")


def _resolve(version: str, gpus: dict, argv: list[str]) -> tuple[dict, resolve.Resolved]:
    cfg = Config({"sglang_version": version, "gpus": gpus, "model": {"profile": "qwen3-8b"}})
    raw = cli_parser.parse_args(["--model-path", "m", *argv], cfg.version)
    return raw, resolve.resolve(dict(raw), cfg.version, cfg, cfg.profile_for("m"))


@pytest.mark.parametrize(
    ("version", "parsed"),
    [("0.5.18", 0.9), ("0.5.19", 0.9), ("0.5.20", None), ("0.5.21", None), ("0.5.22", None), ("0.5.23", None)],
)
def test_mamba_full_memory_ratio_default_is_none_from_0_5_20(version, parsed):
    raw, res = _resolve(version, H200, [])
    assert raw["mamba_full_memory_ratio"] == parsed
    assert res.mamba_full_memory_ratio == 0.9


@pytest.mark.parametrize(
    ("version", "chunked", "decode_bs", "capped_bs"),
    [
        ("0.5.18", 2048, 24, 256),
        ("0.5.19", 2048, 24, 256),
        ("0.5.20", 4096, 48, 256),
        ("0.5.21", 4096, 48, 256),
        ("0.5.22", 4096, 48, 16),
        ("0.5.23", 4096, 48, 16),
    ],
)
def test_auto_sizes_of_the_releases_in_between(version, chunked, decode_bs, capped_bs):
    _, res = _resolve(version, SMALL, [])
    assert (res.args["chunked_prefill_size"], res.args["cuda_graph_max_bs_decode"]) == (chunked, decode_bs)
    _, res = _resolve(version, H200, ["--max-running-requests", "16"])
    assert res.args["cuda_graph_max_bs_decode"] == capped_bs
