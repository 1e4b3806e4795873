"""SGLang's facts by release (sglang_facts.json): in sync with the vendored facts, and the startup
constraints the validator refuses before anything is stopped."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.checks import ServerArgsError
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.table import supported_versions
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.resolve import resolve_host
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._releases.facts import (
    FACTS_PATH,
    known_releases,
    release_facts,
    startup_refusals,
)

REPO_ROOT = Path(__file__).resolve().parents[4]
FACTS_DIR = REPO_ROOT / "tests" / "doubles" / "gpusim" / "src" / "gpusim" / "facts"
NO_BUFFER_REFUSED = ("0.5.14", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_sglang_facts", REPO_ROOT / "tools" / "gen_sglang_facts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generator_check_passes_with_its_defaults_from_any_directory(tmp_path: Path) -> None:
    """What a fresh clone runs: no wheel, no file outside the repository."""
    res = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "gen_sglang_facts.py"), "--check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert (res.returncode, res.stderr) == (0, "")


def test_generator_check_finds_a_stale_table(tmp_path: Path) -> None:
    gen = _generator()
    stale = tmp_path / "stale.json"
    stale.write_text("{}\n", encoding="utf-8")
    assert gen.main(["--output", str(stale), "--check"]) == 1
    assert stale.read_text(encoding="utf-8") == "{}\n"
    assert gen.main(["--output", str(FACTS_PATH), "--check"]) == 0


def test_every_supported_release_was_read_from_its_own_wheel() -> None:
    assert set(known_releases()) == set(supported_versions())
    for version in supported_versions():
        raw = json.loads((FACTS_DIR / f"{version}.json").read_text(encoding="utf-8"))
        assert raw["release"] == version
        assert raw["read_from"]["wheel"].startswith(f"sglang-{version}-")
        assert len(raw["read_from"]["sha256"]) == 64


@pytest.mark.parametrize("version", ["0.5.9", "0.5.14", "0.5.23"])
def test_every_fact_names_its_file_and_line(version: str) -> None:
    raw = json.loads((FACTS_DIR / f"{version}.json").read_text(encoding="utf-8"))
    sources = [m["source"] for m in raw["metrics"].values()]
    sources += [h["source"] for hits in raw["log_lines"].values() for h in hits]
    sources += [c["source"] for c in raw["constraints"]]
    assert sources
    for source in sources:
        path, _unused, line = source.rpartition(":")
        assert path.startswith("sglang/srt/") and path.endswith(".py") and int(line) > 0, source


@pytest.mark.parametrize(
    ("version", "kv_metric", "pools"),
    [
        ("0.5.9", "sglang:token_usage", ("full_token_usage",)),
        ("0.5.14", "sglang:full_token_usage", ("full_token_usage", "swa_token_usage", "mamba_usage")),
        ("0.5.23", "sglang:full_token_usage", ("full_token_usage", "swa_token_usage", "mamba_usage")),
    ],
)
def test_kv_usage_is_full_token_usage_from_0_5_14(version: str, kv_metric: str, pools: tuple[str, ...]) -> None:
    """0.5.14+: token_usage is the fullest pool (pool_stats_observer.get_max_pool_usage)."""
    facts = release_facts(version)
    assert facts is not None
    assert (facts.kv_usage_metric, facts.token_usage_pools) == (kv_metric, pools)
    assert facts.token_usage_is_kv == (version == "0.5.9")


def test_the_draft_loads_before_the_target_pools_from_0_5_14() -> None:
    order = {v: release_facts(v).draft_before_target_pools for v in supported_versions()}  # type: ignore[union-attr]
    assert order == {v: v != "0.5.9" for v in supported_versions()}


def test_the_draft_writes_its_own_weight_lines_and_kv_line_in_every_release() -> None:
    """With MTP/EAGLE the draft's own model runner writes the weight lines and a KV pool line too
    (never the Mamba line, the caps or the scheduler's summary): read from each release's source,
    with where the speculative worker builds that runner."""
    for version in supported_versions():
        facts = release_facts(version)
        assert facts is not None
        assert facts.draft_log_lines == ("kv_cache", "load_weight_begin", "load_weight_end"), version
        vendored = json.loads((FACTS_DIR / f"{version}.json").read_text(encoding="utf-8"))["draft_log_lines"]
        assert vendored["runner_made_at"] and all(
            p.startswith("sglang/srt/speculative/") for p in vendored["runner_made_at"]
        )
        for hits in vendored["lines"].values():
            assert any(hit["draft_guard"] is None for hit in hits)


def test_a_line_the_target_alone_writes_is_not_the_drafts(tmp_path: Path) -> None:
    """The generator reads an ``is_draft_worker`` condition around a format string: a line written
    only when the runner is not the draft's is not among the draft's lines."""
    gen = _generator()
    src = tmp_path / "sglang" / "srt"
    (src / "speculative").mkdir(parents=True)
    (src / "model_executor").mkdir()
    (src / "speculative" / "eagle_worker.py").write_text("ModelRunner(is_draft_worker=True)\n")
    (src / "model_executor" / "model_runner.py").write_text(
        "class ModelRunner:\n"
        "    def load_model(self):\n"
        '        logger.info(f"Load weight begin. avail mem={x:.2f} GB")\n'
        "        if not self.is_draft_worker:\n"
        '            logger.info(f"Load weight end. elapsed={y}")\n'
        "        if self.is_draft_worker:\n"
        "            pass\n"
        "        else:\n"
        '            logger.info(f"KV Cache is allocated. #tokens: {num_tokens}, K size: {k}")\n'
    )
    spec = gen.load_spec()
    release = gen.Release(tmp_path)
    found = gen.extract_draft_log_lines(
        release, spec["draft_runner"], gen.extract_log_lines(release, spec["log_lines"])
    )
    assert found["runner_made_at"] == ["sglang/srt/speculative/eagle_worker.py:1"]
    assert sorted(found["lines"]) == ["load_weight_begin"]


# --------------------------------------------------------------------------------------------------
# The startup constraints, as the validator applies them.


def _hostvars(version: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "sglang_server_version": version,
        "sglang_server_model_path": "/models/qwen",
        "sglang_server_gpu_count": 1,
        "sglang_server_host_args": args,
    }


@pytest.mark.parametrize("version", NO_BUFFER_REFUSED)
def test_explicit_no_buffer_without_disable_overlap_schedule_is_refused(version: str) -> None:
    with pytest.raises(ServerArgsError) as err:
        resolve_host("h", _hostvars(version, {"mamba_radix_cache_strategy": "no_buffer"}))
    [problem] = err.value.problems
    assert problem.startswith(f"host h, instance gpu0: SGLang {version} refuses to start with ")
    assert "AssertionError: no_buffer do not support overlap schedule. Try to set disable_overlap_schedule=True." in (
        problem
    )
    assert "add disable_overlap_schedule: true" in problem


@pytest.mark.parametrize("version", NO_BUFFER_REFUSED)
def test_no_buffer_starts_with_the_overlap_scheduler_off_or_without_the_radix_cache(version: str) -> None:
    for extra in ({"disable_overlap_schedule": True}, {"disable_radix_cache": True}):
        [instance] = resolve_host("h", _hostvars(version, {"mamba_radix_cache_strategy": "no_buffer", **extra}))
        assert instance.args["mamba_radix_cache_strategy"] == "no_buffer"
    # auto resolving to no_buffer turns the overlap scheduler off itself (arg_groups/overrides.py).
    assert resolve_host("h", _hostvars(version, {"mamba_radix_cache_strategy": "auto"}))


def test_0_5_9_turns_the_overlap_scheduler_off_itself() -> None:
    assert resolve_host("h", _hostvars("0.5.9", {"mamba_scheduler_strategy": "no_buffer"}))


def test_every_broken_constraint_is_named_at_once() -> None:
    settings = {"mamba_radix_cache_strategy": "no_buffer", "page_size": 64, "attention_backend": "trtllm_mha"}
    problems = startup_refusals("0.5.23", settings, where="x")
    assert [p.split("AssertionError: ")[1].split(" (")[0] for p in problems] == [
        "no_buffer do not support overlap schedule. Try to set disable_overlap_schedule=True.",
        "no_buffer only supports page_size=1.",
        "no_buffer do not support trtllm_mha attention backend.",
    ]
    assert all("sglang/srt/arg_groups/mamba_hook.py:" in p for p in problems)
    [left] = startup_refusals("0.5.23", {**settings, "disable_overlap_schedule": True, "page_size": 1}, "x")
    assert "no_buffer do not support trtllm_mha attention backend." in left


def test_extra_buffer_lazy_with_speculative_decoding_is_refused_on_0_5_14_only() -> None:
    settings = {"mamba_radix_cache_strategy": "extra_buffer_lazy", "speculative_num_draft_tokens": 4}
    [problem] = startup_refusals("0.5.14", settings)
    assert "extra_buffer_lazy unsupported with spec." in problem
    assert startup_refusals("0.5.23", settings) == []


@pytest.mark.parametrize("version", ["0.5.14", "0.5.18", "0.5.23"])
def test_extra_buffer_lazy_without_the_overlap_scheduler_is_refused_before_anything_is_touched(version: str) -> None:
    """SGLang asserts it where the Mamba pool is sized, after its arguments were accepted (0.5.14
    model_executor/model_runner_kv_cache_mixin.py:288, 0.5.23 mem_cache/kv_cache_configurator.py:3074):
    the new server would die at start, after the old one is gone. The validator refuses it first."""
    args = {"mamba_radix_cache_strategy": "extra_buffer_lazy", "disable_overlap_schedule": True}
    with pytest.raises(ServerArgsError) as err:
        resolve_host("h", _hostvars(version, args))
    [problem] = err.value.problems
    assert "AssertionError: Lazy extra buffer requires overlap schedule" in problem
    assert "remove disable_overlap_schedule" in problem
    # With the overlap scheduler, or without the radix cache, it starts.
    assert resolve_host("h", _hostvars(version, {"mamba_radix_cache_strategy": "extra_buffer_lazy"}))
    assert resolve_host("h", _hostvars(version, {**args, "disable_radix_cache": True}))


def test_a_rule_edited_in_the_spec_without_regenerating_is_stale() -> None:
    gen = _generator()
    spec = gen.load_spec()
    facts = gen.load_facts()
    assert gen.stale_rules(facts, spec) == []
    edited = {**spec, "constraints": [dict(c) for c in spec["constraints"]]}
    edited["constraints"][0]["rule"] = {"when": {"page_size": [64]}, "require": {"page_size": [1]}}
    stale = gen.stale_rules(facts, edited)
    assert stale and all(spec["constraints"][0]["id"] in line for line in stale)


# --------------------------------------------------------------------------------------------------
# Where each release picks its schedulers' NCCL ports, and the warning for an instance port there.


def test_the_generator_reads_how_the_nccl_port_is_picked(tmp_path: Path) -> None:
    gen = _generator()
    spec = gen.load_spec()["scheduler_port"]
    src = tmp_path / "sglang" / "srt"
    (src / "utils").mkdir(parents=True)
    (src / "server_args.py").write_text(
        "class PortArgs:\n"
        "    def init_new(server_args):\n"
        "        if server_args.nccl_port is None:\n"
        "            nccl_port = get_free_port_below_ephemeral()\n"
    )
    (src / "utils" / "network.py").write_text(
        "def get_free_port():\n    pass\n\n"
        "def get_free_port_below_ephemeral(low=22000, high=29999, attempts=64):\n    pass\n"
    )
    assert gen.extract_scheduler_port(gen.Release(tmp_path), spec) == {
        "picked_by": "get_free_port_below_ephemeral",
        "source": "sglang/srt/server_args.py:4",
        "defined_at": "sglang/srt/utils/network.py:4",
        "range": [22000, 29999],
    }
    (src / "server_args.py").write_text("nccl_port = get_free_port()\n")
    assert gen.extract_scheduler_port(gen.Release(tmp_path), spec)["range"] is None


def _port_warnings(version: str, port: int, args: dict[str, Any] | None = None) -> list[str]:
    hostvars = {**_hostvars(version, args or {}), "sglang_server_base_port": port}
    [instance] = resolve_host("h", hostvars)
    return [w for w in instance.warnings if "NCCL port" in w]


@pytest.mark.parametrize(
    ("version", "port", "warned"),
    [
        # 0.5.22+: a random free port in 22000-29999 (sglang/srt/utils/network.py).
        ("0.5.23", 22000, True),
        ("0.5.23", 29999, True),
        ("0.5.23", 30000, False),
        ("0.5.23", 40000, False),
        ("0.5.22", 25000, True),
        # Up to 0.5.21: a bind to port 0, from the kernel's ephemeral range.
        ("0.5.21", 25000, False),
        ("0.5.21", 32768, True),
        ("0.5.9", 40000, True),
        ("0.5.9", 30000, False),
    ],
)
def test_a_port_where_schedulers_pick_their_nccl_port_is_warned(version: str, port: int, warned: bool) -> None:
    found = _port_warnings(version, port)
    assert bool(found) is warned
    if warned:
        [warning] = found
        assert warning.startswith(f"host h, instance gpu0: port {port} lies in ")
        assert "sglang/srt/server_args.py:" in warning and "set nccl_port" in warning


def test_no_port_warning_when_nccl_port_is_set() -> None:
    assert _port_warnings("0.5.23", 25000, {"nccl_port": 31000}) == []
