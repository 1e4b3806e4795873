"""The generated flag table: in sync with its generator, and right about known facts."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags import table as _flag_table
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.table import (
    BOOLOPT,
    LIST,
    OPTIONAL,
    REJECTED,
    SWITCH,
    VALUE,
    load_table,
    supported_versions,
)

REPO_ROOT = Path(__file__).resolve().parents[4]
# The one copy of the argparse dumps: the simulator's package data.
DUMPS = REPO_ROOT / "tests" / "doubles" / "gpusim" / "src" / "gpusim" / "flags"
VERSIONS = ("0.5.9", "0.5.14", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_flag_table", REPO_ROOT / "tools" / "gen_flag_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generator_reads_the_dumps_vendored_in_the_repository() -> None:
    gen = _generator()
    assert gen.DEFAULT_SOURCE == DUMPS
    assert sorted(p.name for p in DUMPS.glob("*.json")) == sorted([f"{v}.json" for v in VERSIONS] + ["order.json"])
    # order.json sits beside the dumps and is no release.
    assert tuple(gen.load_sources(DUMPS)) == VERSIONS


def test_committed_table_is_what_the_generator_produces() -> None:
    gen = _generator()
    expected = gen.dump_table(gen.build_table(DUMPS))
    committed = _flag_table.TABLE_PATH.read_text(encoding="utf-8")
    assert committed == expected, "sglang_flags.json is stale: run tools/gen_flag_table.py"
    assert json.loads(committed)["sources"].keys() == set(VERSIONS)


def test_generator_check_mode_agrees(tmp_path: Path) -> None:
    gen = _generator()
    assert gen.main([str(DUMPS), "--output", str(_flag_table.TABLE_PATH), "--check"]) == 0
    stale = tmp_path / "stale.json"
    stale.write_text("{}\n", encoding="utf-8")
    assert gen.main([str(DUMPS), "--output", str(stale), "--check"]) == 1
    assert stale.read_text(encoding="utf-8") == "{}\n"


def test_generator_check_passes_with_its_defaults_from_any_directory(tmp_path: Path) -> None:
    """What a fresh clone runs: no argument, no file outside the repository."""
    res = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "gen_flag_table.py"), "--check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert (res.returncode, res.stderr) == (0, "")


@pytest.mark.parametrize("version", VERSIONS)
def test_every_reference_dest_is_addressable(version: str) -> None:
    """Each argparse dest is a setting of the table or the target of a deprecated option."""
    raw = json.loads((DUMPS / f"{version}.json").read_text(encoding="utf-8"))
    table = load_table()
    dests = {flag.dest for flag in table.flags(version).values()}
    for entry in raw.values():
        assert entry["dest"] in dests, entry["option_strings"]


def test_table_lists_the_supported_versions_oldest_first() -> None:
    assert supported_versions() == VERSIONS


def _listed_versions(text: str) -> tuple[str, ...]:
    return tuple(re.findall(r"\b0\.5\.\d+\b", text))


def test_documented_version_lists_match_the_table() -> None:
    """The README inventory table and the role's argument spec name exactly the supported releases."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    line = next(row for row in readme.splitlines() if row.startswith("| `sglang_server_version` |"))
    assert _listed_versions(line) == supported_versions()
    specs = (REPO_ROOT / "roles" / "server" / "meta" / "argument_specs.yml").read_text(encoding="utf-8")
    match = re.search(r"Supported - ([0-9., ]+)", " ".join(specs.split()))
    assert match is not None
    assert _listed_versions(match[1]) == supported_versions()


def test_known_facts_from_the_reference() -> None:
    """Facts from sglang.md section 1, asserted on the committed table."""
    table = load_table()
    v9, v14, v18, v23 = (table.flags(v) for v in ("0.5.9", "0.5.14", "0.5.18", "0.5.23"))

    assert v9["mamba_scheduler_strategy"].choices == ("auto", "no_buffer", "extra_buffer")
    assert "mamba_radix_cache_strategy" not in v9
    assert v14["mamba_radix_cache_strategy"].deprecated_aliases == ("--mamba-scheduler-strategy",)
    assert "extra_buffer_lazy" in (v14["mamba_radix_cache_strategy"].choices or ())
    assert "mamba_scheduler_strategy" not in v23

    assert v9["cuda_graph_max_bs"].opt == "--cuda-graph-max-bs"
    assert v18["cuda_graph_max_bs_decode"].deprecated_aliases == ("--cuda-graph-max-bs",)
    assert v23["cuda_graph_max_bs_decode"].deprecated_aliases == ()

    # 0.5.9 stores --tp-size under tensor_parallel_size, but reports tp_size.
    assert (v9["tp_size"].opt, v9["tp_size"].dest, v9["tp_size"].aliases) == (
        "--tensor-parallel-size",
        "tensor_parallel_size",
        ("--tp-size",),
    )
    assert (v23["tp_size"].opt, v23["tp_size"].dest) == ("--tp-size", "tp_size")

    assert v9["enable_piecewise_cuda_graph"].kind == SWITCH
    assert "enable_piecewise_cuda_graph" not in v14
    assert v14["cuda_graph_backend_prefill"].choices == ("full", "breakable", "tc_piecewise", "disabled")
    assert v23["cuda_graph_backend_prefill"].choices == ("full", "breakable", "disabled")
    assert v23["disable_cuda_graph"].deprecated_for == "--cuda-graph-backend-{decode,prefill}=disabled"

    assert "fp4_e2m1" in (v18["kv_cache_dtype"].choices or ())
    assert "fp4_e2m1" not in (v23["kv_cache_dtype"].choices or ())
    assert "cutlass_mla" in (v18["attention_backend"].choices or ())
    assert "cutlass_mla" not in (v23["attention_backend"].choices or ())
    assert "NEXTN" in (v9["speculative_algorithm"].choices or ())
    assert v23["speculative_algorithm"].choices is None

    assert v9["context_length"].type == "int"
    assert v14["context_length"].type == "human_readable_int"
    assert v9["hybrid_kvcache_ratio"].kind == REJECTED
    assert v23["lora_strict_loading"].kind == BOOLOPT
    assert v23["lora_strict_loading"].no_opt == "--no-lora-strict-loading"
    assert v23["model_checksum"].kind == OPTIONAL
    assert v23["cuda_graph_bs_decode"].kind == LIST
    assert v23["max_running_requests"].kind == VALUE


def test_known_facts_of_0_5_19_to_0_5_22() -> None:
    """sglang.md section 1 on the releases between 0.5.18 and 0.5.23, asserted on the committed table."""
    table = load_table()
    v19, v20, v21, v22 = (table.flags(v) for v in ("0.5.19", "0.5.20", "0.5.21", "0.5.22"))

    # Every deprecated alias of 0.5.14 still holds in 0.5.19; all but --disable-cuda-graph go in 0.5.20.
    assert v19["mamba_radix_cache_strategy"].deprecated_aliases == ("--mamba-scheduler-strategy",)
    assert v19["cuda_graph_max_bs_decode"].deprecated_aliases == ("--cuda-graph-max-bs",)
    assert {"disable_piecewise_cuda_graph", "enforce_piecewise_cuda_graph"} <= set(table.value_maps)
    for flags in (v20, v21, v22):
        assert flags["mamba_radix_cache_strategy"].deprecated_aliases == ()
        assert flags["cuda_graph_max_bs_decode"].deprecated_aliases == ()
        assert not {"mamba_scheduler_strategy", "cuda_graph_max_bs"} & set(flags)
        assert flags["disable_cuda_graph"].deprecated_for == "--cuda-graph-backend-{decode,prefill}=disabled"
    assert table.versions_with("cuda_graph_max_bs") == VERSIONS  # as a name of cuda_graph_max_bs_decode

    assert "cutlass_mla" in (v19["attention_backend"].choices or ())
    assert "dual_chunk_flash_attn" in (v19["attention_backend"].choices or ())
    for flags in (v20, v21, v22):
        assert not {"cutlass_mla", "dual_chunk_flash_attn"} & set(flags["attention_backend"].choices or ())

    assert "fp4_e2m1" in (v20["kv_cache_dtype"].choices or ())
    assert "fp4_e2m1" not in (v21["kv_cache_dtype"].choices or ())

    assert v21["cuda_graph_backend_prefill"].choices == ("full", "breakable", "tc_piecewise", "disabled")
    assert v21["cuda_graph_backend_prefill"].type == "str"
    for name in ("cuda_graph_backend_prefill", "cuda_graph_backend_decode"):
        assert (v22[name].type, v22[name].choices) == (
            "parse_cuda_graph_backend_arg",
            ("full", "breakable", "disabled"),
        )

    assert "hrrn" not in (v19["schedule_policy"].choices or ())
    assert "hrrn" in (v20["schedule_policy"].choices or ())
    assert "shortest-prefill-first" not in (v20["schedule_policy"].choices or ())
    assert "shortest-prefill-first" in (v21["schedule_policy"].choices or ())

    # --context and --trust became ambiguous prefixes in 0.5.21; --cuda-graph-max-bs in 0.5.20.
    assert "cuda_graph_prefill_max_context" not in v20
    assert v21["cuda_graph_prefill_max_context"].aliases == ("--context-bucket",)
    assert "trust_request_chat_template" not in v20 and "trust_request_chat_template" in v21
    assert "cuda_graph_max_bs_prefill" in v20


def test_known_renames_and_value_maps() -> None:
    table = load_table()
    assert table.rename_group("mamba_scheduler_strategy") == {"mamba_scheduler_strategy", "mamba_radix_cache_strategy"}
    assert table.rename_group("cuda_graph_max_bs_decode") == {"cuda_graph_max_bs", "cuda_graph_max_bs_decode"}
    assert table.rename_group("tp_size") == {"tp_size", "tensor_parallel_size"}
    assert table.rename_group("max_running_requests") == {"max_running_requests"}

    piecewise = table.value_maps["disable_piecewise_cuda_graph"]
    assert dict(piecewise.targets) == {"cuda_graph_backend_prefill": "disabled"}
    assert piecewise.versions == ("0.5.14", "0.5.18", "0.5.19")
    assert dict(table.value_maps["enforce_piecewise_cuda_graph"].targets) == {
        "cuda_graph_backend_prefill": "tc_piecewise"
    }
    assert dict(table.value_maps["disable_cuda_graph"].targets) == {
        "cuda_graph_backend_decode": "disabled",
        "cuda_graph_backend_prefill": "disabled",
    }
    assert "enable_piecewise_cuda_graph" not in table.value_maps
    assert table.versions_with("enable_piecewise_cuda_graph") == ("0.5.9",)
    assert table.versions_with("mamba_radix_cache_strategy") == VERSIONS
    assert table.value_maps["enforce_piecewise_cuda_graph"].versions == ("0.5.14", "0.5.18", "0.5.19")
    assert table.value_maps["disable_cuda_graph"].versions == VERSIONS[1:]
    assert table.value_maps["enable_dp_attention"].versions == ("0.5.22", "0.5.23")


def _write_dump(directory: Path, version: str, entries: list[dict[str, object]]) -> None:
    base = {"choices": None, "const": None, "default": None, "deprecated_for": None, "nargs": None, "type": "str"}
    dump = {entry["option_strings"][0]: {**base, **entry} for entry in entries}  # type: ignore[index]
    (directory / f"{version}.json").write_text(json.dumps(dump), encoding="utf-8")


def test_generator_derives_renames_and_value_maps_from_a_small_dump(tmp_path: Path) -> None:
    """The derivation rules, on a two-version dump built here (no reference files needed)."""
    _write_dump(
        tmp_path,
        "1.0.0",
        [
            {"option_strings": ["--old-name"], "dest": "old_name", "action": "_StoreAction", "type": "int"},
            {"option_strings": ["--size-long", "--size"], "dest": "size_long", "action": "_StoreAction"},
            {"option_strings": ["--gone"], "dest": "gone", "action": "DeprecatedAction", "nargs": 0, "type": None},
        ],
    )
    _write_dump(
        tmp_path,
        "1.1.0",
        [
            {"option_strings": ["--new-name"], "dest": "new_name", "action": "_StoreAction", "type": "int"},
            {
                "option_strings": ["--old-name"],
                "dest": "new_name",
                "action": "DeprecatedAliasStoreAction",
                "type": "int",
                "deprecated_for": "--new-name",
            },
            {"option_strings": ["--size", "--size-long"], "dest": "size", "action": "_StoreAction"},
            {"option_strings": ["--mode"], "dest": "mode", "action": "_StoreAction", "choices": ["a", "off"]},
            {
                "option_strings": ["--no-mode"],
                "dest": "mode",
                "action": "DeprecatedStoreConstAction",
                "nargs": 0,
                "type": None,
                "deprecated_for": "--mode=off",
            },
            {
                "option_strings": ["--flip", "--no-flip"],
                "dest": "flip",
                "action": "BooleanOptionalAction",
                "nargs": 0,
                "type": None,
            },
        ],
    )
    gen = _generator()
    table = gen.build_table(tmp_path)
    assert ["new_name", "old_name"] in table["renames"]
    assert ["size", "size_long"] in table["renames"]
    old, new = table["versions"]["1.0.0"]["flags"], table["versions"]["1.1.0"]["flags"]
    # The older release's field takes the name the setting has in the newest release when it spells it.
    assert old["size"] == {
        "aliases": ["--size"],
        "dest": "size_long",
        "kind": "value",
        "opt": "--size-long",
        "type": "str",
    }
    assert old["gone"] == {"kind": "rejected", "opt": "--gone"}
    assert new["new_name"]["deprecated_aliases"] == ["--old-name"]
    assert table["value_maps"]["no_mode"] == {
        "replacement": "--mode=off",
        "source": "switch",
        "targets": {"mode": "off"},
        "versions": ["1.1.0"],
    }
    assert new["flip"] == {"kind": "boolopt", "no": "--no-flip", "opt": "--flip"}
    assert json.loads(gen.dump_table(table)) == table
