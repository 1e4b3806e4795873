"""Settings for one SGLang version: names, values, checks, rendering and /server_info expectations
(_flags.names, _flags.values, _flags.checks, _instances.render)."""

from __future__ import annotations

from typing import Any

import pytest

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.checks import ServerArgsError, validate_args
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.table import load_table
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.values import parse_human_readable_int
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.render import (
    expected_server_info,
    render_cli_args,
)

VERSIONS = ("0.5.9", "0.5.14", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
NEW = ("0.5.19", "0.5.20", "0.5.21", "0.5.22")


def problems_of(exc: pytest.ExceptionInfo[ServerArgsError]) -> list[str]:
    return exc.value.problems


# --------------------------------------------------------------------------------------------------
# Renamed and removed flags of the reference (sglang.md section 1.2), on every version.

# (settings, version) -> expected words, or an exception pattern.
RENAMES: list[tuple[dict[str, Any], dict[str, list[str]]]] = [
    (
        {"mamba_scheduler_strategy": "no_buffer"},
        {
            v: ["--mamba-scheduler-strategy" if v == "0.5.9" else "--mamba-radix-cache-strategy", "no_buffer"]
            for v in VERSIONS
        },
    ),
    (
        {"mamba_radix_cache_strategy": "extra_buffer"},
        {
            v: ["--mamba-scheduler-strategy" if v == "0.5.9" else "--mamba-radix-cache-strategy", "extra_buffer"]
            for v in VERSIONS
        },
    ),
    (
        {"cuda_graph_max_bs": 16},
        {v: ["--cuda-graph-max-bs" if v == "0.5.9" else "--cuda-graph-max-bs-decode", "16"] for v in VERSIONS},
    ),
    (
        {"cuda_graph_max_bs_decode": 16},
        {v: ["--cuda-graph-max-bs", "16"] if v == "0.5.9" else ["--cuda-graph-max-bs-decode", "16"] for v in VERSIONS},
    ),
    (
        {"piecewise_cuda_graph_max_tokens": 4096},
        {
            v: ["--piecewise-cuda-graph-max-tokens" if v == "0.5.9" else "--cuda-graph-max-bs-prefill", "4096"]
            for v in VERSIONS
        },
    ),
    (
        {"cuda_graph_bs": [1, 2, 4]},
        {v: ["--cuda-graph-bs" if v == "0.5.9" else "--cuda-graph-bs-decode", "1", "2", "4"] for v in VERSIONS},
    ),
    (
        {"stream_output": True},
        {v: ["--stream-output" if v == "0.5.9" else "--incremental-streaming-output"] for v in VERSIONS},
    ),
    (
        {"tp_size": 2},
        {v: ["--tensor-parallel-size" if v == "0.5.9" else "--tp-size", "2"] for v in VERSIONS},
    ),
    (
        {"tensor_parallel_size": 2},
        {v: ["--tensor-parallel-size" if v == "0.5.9" else "--tp-size", "2"] for v in VERSIONS},
    ),
    (
        {"dp_size": 2},
        {v: ["--data-parallel-size" if v == "0.5.9" else "--dp-size", "2"] for v in VERSIONS},
    ),
]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("args", "expected"), RENAMES, ids=lambda x: ",".join(x) if isinstance(x, dict) else None)
def test_renamed_flags_render_in_the_spelling_each_version_accepts(
    args: dict[str, Any], expected: dict[str, list[str]], version: str
) -> None:
    words, warnings = render_cli_args(args, version), validate_args(args, version)[1]
    assert words == expected[version]
    assert warnings == []


@pytest.mark.parametrize("version", VERSIONS)
def test_every_rename_group_renders_without_deprecated_spellings(version: str) -> None:
    """Data-driven: each name of each rename group, on each version, either renders a current spelling or
    fails with a message; never a deprecated alias, never an abbreviation."""
    table = load_table()
    flags = table.flags(version)
    current = {s for f in flags.values() if not f.deprecated for s in f.spellings}
    deprecated = {s for f in flags.values() for s in f.deprecated_aliases}
    for group in table._groups.values():
        for name in sorted(group):
            setting = next((m for m in sorted(group) if m in flags and not flags[m].deprecated), None)
            flag = flags.get(setting) if setting else None
            if flag is None:
                # No current name: either a deprecated switch with a replacement, or an error naming the key.
                try:
                    words = render_cli_args({name: _sample(flags.get(name) or _any_flag(name))}, version)
                except ServerArgsError as exc:
                    assert f"'{name}'" in str(exc)
                    continue
                assert name in load_table().value_maps, (name, words)
            else:
                words = render_cli_args({name: _sample(flag)}, version)
            options = [w.split("=")[0] for w in words if w.startswith("--")]
            assert options, (name, words)
            assert all(o in current and o not in deprecated for o in options), (name, words)


def _any_flag(name: str) -> Any:
    table = load_table()
    for version in reversed(table.versions):
        for member in table.rename_group(name):
            if member in table.flags(version):
                return table.flags(version)[member]
    raise AssertionError(name)


def _sample(flag: Any) -> Any:
    if flag.kind in ("switch", "boolopt", "optional"):
        return True
    if flag.choices:
        value = flag.choices[0]
    else:
        value = {"int": 3, "float": 0.5, "human_readable_int": 4096, "loads": {"a": 1}, "json_list_type": [1]}.get(
            flag.type or "str", "x"
        )
    return [value] if flag.kind == "list" else value


REMOVED: list[tuple[dict[str, Any], dict[str, list[str] | str]]] = [
    (
        {"enable_piecewise_cuda_graph": True},
        {
            "0.5.9": ["--enable-piecewise-cuda-graph"],
            **{v: "piecewise CUDA graph is the default since SGLang 0.5.10" for v in VERSIONS[1:]},
        },
    ),
    (
        {"disable_piecewise_cuda_graph": True},
        {
            "0.5.9": "before 0.5.10 piecewise CUDA graph only runs when enable_piecewise_cuda_graph is set",
            **{v: ["--cuda-graph-backend-prefill", "disabled"] for v in VERSIONS[1:]},
        },
    ),
    (
        {"enforce_piecewise_cuda_graph": True},
        {
            "0.5.9": "before 0.5.10 use enable_piecewise_cuda_graph",
            **{v: ["--cuda-graph-backend-prefill", "tc_piecewise"] for v in ("0.5.14", "0.5.18", "0.5.19")},
            # Removed in 0.5.20, but its replacement still works until 0.5.22 refuses tc_piecewise.
            "0.5.20": ["--cuda-graph-backend-prefill", "tc_piecewise"],
            "0.5.21": ["--cuda-graph-backend-prefill", "tc_piecewise"],
            "0.5.22": "'tc_piecewise' is refused by --cuda-graph-backend-prefill on SGLang 0.5.22, whose parser "
            "answers 'tc_piecewise was removed; select breakable, full, or disabled'",
            "0.5.23": "'tc_piecewise' is refused by --cuda-graph-backend-prefill on SGLang 0.5.23",
        },
    ),
    (
        {"enable_breakable_cuda_graph": True},
        {
            "0.5.9": "not available there either",
            **{v: ["--cuda-graph-backend-prefill", "breakable"] for v in VERSIONS[1:]},
        },
    ),
    (
        {"disable_cuda_graph": True},
        {
            "0.5.9": ["--disable-cuda-graph"],
            **{
                v: ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
                for v in VERSIONS[1:]
            },
        },
    ),
    (
        {"piecewise_cuda_graph_compiler": "eager"},
        {
            "0.5.9": ["--piecewise-cuda-graph-compiler", "eager"],
            **{v: ["--cuda-graph-tc-compiler", "eager"] for v in ("0.5.14", "0.5.18", "0.5.19", "0.5.20", "0.5.21")},
            "0.5.22": "it was removed after SGLang 0.5.21",
            "0.5.23": "it was removed after SGLang 0.5.21",
        },
    ),
    (
        {"enable_prefill_context_parallel": True},
        {
            "0.5.9": "it is only accepted from SGLang 0.5.14 on",
            **{v: ["--enable-prefill-cp"] for v in VERSIONS[1:]},
        },
    ),
    (
        {"dsa_prefill_cp_mode": "in-seq-split"},
        {
            "0.5.9": ["--nsa-prefill-cp-mode", "in-seq-split"],
            **{v: "set cp_strategy instead" for v in ("0.5.14", "0.5.18", "0.5.19")},
            **{v: "its replacement is cp_strategy" for v in ("0.5.20", "0.5.21", "0.5.22", "0.5.23")},
        },
    ),
    (
        {"hybrid_kvcache_ratio": True},
        {
            "0.5.9": "its parser rejects it",
            **{v: "it was removed after SGLang 0.5.9" for v in VERSIONS[1:]},
        },
    ),
]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("args", "expected"), REMOVED, ids=lambda x: ",".join(x) if isinstance(x, dict) else None)
def test_removed_and_deprecated_flags_map_or_fail_with_the_fix(
    args: dict[str, Any], expected: dict[str, list[str] | str], version: str
) -> None:
    outcome = expected[version]
    if isinstance(outcome, str):
        with pytest.raises(ServerArgsError) as exc:
            render_cli_args(args, version)
        assert outcome in str(exc.value)
        assert next(iter(args)) in str(exc.value)
        return
    assert render_cli_args(args, version) == outcome
    _normalized, warnings = validate_args(args, version)
    key = next(iter(args))
    flag = load_table().flag(version, key)
    if key in load_table().value_maps and (flag is None or flag.deprecated):
        assert len(warnings) == 1 and key in warnings[0] and "instead" in warnings[0]
    else:
        assert warnings == []  # a plain rename is silent


def test_value_map_on_a_deprecated_switch_names_the_version_and_the_replacement() -> None:
    _args, warnings = validate_args({"disable_piecewise_cuda_graph": True}, "0.5.18", where="sglang_server_args")
    assert warnings == [
        "sglang_server_args.disable_piecewise_cuda_graph: 'disable_piecewise_cuda_graph' is deprecated in SGLang "
        "0.5.18; passing cuda_graph_backend_prefill: disabled instead (set that in place of the old key to "
        "silence this warning)"
    ]


def test_value_map_false_is_simply_omitted() -> None:
    assert render_cli_args({"disable_cuda_graph": False}, "0.5.23") == []


def test_value_map_contradicting_an_explicit_setting_is_an_error() -> None:
    with pytest.raises(ServerArgsError, match="contradicts"):
        validate_args({"disable_piecewise_cuda_graph": True, "cuda_graph_backend_prefill": "full"}, "0.5.23")
    args, _unused = validate_args(
        {"disable_piecewise_cuda_graph": True, "cuda_graph_backend_prefill": "disabled"}, "0.5.23"
    )
    assert args == {"cuda_graph_backend_prefill": "disabled"}


def test_dp_attention_on_0_5_23_uses_the_dp_size_placeholder() -> None:
    args, warnings = validate_args({"enable_dp_attention": True, "dp_size": 4}, "0.5.23")
    assert args == {"attn_dp_size": 4, "dp_size": 4}
    assert "attn_dp_size: 4" in warnings[0]
    with pytest.raises(ServerArgsError, match=r"set attn_dp_size \(set to your dp_size\) instead"):
        validate_args({"enable_dp_attention": True}, "0.5.23")
    assert render_cli_args({"enable_dp_attention": True}, "0.5.18") == ["--enable-dp-attention"]


# --------------------------------------------------------------------------------------------------
# Rendering of kinds and values


def test_booleans() -> None:
    assert render_cli_args({"trust_remote_code": True}, "0.5.23") == ["--trust-remote-code"]
    assert render_cli_args({"trust_remote_code": False}, "0.5.23") == []
    assert render_cli_args({"lora_strict_loading": True}, "0.5.23") == ["--lora-strict-loading"]
    assert render_cli_args({"lora_strict_loading": False}, "0.5.23") == ["--no-lora-strict-loading"]
    assert render_cli_args({"model_checksum": True}, "0.5.23") == ["--model-checksum"]
    assert render_cli_args({"model_checksum": "abc"}, "0.5.23") == ["--model-checksum", "abc"]
    assert render_cli_args({"model_checksum": False}, "0.5.23") == []


def test_none_omits_the_flag() -> None:
    assert render_cli_args({"max_running_requests": None, "trust_remote_code": None}, "0.5.23") == []
    assert render_cli_args({}, "0.5.23") == []
    assert render_cli_args(None, "0.5.23") == []


def test_lists_become_several_words() -> None:
    assert render_cli_args({"cuda_graph_bs_decode": [1, 2, 8]}, "0.5.23") == ["--cuda-graph-bs-decode", "1", "2", "8"]
    assert render_cli_args({"cuda_graph_bs_decode": 8}, "0.5.23") == ["--cuda-graph-bs-decode", "8"]
    assert render_cli_args({"bucket_time_to_first_token": [0.1, 1]}, "0.5.9") == [
        "--bucket-time-to-first-token",
        "0.1",
        "1",
    ]
    assert render_cli_args({"lora_target_modules": ["q_proj", "v_proj"]}, "0.5.9") == [
        "--lora-target-modules",
        "q_proj",
        "v_proj",
    ]
    assert render_cli_args({"custom_weight_loader": []}, "0.5.23") == ["--custom-weight-loader"]


def test_json_values_are_compact_and_key_sorted() -> None:
    assert render_cli_args({"preferred_sampling_params": {"top_p": 0.9, "temperature": 0.6}}, "0.5.23") == [
        "--preferred-sampling-params",
        '{"temperature":0.6,"top_p":0.9}',
    ]
    assert render_cli_args({"preferred_sampling_params": '{"b": 1, "a": [1, 2]}'}, "0.5.23") == [
        "--preferred-sampling-params",
        '{"a":[1,2],"b":1}',
    ]
    assert render_cli_args({"forward_hooks": [{"name": "x"}]}, "0.5.23") == ["--forward-hooks", '[{"name":"x"}]']
    # A text flag that takes JSON accepts a mapping.
    assert render_cli_args({"json_model_override_args": {"rope_scaling": {"factor": 4}}}, "0.5.9") == [
        "--json-model-override-args",
        '{"rope_scaling":{"factor":4}}',
    ]


def test_order_is_sorted_by_setting_name_whatever_the_input_order() -> None:
    args = {"tp_size": 1, "context_length": 8192, "max_running_requests": 8, "enable_metrics": True}
    words = render_cli_args(args, "0.5.23")
    assert words == [
        "--context-length",
        "8192",
        "--enable-metrics",
        "--max-running-requests",
        "8",
        "--tp-size",
        "1",
    ]
    assert render_cli_args(dict(reversed(list(args.items()))), "0.5.23") == words


def test_values_that_look_like_options_use_the_equals_form() -> None:
    assert render_cli_args({"chunked_prefill_size": -1}, "0.5.23") == ["--chunked-prefill-size", "-1"]
    assert render_cli_args({"served_model_name": "--weird"}, "0.5.23") == ["--served-model-name=--weird"]
    assert render_cli_args({"schedule_conservativeness": -1e-05}, "0.5.23") == ["--schedule-conservativeness=-1e-05"]


def test_human_readable_ints_are_normalised() -> None:
    assert parse_human_readable_int("200k") == 200_000
    assert parse_human_readable_int("32Ki") == 32768
    assert parse_human_readable_int("1.5M") == 1_500_000
    with pytest.raises(ValueError, match="decimals are not allowed"):
        parse_human_readable_int("1.5Ki")
    with pytest.raises(ValueError, match="case-sensitive"):
        parse_human_readable_int("128K")
    assert render_cli_args({"context_length": "32Ki"}, "0.5.23") == ["--context-length", "32768"]
    assert validate_args({"context_length": "200k"}, "0.5.14")[0] == {"context_length": 200000}


def test_numeric_strings_are_read_as_numbers() -> None:
    assert validate_args({"max_running_requests": "64", "mem_fraction_static": "0.9"}, "0.5.23")[0] == {
        "max_running_requests": 64,
        "mem_fraction_static": 0.9,
    }
    assert render_cli_args({"mem_fraction_static": 1}, "0.5.23") == ["--mem-fraction-static", "1"]


def test_unknown_version_lists_the_supported_ones() -> None:
    with pytest.raises(ServerArgsError) as exc:
        render_cli_args({}, "0.5.11")
    assert str(exc.value).endswith(f"supported: {', '.join(VERSIONS)}")


# --------------------------------------------------------------------------------------------------
# Validation errors


def test_unknown_key_suggests_the_closest_name() -> None:
    with pytest.raises(ServerArgsError) as exc:
        validate_args({"max_mamba_cache_sze": 100}, "0.5.23", where="sglang_server_instances[2].args")
    assert problems_of(exc) == [
        "sglang_server_instances[2].args.max_mamba_cache_sze: SGLang 0.5.23 has no setting 'max_mamba_cache_sze'; "
        "did you mean max_mamba_cache_size?"
    ]


def test_unknown_key_suggests_names_from_other_versions_too() -> None:
    with pytest.raises(ServerArgsError, match="did you mean mamba_scheduler_strategy"):
        validate_args({"mamba_scheduler_stategy": "auto"}, "0.5.23")


def test_unknown_key_without_a_close_name_points_at_the_escape_hatch() -> None:
    with pytest.raises(ServerArgsError, match="sglang_server_args_unchecked"):
        validate_args({"zzzz": 1}, "0.5.23")


def test_removed_key_names_its_history_and_replacement() -> None:
    with pytest.raises(ServerArgsError) as exc:
        validate_args({"enable_piecewise_cuda_graph": True}, "0.5.23", where="sglang_server_args")
    assert problems_of(exc) == [
        "sglang_server_args.enable_piecewise_cuda_graph: 'enable_piecewise_cuda_graph' is not accepted by SGLang "
        "0.5.23: it was removed after SGLang 0.5.9; piecewise CUDA graph is the default since SGLang 0.5.10; "
        "remove the key (cuda_graph_backend_prefill chooses or disables the prefill graph backend)"
    ]


def test_not_yet_added_key() -> None:
    with pytest.raises(ServerArgsError, match=r"only accepted from SGLang 0\.5\.14 on"):
        validate_args({"cuda_graph_backend_prefill": "full"}, "0.5.9")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"max_running_requests": "abc"},
            "--max-running-requests on SGLang 0.5.23 expects an integer, got the string 'abc'",
        ),
        ({"max_running_requests": 1.5}, "expects an integer, got the number 1.5"),
        ({"max_running_requests": True}, "expects an integer, got the boolean true"),
        ({"mem_fraction_static": "high"}, "expects a number, got the string 'high'"),
        ({"mem_fraction_static": float("nan")}, "expects a finite number"),
        (
            {"trust_remote_code": "true"},
            "is a switch and expects true or false, got the string 'true' (write true or false without quotes",
        ),
        ({"trust_remote_code": 1}, "is a switch and expects true or false, got the integer 1"),
        ({"log_level": False}, "expects a string, got the boolean false (YAML reads unquoted"),
        ({"context_length": "128K"}, "suffixes are case-sensitive"),
        ({"context_length": "1.5Ki"}, "decimals are not allowed with IEC suffixes"),
        ({"preferred_sampling_params": "{not json"}, "the string is not JSON"),
        ({"forward_hooks": {"a": 1}}, "expects a list (or a JSON string holding one), got a mapping"),
        ({"max_running_requests": [1, 2]}, "takes one value, got a list"),
        ({"cuda_graph_bs_decode": []}, "expects at least one value"),
        ({"cuda_graph_bs_decode": ["x"]}, "each list item expects an integer"),
    ],
)
def test_wrong_types_name_the_expected_type(args: dict[str, Any], message: str) -> None:
    with pytest.raises(ServerArgsError) as exc:
        validate_args(args, "0.5.23")
    assert message in str(exc.value)


def test_human_readable_string_on_an_int_flag_of_0_5_9() -> None:
    with pytest.raises(ServerArgsError, match=r"sizes such as 200k are only accepted .* from SGLang 0.5.10 on"):
        validate_args({"context_length": "200k"}, "0.5.9")


@pytest.mark.parametrize(
    ("args", "version", "message"),
    [
        (
            {"mamba_radix_cache_strategy": "extra_buffer_lazy"},
            "0.5.9",
            "'extra_buffer_lazy' is not a valid choice for --mamba-scheduler-strategy on SGLang 0.5.9; "
            "choose one of: auto, no_buffer, extra_buffer ('extra_buffer_lazy' is accepted by SGLang 0.5.14, 0.5.18, "
            "0.5.19, 0.5.20, 0.5.21, 0.5.22, 0.5.23)",
        ),
        (
            {"kv_cache_dtype": "fp4_e2m1"},
            "0.5.23",
            "'fp4_e2m1' is accepted by SGLang 0.5.9, 0.5.14, 0.5.18, 0.5.19, 0.5.20)",
        ),
        ({"attention_backend": "cutlass_mla"}, "0.5.23", "not a valid choice for --attention-backend on SGLang 0.5.23"),
        ({"schedule_policy": "hrrn"}, "0.5.18", "'hrrn' is accepted by SGLang 0.5.20, 0.5.21, 0.5.22, 0.5.23)"),
        ({"speculative_algorithm": "MEDUSA"}, "0.5.9", "choose one of: EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM"),
        ({"lora_target_modules": ["q_proj", "qkvr"]}, "0.5.9", "'qkvr' is not a valid choice"),
        ({"log_requests_level": 7}, "0.5.23", "choose one of: 0, 1, 2, 3"),
    ],
)
def test_invalid_choices_list_the_allowed_ones(args: dict[str, Any], version: str, message: str) -> None:
    with pytest.raises(ServerArgsError) as exc:
        validate_args(args, version)
    assert message in str(exc.value)


def test_speculative_algorithm_has_no_parse_time_choices_after_0_5_11() -> None:
    assert render_cli_args({"speculative_algorithm": "NEXTN"}, "0.5.23") == ["--speculative-algorithm", "NEXTN"]
    assert render_cli_args({"speculative_algorithm": "NEXTN"}, "0.5.9") == ["--speculative-algorithm", "NEXTN"]


def test_all_problems_are_collected_into_one_error() -> None:
    with pytest.raises(ServerArgsError) as exc:
        validate_args(
            {"max_mamba_cache_sze": 1, "trust_remote_code": "yes", "kv_cache_dtype": "fp4_e2m1", "port": "x"},
            "0.5.23",
            where="sglang_server_host_args",
        )
    assert len(problems_of(exc)) == 4
    text = str(exc.value)
    assert text.startswith("SGLang server settings: 4 problems\n- sglang_server_host_args.")
    for key in ("max_mamba_cache_sze", "trust_remote_code", "kv_cache_dtype", "port"):
        assert f"sglang_server_host_args.{key}:" in text


def test_one_setting_under_two_names_with_different_values() -> None:
    with pytest.raises(ServerArgsError, match="both set mamba_radix_cache_strategy"):
        validate_args({"mamba_scheduler_strategy": "no_buffer", "mamba_radix_cache_strategy": "auto"}, "0.5.23")
    args, _unused = validate_args({"mamba_scheduler_strategy": "auto", "mamba_radix_cache_strategy": "auto"}, "0.5.23")
    assert args == {"mamba_radix_cache_strategy": "auto"}


def test_non_mapping_args() -> None:
    with pytest.raises(ServerArgsError, match="expected a mapping"):
        validate_args(["max_running_requests"], "0.5.23")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# /server_info expectations


def test_expected_server_info_normalises_values() -> None:
    args = {
        "context_length": "32Ki",
        "mamba_scheduler_strategy": "auto",
        "speculative_algorithm": "NEXTN",
        "trust_remote_code": True,
        "model_checksum": True,
        "json_model_override_args": {"b": 1, "a": 2},
        "lora_paths": ["a=/x"],
    }
    assert expected_server_info(args, "0.5.23") == {
        "context_length": 32768,
        "speculative_algorithm": "NEXTN",
        "trust_remote_code": True,
        "model_checksum": "",
        "json_model_override_args": '{"a":2,"b":1}',
    }
    v9 = expected_server_info({"speculative_algorithm": "NEXTN", "tp_size": 2}, "0.5.9")
    assert v9 == {"speculative_algorithm": "EAGLE", "tp_size": 2}


# --------------------------------------------------------------------------------------------------
# 0.5.19-0.5.22: what each release's parser accepts and refuses (its own argparse dump).
# (setting, value, the supported releases that accept it, how the others refuse it), from the dumps.
CHOICES_BY_RELEASE: list[tuple[str, str, tuple[str, ...], str]] = [
    (
        "attention_backend",
        "cutlass_mla",
        ("0.5.9", "0.5.14", "0.5.18", "0.5.19"),
        "is not a valid choice for --attention-backend",
    ),
    (
        "attention_backend",
        "dual_chunk_flash_attn",
        ("0.5.9", "0.5.14", "0.5.18", "0.5.19"),
        "is not a valid choice for --attention-backend",
    ),
    (
        "kv_cache_dtype",
        "fp4_e2m1",
        ("0.5.9", "0.5.14", "0.5.18", "0.5.19", "0.5.20"),
        "is not a valid choice for --kv-cache-dtype",
    ),
    (
        "schedule_policy",
        "hrrn",
        ("0.5.20", "0.5.21", "0.5.22", "0.5.23"),
        "is not a valid choice for --schedule-policy",
    ),
    (
        "schedule_policy",
        "shortest-prefill-first",
        ("0.5.21", "0.5.22", "0.5.23"),
        "is not a valid choice for --schedule-policy",
    ),
    (
        "cuda_graph_backend_prefill",
        "tc_piecewise",
        ("0.5.14", "0.5.18", "0.5.19", "0.5.20", "0.5.21"),
        "is refused by --cuda-graph-backend-prefill",
    ),
    (
        "cuda_graph_backend_decode",
        "tc_piecewise",
        ("0.5.14", "0.5.18", "0.5.19", "0.5.20", "0.5.21"),
        "is refused by --cuda-graph-backend-decode",
    ),
]


@pytest.mark.parametrize("version", VERSIONS[1:])
@pytest.mark.parametrize(("setting", "value", "accepted", "refusal"), CHOICES_BY_RELEASE)
def test_values_are_accepted_exactly_by_the_releases_that_accept_them(
    setting: str, value: str, accepted: tuple[str, ...], refusal: str, version: str
) -> None:
    opt = "--" + setting.replace("_", "-")
    if version in accepted:
        assert render_cli_args({setting: value}, version) == [opt, value]
        return
    with pytest.raises(ServerArgsError) as exc:
        validate_args({setting: value}, version, where="sglang_server_args")
    (problem,) = problems_of(exc)
    assert problem.startswith(f"sglang_server_args.{setting}: {value!r} {refusal} on SGLang {version}")
    assert problem.endswith(f"({value!r} is accepted by SGLang {', '.join(accepted)})")


@pytest.mark.parametrize("version", NEW)
@pytest.mark.parametrize(
    ("key", "value", "replacement"),
    [
        ("disable_piecewise_cuda_graph", True, "cuda_graph_backend_prefill: disabled"),
        ("enforce_piecewise_cuda_graph", True, "cuda_graph_backend_prefill: tc_piecewise"),
    ],
)
def test_piecewise_switches_removed_in_0_5_20_name_their_replacement(
    key: str, value: Any, replacement: str, version: str
) -> None:
    if key == "enforce_piecewise_cuda_graph" and version == "0.5.22":
        with pytest.raises(ServerArgsError) as exc:
            validate_args({key: value}, version, where="sglang_server_args")
        (problem,) = problems_of(exc)
        assert problem.startswith(
            f"sglang_server_args.{key}: '{key}' is not accepted by SGLang 0.5.22 (it was removed after SGLang "
            f"0.5.19) and its replacement {replacement} cannot be used there: 'tc_piecewise' is refused"
        )
        return
    _args, warnings = validate_args({key: value}, version, where="sglang_server_args")
    state = (
        f"is deprecated in SGLang {version}"
        if version == "0.5.19"
        else (f"is not accepted by SGLang {version} (it was removed after SGLang 0.5.19)")
    )
    assert warnings == [
        f"sglang_server_args.{key}: '{key}' {state}; passing {replacement} instead (set that in place of the old "
        "key to silence this warning)"
    ]


@pytest.mark.parametrize("version", NEW)
def test_renamed_flags_never_use_a_spelling_the_release_refuses_or_deprecates(version: str) -> None:
    """From 0.5.20 --mamba-scheduler-strategy is unrecognised and --cuda-graph-max-bs ambiguous; on
    0.5.19 both are deprecated aliases. Each is written in its current spelling, silently."""
    args = {"mamba_scheduler_strategy": "extra_buffer", "cuda_graph_max_bs": 8}
    assert render_cli_args(args, version) == [
        "--cuda-graph-max-bs-decode",
        "8",
        "--mamba-radix-cache-strategy",
        "extra_buffer",
    ]
    assert validate_args(args, version) == (
        {"cuda_graph_max_bs_decode": 8, "mamba_radix_cache_strategy": "extra_buffer"},
        [],
    )
    assert expected_server_info(args, version) == {
        "cuda_graph_max_bs_decode": 8,
        "mamba_radix_cache_strategy": "extra_buffer",
    }
