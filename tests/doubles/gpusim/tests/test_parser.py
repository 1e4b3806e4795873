"""Launch-flag parsing per version: errors, exit codes, deprecations, abbreviations, prog."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import SRC

from gpusim import cli_parser
from gpusim.versions import Version

YELLOW = "\x1b[1;33m"
CAPTURED = ("0.5.9", "0.5.14", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")


def parse(version: str, *args: str) -> dict:
    return cli_parser.parse_args(["--model-path", "m", *args], Version.of(version))


def parse_error(version: str, capsys, *args: str, with_model: bool = True) -> str:
    argv = (["--model-path", "m"] if with_model else []) + list(args)
    with pytest.raises(SystemExit) as exc:
        cli_parser.parse_args(argv, Version.of(version))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ")
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("version", CAPTURED)
@pytest.mark.parametrize(
    "args",
    [
        ["--tp", "2"],
        ["--dp", "2"],
        ["--mem", "0.8"],
        ["--max-running", "8"],
        ["--chunked", "4096"],
        ["--base", "1"],
        ["--served", "x"],
        ["--api", "k"],
    ],
)
def test_unique_prefixes_parse_everywhere(version, args):
    parse(version, *args)


def test_prefix_values_land_in_the_right_fields():
    v9 = parse("0.5.9", "--tp", "2", "--mem", "0.8")
    assert v9["tp_size"] == 2 and v9["mem_fraction_static"] == 0.8
    v23 = parse("0.5.23", "--tp", "2", "--max-running", "8")
    assert v23["tp_size"] == 2 and v23["max_running_requests"] == 8


@pytest.mark.parametrize(
    ("version", "args", "expected"),
    [
        ("0.5.18", ["--trust"], "ambiguous option: --trust could match --trust-remote-code, --trust-mm-content-hashes"),
        ("0.5.20", ["--trust"], "ambiguous option: --trust could match --trust-remote-code, --trust-mm-content-hashes"),
        (
            "0.5.21",
            ["--trust"],
            "ambiguous option: --trust could match --trust-remote-code, --trust-request-chat-template, "
            "--trust-mm-content-hashes",
        ),
        ("0.5.21", ["--context", "4096"], "ambiguous option: --context could match --context-length, --context-bucket"),
        ("0.5.22", ["--context", "4096"], "ambiguous option: --context could match --context-length, --context-bucket"),
        ("0.5.23", ["--context", "4096"], "ambiguous option: --context could match --context-length, --context-bucket"),
        ("0.5.23", ["--page", "64"], "ambiguous option: --page could match --page-size, --paged-experts-num-resident"),
        (
            "0.5.9",
            ["--attention", "fa3"],
            "ambiguous option: --attention could match --attention-context-parallel-size, --attention-backend",
        ),
        (
            "0.5.9",
            ["--decode", "10"],
            "ambiguous option: --decode could match --decode-log-interval, --decode-attention-backend",
        ),
        (
            "0.5.23",
            ["--cuda-graph-max-bs", "8"],
            "ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill",
        ),
        (
            "0.5.20",
            ["--cuda-graph-max-bs", "8"],
            "ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill",
        ),
        (
            "0.5.22",
            ["--cuda-graph-max-bs", "8"],
            "ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill",
        ),
        (
            "0.5.23",
            ["--cuda-graph-max-bs=8"],
            "ambiguous option: --cuda-graph-max-bs=8 could match "
            "--cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill",
        ),
    ],
)
def test_ambiguous_prefixes(version, args, expected, capsys):
    prog = "launch_server.py" if version == "0.5.9" else "sglang serve"
    last = parse_error(version, capsys, *args)
    assert last.endswith(f"error: {expected}")
    if version != "0.5.9":
        assert last.startswith(f"{prog}: error:")


def test_prefixes_that_still_work_on_old_versions():
    assert parse("0.5.14", "--trust")["trust_remote_code"] is True
    assert parse("0.5.18", "--context", "4096")["context_length"] == 4096
    assert parse("0.5.20", "--context", "4096")["context_length"] == 4096
    assert parse("0.5.19", "--trust-r")["trust_remote_code"] is True
    assert parse("0.5.9", "--page", "64")["page_size"] == 64
    assert parse("0.5.9", "--cuda-graph-max-bs", "8")["cuda_graph_max_bs"] == 8


@pytest.mark.parametrize(
    ("version", "args", "expected"),
    [
        ("0.5.23", ["--foo-bar", "1"], "unrecognized arguments: --foo-bar 1"),
        ("0.5.23", ["--mamba-scheduler-strategy", "auto"], "unrecognized arguments: --mamba-scheduler-strategy auto"),
        ("0.5.23", ["--disable-piecewise-cuda-graph"], "unrecognized arguments: --disable-piecewise-cuda-graph"),
        ("0.5.14", ["--enable-piecewise-cuda-graph"], "unrecognized arguments: --enable-piecewise-cuda-graph"),
        ("0.5.9", ["--cuda-graph-max-bs-decode", "8"], "unrecognized arguments: --cuda-graph-max-bs-decode 8"),
        (
            "0.5.23",
            ["--schedule-policy", "xyz"],
            "argument --schedule-policy: invalid choice: 'xyz' (choose from 'lpm', 'random', 'fcfs', 'dfs-weight', "
            "'lof', 'priority', 'routing-key', 'hrrn', 'shortest-prefill-first')",
        ),
        (
            "0.5.9",
            ["--schedule-policy", "xyz"],
            "argument --schedule-policy: invalid choice: 'xyz' (choose from 'lpm', 'random', 'fcfs', 'dfs-weight', "
            "'lof', 'priority', 'routing-key')",
        ),
        ("0.5.23", ["--port", "abc"], "argument --port: invalid int value: 'abc'"),
        ("0.5.23", ["--mem-fraction-static", "abc"], "argument --mem-fraction-static: invalid float value: 'abc'"),
        ("0.5.9", ["--context-length", "32k"], "argument --context-length: invalid int value: '32k'"),
        (
            "0.5.23",
            ["--context-length", "abc"],
            "argument --context-length: Invalid integer value: 'abc'. Use a plain integer, SI suffixes (1k, 1M), or "
            "IEC suffixes (1Ki, 1Mi). Suffixes are case-sensitive.",
        ),
        (
            "0.5.23",
            ["--attention-backend", "cutlass_mla"],
            "argument --attention-backend: invalid choice: 'cutlass_mla'",
        ),
        ("0.5.23", ["--kv-cache-dtype", "fp4_e2m1"], "argument --kv-cache-dtype: invalid choice: 'fp4_e2m1'"),
        # 0.5.20 drops the deprecated aliases (all but --disable-cuda-graph) and two attention backends.
        *(
            (version, args, f"unrecognized arguments: {' '.join(args)}")
            for version in ("0.5.20", "0.5.21", "0.5.22")
            for args in (
                ["--mamba-scheduler-strategy", "no_buffer"],
                ["--disable-piecewise-cuda-graph"],
                ["--enforce-piecewise-cuda-graph"],
            )
        ),
        *(
            (version, ["--attention-backend", backend], f"argument --attention-backend: invalid choice: '{backend}'")
            for version in ("0.5.20", "0.5.21", "0.5.22")
            for backend in ("cutlass_mla", "dual_chunk_flash_attn")
        ),
        ("0.5.21", ["--kv-cache-dtype", "fp4_e2m1"], "argument --kv-cache-dtype: invalid choice: 'fp4_e2m1'"),
        ("0.5.22", ["--kv-cache-dtype", "fp4_e2m1"], "argument --kv-cache-dtype: invalid choice: 'fp4_e2m1'"),
        (
            "0.5.19",
            ["--schedule-policy", "hrrn"],
            "argument --schedule-policy: invalid choice: 'hrrn' (choose from 'lpm', 'random', 'fcfs', 'dfs-weight', "
            "'lof', 'priority', 'routing-key')",
        ),
        (
            "0.5.20",
            ["--schedule-policy", "shortest-prefill-first"],
            "argument --schedule-policy: invalid choice: 'shortest-prefill-first' (choose from 'lpm', 'random', "
            "'fcfs', 'dfs-weight', 'lof', 'priority', 'routing-key', 'hrrn')",
        ),
        *(
            (
                "0.5.22",
                [f"--cuda-graph-backend-{phase}", "tc_piecewise"],
                f"argument --cuda-graph-backend-{phase}: tc_piecewise was removed; select breakable, full, or disabled",
            )
            for phase in ("decode", "prefill")
        ),
    ],
)
def test_errors(version, args, expected, capsys):
    last = parse_error(version, capsys, *args)
    assert expected in last


@pytest.mark.parametrize(
    ("version", "args", "dest", "value"),
    [
        ("0.5.19", ["--attention-backend", "cutlass_mla"], "attention_backend", "cutlass_mla"),
        ("0.5.19", ["--attention-backend", "dual_chunk_flash_attn"], "attention_backend", "dual_chunk_flash_attn"),
        ("0.5.20", ["--kv-cache-dtype", "fp4_e2m1"], "kv_cache_dtype", "fp4_e2m1"),
        ("0.5.20", ["--schedule-policy", "hrrn"], "schedule_policy", "hrrn"),
        ("0.5.21", ["--schedule-policy", "shortest-prefill-first"], "schedule_policy", "shortest-prefill-first"),
        ("0.5.21", ["--cuda-graph-backend-prefill", "tc_piecewise"], "cuda_graph_backend_prefill", "tc_piecewise"),
        ("0.5.21", ["--cuda-graph-backend-decode", "tc_piecewise"], "cuda_graph_backend_decode", "tc_piecewise"),
        ("0.5.22", ["--cuda-graph-backend-prefill", "breakable"], "cuda_graph_backend_prefill", "breakable"),
        ("0.5.20", ["--cuda-graph-max-bs-decode", "8"], "cuda_graph_max_bs_decode", 8),
        ("0.5.20", ["--mamba-radix-cache-strategy", "no_buffer"], "mamba_radix_cache_strategy", "no_buffer"),
        ("0.5.21", ["--context-length", "4096"], "context_length", 4096),
    ],
)
def test_values_the_release_accepts(version, args, dest, value, capsys):
    assert parse(version, *args)[dest] == value
    assert capsys.readouterr().err == ""


def test_missing_model_path(capsys):
    last = parse_error("0.5.23", capsys, with_model=False)
    assert last == "sglang serve: error: the following arguments are required: --model-path/--model"


def test_human_readable_ints():
    a = parse("0.5.23", "--context-length", "32Ki", "--max-total-tokens", "200k")
    assert a["context_length"] == 32768 and a["max_total_tokens"] == 200000


@pytest.mark.parametrize(
    ("version", "args", "dest", "value", "message"),
    [
        (
            "0.5.14",
            ["--cuda-graph-max-bs", "8"],
            "cuda_graph_max_bs_decode",
            8,
            "'--cuda-graph-max-bs' is deprecated and will be removed in a future release. "
            "Use '--cuda-graph-max-bs-decode' instead.",
        ),
        (
            "0.5.18",
            ["--mamba-scheduler-strategy", "extra_buffer"],
            "mamba_radix_cache_strategy",
            "extra_buffer",
            "'--mamba-scheduler-strategy' is deprecated and will be removed in a future release. "
            "Use '--mamba-radix-cache-strategy' instead.",
        ),
        (
            "0.5.23",
            ["--disable-cuda-graph"],
            "disable_cuda_graph",
            True,
            "'--disable-cuda-graph' is deprecated and will be removed in a future release. "
            "Use '--cuda-graph-backend-{decode,prefill}=disabled' instead.",
        ),
        (
            "0.5.14",
            ["--disable-piecewise-cuda-graph"],
            "cuda_graph_backend_prefill",
            "disabled",
            "'--disable-piecewise-cuda-graph' is deprecated and will be removed in a future release. "
            "Use '--cuda-graph-backend-prefill=disabled' instead.",
        ),
        (
            "0.5.14",
            ["--enforce-piecewise-cuda-graph"],
            "cuda_graph_backend_prefill",
            "tc_piecewise",
            "'--enforce-piecewise-cuda-graph' is deprecated and will be removed in a future release. "
            "Use '--cuda-graph-backend-prefill=tc_piecewise' instead.",
        ),
        # 0.5.19 still has every alias of 0.5.14 (removed in 0.5.20).
        (
            "0.5.19",
            ["--cuda-graph-max-bs", "8"],
            "cuda_graph_max_bs_decode",
            8,
            "'--cuda-graph-max-bs' is deprecated and will be removed in a future release. "
            "Use '--cuda-graph-max-bs-decode' instead.",
        ),
        (
            "0.5.19",
            ["--mamba-scheduler-strategy", "extra_buffer"],
            "mamba_radix_cache_strategy",
            "extra_buffer",
            "'--mamba-scheduler-strategy' is deprecated and will be removed in a future release. "
            "Use '--mamba-radix-cache-strategy' instead.",
        ),
        (
            "0.5.19",
            ["--disable-piecewise-cuda-graph"],
            "cuda_graph_backend_prefill",
            "disabled",
            "'--disable-piecewise-cuda-graph' is deprecated and will be removed in a future release. "
            "Use '--cuda-graph-backend-prefill=disabled' instead.",
        ),
        (
            "0.5.19",
            ["--enforce-piecewise-cuda-graph"],
            "cuda_graph_backend_prefill",
            "tc_piecewise",
            "'--enforce-piecewise-cuda-graph' is deprecated and will be removed in a future release. "
            "Use '--cuda-graph-backend-prefill=tc_piecewise' instead.",
        ),
        (
            "0.5.22",
            ["--disable-cuda-graph"],
            "disable_cuda_graph",
            True,
            "'--disable-cuda-graph' is deprecated and will be removed in a future release. "
            "Use '--cuda-graph-backend-{decode,prefill}=disabled' instead.",
        ),
    ],
)
def test_deprecated_aliases_warn_in_yellow_and_take_effect(version, args, dest, value, message, capsys):
    out = parse(version, *args)
    assert out[dest] == value
    err = capsys.readouterr().err
    assert err == f"{YELLOW}{message}\x1b[0m\n"


def test_deprecated_prefix_abbreviation_warns_with_full_name(capsys):
    out = parse("0.5.14", "--mamba-scheduler", "no_buffer")
    assert out["mamba_radix_cache_strategy"] == "no_buffer"
    assert "'--mamba-scheduler-strategy' is deprecated" in capsys.readouterr().err


def test_boolean_optional_and_custom_types():
    a = parse(
        "0.5.23",
        "--no-dllm-fdfo",
        "--lora-paths",
        "a=/x",
        '{"lora_name": "b", "lora_path": "/y"}',
        "--quantization-param-path",
        "None",
        "--extra-metric-labels",
        '{"a": "b"}',
    )
    assert a["dllm_fdfo"] is False
    assert a["lora_paths"] == ["a=/x", {"lora_name": "b", "lora_path": "/y"}]
    assert a["quantization_param_path"] is None
    assert a["extra_metric_labels"] == {"a": "b"}


def test_v9_parallel_dests_are_renamed():
    a = parse("0.5.9", "--tensor-parallel-size", "4", "--dp-size", "2")
    assert a["tp_size"] == 4 and a["dp_size"] == 2
    assert "tensor_parallel_size" not in a


def test_between_versions_use_lower_table_and_dated_prog():
    v = Version.of("0.5.12")
    assert v.flags_table == "0.5.9" and v.prog_is_sglang_serve
    assert Version.of("0.5.16").flags_table == "0.5.14"
    assert Version.of("0.5.17").flags_table == "0.5.14"
    assert Version.of("0.5.30").flags_table == "0.5.23"


@pytest.mark.parametrize("version", CAPTURED)
def test_each_captured_release_parses_with_its_own_dump(version):
    assert Version.of(version).flags_table == version
    dump = cli_parser.load_flags(version)
    assert "--model-path" in dump
    parser = cli_parser.build_parser(Version.of(version))
    spellings = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
    expected = {s for entry in dump.values() for s in entry["option_strings"]}
    assert spellings == expected


def test_bundled_flag_tables_are_the_reference_copies():
    names = sorted(p.name for p in (SRC / "gpusim" / "flags").glob("*.json"))
    assert names == sorted([f"{v}.json" for v in CAPTURED] + ["order.json"])
    for name in CAPTURED:
        data = cli_parser.load_flags(name)
        assert "--model-path" in data
        assert (SRC / "gpusim" / "flags" / f"{name}.json").read_bytes().startswith(b"{")


def _launch(sim, *args: str, env=None) -> subprocess.CompletedProcess:
    return sim.run(sys.executable, "-m", "sglang.launch_server", *args, env=env, timeout=30)


@pytest.mark.parametrize(
    ("version", "args", "error"),
    [
        (
            "0.5.20",
            ["--cuda-graph-max-bs", "8"],
            "ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill",
        ),
        ("0.5.21", ["--context", "4096"], "ambiguous option: --context could match --context-length, --context-bucket"),
        ("0.5.20", ["--mamba-scheduler-strategy", "auto"], "unrecognized arguments: --mamba-scheduler-strategy auto"),
        (
            "0.5.22",
            ["--cuda-graph-backend-prefill", "tc_piecewise"],
            "argument --cuda-graph-backend-prefill: tc_piecewise was removed; select breakable, full, or disabled",
        ),
    ],
)
def test_cli_refuses_what_the_release_refuses(sim, version, args, error):
    sim.write_config({"sglang_version": version})
    res = _launch(sim, "--model-path", "m", *args)
    assert res.returncode == 2
    err = res.stderr.strip().splitlines()
    assert err[-1] == f"sglang serve: error: {error}"
    assert any(line.startswith("usage: sglang serve [-h] ") for line in err)


@pytest.mark.parametrize(("version", "prog"), [("0.5.9", "launch_server.py"), ("0.5.23", "sglang serve")])
def test_cli_exit_code_and_prog(sim, version, prog):
    sim.write_config({"sglang_version": version})
    res = _launch(sim, "--model-path", "m", "--foo-bar", "1")
    assert res.returncode == 2
    err = res.stderr.strip().splitlines()
    assert err[-1] == f"{prog}: error: unrecognized arguments: --foo-bar 1"
    usage_start = next(i for i, line in enumerate(err) if line.startswith("usage: "))
    assert err[usage_start].startswith(f"usage: {prog} [-h] ")
    assert len(err) - usage_start > 100
    warned = "'python -m sglang.launch_server' is still supported" in res.stderr
    assert warned is (version != "0.5.9")


def test_runpy_launcher_shows_module_path_prog(sim):
    sim.write_config({"sglang_version": "0.5.9"})
    code = (
        "import runpy, sys; sys.argv=['x', '--model-path', 'm', '--bogus'];"
        "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)"
    )
    res = sim.run(sys.executable, "-c", code)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == "launch_server.py: error: unrecognized arguments: --bogus"


def test_unknown_spec_algorithm_fails_after_parsing_on_new_versions(sim):
    res = _launch(sim, "--model-path", "m", "--speculative-algorithm", "BOGUS")
    assert res.returncode == 1
    assert "ValueError: Unknown speculative algorithm name: BOGUS" in res.stderr
    sim.write_config({"sglang_version": "0.5.9"})
    res = _launch(sim, "--model-path", "m", "--speculative-algorithm", "BOGUS")
    assert res.returncode == 2
    assert "argument --speculative-algorithm: invalid choice: 'BOGUS'" in res.stderr


def test_config_file_flag(sim, tmp_path):
    cfg = tmp_path / "serve.json"
    cfg.write_text(json.dumps({"tp_size": 2, "trust_remote_code": True}))
    a = cli_parser.parse_args(["--model-path", "m", "--config", str(cfg), "--tp-size", "4"], Version.of("0.5.23"))
    assert a["tp_size"] == 4 and a["trust_remote_code"] is True
