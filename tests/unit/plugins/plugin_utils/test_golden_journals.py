"""The model facts and the capacity arithmetic against golden startup journals written from each
release's source (tests/unit/fixtures/journals), not against the simulator: with MTP the draft
model's own lines must not be read as the target's."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity import model_facts
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.inputs import GIB, Settings
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.model_facts import (
    DraftLines,
    derive_model_facts,
    parse_startup_lines,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.plan import plan_capacity
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._releases.facts import (
    nearest_release_facts,
    release_facts,
)

REPO_ROOT = Path(__file__).resolve().parents[4]
JOURNALS = REPO_ROOT / "tests" / "unit" / "fixtures" / "journals"
FACTS = REPO_ROOT / "tests" / "doubles" / "gpusim" / "src" / "gpusim" / "facts"
PARSED = {
    "Load weight begin": "load_weight_begin",
    "Load weight end": "load_weight_end",
    "Mamba Cache is allocated": "mamba_cache",
    "KV Cache is allocated": "kv_cache",
    "max_total_num_tokens=": "scheduler_summary",
    "max_running_requests is capped": "mamba_cap",
    "max_running_requests was reduced": "kv_reduced",
    "fired up and ready to roll": "fired_up",
}
MTP = {
    "speculative_algorithm": "EAGLE",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
}
FIRST_TUNING = {"max_mamba_cache_size": 80, "mamba_full_memory_ratio": 0.4}


def journal(name: str) -> dict[str, Any]:
    return yaml.safe_load((JOURNALS / name).read_text(encoding="utf-8"))


def lines(name: str) -> list[str]:
    return [entry["line"] for entry in journal(name)["lines"]]


@pytest.mark.parametrize("name", sorted(p.name for p in JOURNALS.glob("*.yml")))
def test_every_line_is_a_format_string_of_its_release(name: str) -> None:
    """Each parsed line cites the place the vendored facts give for that format string."""
    golden = journal(name)
    facts = json.loads((FACTS / f"{golden['release']}.json").read_text(encoding="utf-8"))
    for entry in golden["lines"]:
        kind = next(kind for text, kind in PARSED.items() if text in entry["line"])
        places = [hit["source"] for hit in facts["log_lines"][kind]]
        assert entry["source"] in places, (entry["line"], places)


def test_0_5_23_with_mtp_kv_tokens_are_the_target_pools_tokens() -> None:
    golden = journal("0.5.23-qwen3.6-27b-mtp.yml")
    derived = derive_model_facts("0.5.23", lines("0.5.23-qwen3.6-27b-mtp.yml"), None, golden["gpu_total_mib"])
    assert derived.problems == [] and derived.facts is not None
    facts = derived.facts
    # Both runners' weights were loaded before the pools were sized; the overhead is the target's.
    assert facts.weights_gib == pytest.approx(51.80 + 0.85)
    assert facts.overhead_gib == pytest.approx(183359 / 1024 - 126.76 - 51.80)
    # The target's cell counts the draft's layer: both KV lines of the same #tokens.
    assert facts.kv_bytes_per_token == pytest.approx((28.72 + 28.72 + 1.80 + 1.80) * GIB / 941074)
    plan = plan_capacity("0.5.23", facts, golden["gpu_total_mib"], Settings.from_args({**MTP, **FIRST_TUNING}))
    assert plan.kv_tokens == pytest.approx(golden["target_tokens"], rel=0.01)
    assert (plan.mamba_k, plan.effective_max_running_requests, plan.binding) == (80, 16, "mamba")


def test_0_5_14_with_mtp_reads_both_runners_loaded_before_the_pools() -> None:
    golden = journal("0.5.14-qwen3.6-27b-mtp.yml")
    derived = derive_model_facts("0.5.14", lines("0.5.14-qwen3.6-27b-mtp.yml"), None, golden["gpu_total_mib"])
    assert derived.problems == [] and derived.facts is not None
    assert derived.facts.weights_gib == pytest.approx(51.80 + 0.85)
    assert derived.facts.kv_bytes_per_token == pytest.approx((29.33 + 29.33 + 1.83 + 1.83) * GIB / 961120)
    plan = plan_capacity("0.5.14", derived.facts, golden["gpu_total_mib"], Settings.from_args({**MTP, **FIRST_TUNING}))
    assert plan.kv_tokens == pytest.approx(golden["target_tokens"], rel=0.01)
    assert (plan.mamba_k, plan.effective_max_running_requests, plan.binding) == (80, 16, "mamba")


def test_0_5_23_without_mtp() -> None:
    golden = journal("0.5.23-qwen3.6-27b.yml")
    derived = derive_model_facts("0.5.23", lines("0.5.23-qwen3.6-27b.yml"), None, golden["gpu_total_mib"])
    assert derived.problems == [] and derived.facts is not None
    plan = plan_capacity("0.5.23", derived.facts, golden["gpu_total_mib"], Settings.from_args(FIRST_TUNING))
    assert plan.kv_tokens == pytest.approx(golden["target_tokens"], rel=0.01)
    assert plan.effective_max_running_requests == 16


def test_0_5_9_with_mtp_reads_the_target_that_loaded_before_the_draft() -> None:
    """0.5.9's draft loads after the target's pools and CUDA graphs: its avail mem is no evidence of
    the memory before the weights, and its one-layer pool is no evidence of the KV cell."""
    golden = journal("0.5.9-qwen3.6-27b-mtp.yml")
    derived = derive_model_facts("0.5.9", lines("0.5.9-qwen3.6-27b-mtp.yml"), None, golden["gpu_total_mib"])
    assert derived.problems == [] and derived.facts is not None
    facts = derived.facts
    assert facts.weights_gib == pytest.approx(51.80)
    assert facts.overhead_gib == pytest.approx(183359 / 1024 - 126.76 - 51.80)
    assert facts.kv_bytes_per_token == pytest.approx((15.22 + 15.22) * GIB / 498658)
    settings = Settings.from_args({**MTP, **FIRST_TUNING, "mem_fraction_static": 0.857})
    plan = plan_capacity("0.5.9", facts, golden["gpu_total_mib"], settings)
    assert plan.fits, plan.errors
    # The release's own reset with speculative decoding ("Max running requests is reset to 48").
    assert plan.effective_max_running_requests == 48


def test_the_b200_runs_retune_from_the_golden_journals_facts() -> None:
    """inventories/example b200-node: the retune the 7 x B200 run made (200 Mamba slots, ratio 0.6,
    fraction 0.93, 64 requested) runs about max_mamba_cache_size / 5 = 40 at once, as the run had it;
    the facts come from the golden 0.5.23 journal of its first tuning, not from the simulator."""
    golden = journal("0.5.23-qwen3.6-27b-mtp.yml")
    derived = derive_model_facts("0.5.23", lines("0.5.23-qwen3.6-27b-mtp.yml"), None, golden["gpu_total_mib"])
    assert derived.facts is not None
    host = yaml.safe_load((REPO_ROOT / "inventories" / "example" / "host_vars" / "b200-node.yml").read_text())
    plan = plan_capacity(
        "0.5.23", derived.facts, golden["gpu_total_mib"], Settings.from_args(host["sglang_server_host_args"])
    )
    assert plan.fits, plan.errors
    assert (plan.mamba_k, plan.effective_max_running_requests, plan.binding) == (200, 40, "mamba")


# -- which lines are the draft's: the release's facts (draft_log_lines, draft_before_target_pools) ---


def test_the_draft_lines_are_the_releases_facts() -> None:
    for release in ("0.5.9", "0.5.14", "0.5.23"):
        facts = release_facts(release)
        assert facts is not None
        assert DraftLines.of(release) == DraftLines(frozenset(facts.draft_log_lines), facts.draft_before_target_pools)
    # A release between two that were read has the facts of the older one; one not read, none.
    assert DraftLines.of("0.5.15") == DraftLines.of("0.5.14")
    assert DraftLines.of("0.4.0") == DraftLines()


def test_the_parser_reads_which_lines_the_draft_writes_from_the_fact() -> None:
    """The same 0.5.23 MTP journal read with other facts: the draft's lines are what the fact says,
    not what the parser guesses."""
    journal_lines = lines("0.5.23-qwen3.6-27b-mtp.yml")
    real = parse_startup_lines(journal_lines, DraftLines.of("0.5.23"))
    assert (len(real.weights_before_pools), len(real.kv_sized_together)) == (2, 2)
    assert (real.later_runner_lines, real.unexplained_lines) == (0, 0)
    no_kv = DraftLines(frozenset({"load_weight_begin", "load_weight_end"}), before_target_pools=True)
    read = parse_startup_lines(journal_lines, no_kv)
    assert (len(read.weights_before_pools), len(read.kv_sized_together), read.unexplained_lines) == (2, 1, 1)
    after = parse_startup_lines(journal_lines, dataclasses.replace(DraftLines.of("0.5.23"), before_target_pools=False))
    assert (len(after.weights_before_pools), len(after.kv_sized_together), after.later_runner_lines) == (1, 1, 3)
    assert after.load_weight_begin_gib == real.load_weight_begin_gib


def _with_facts(monkeypatch: pytest.MonkeyPatch, change: Callable[[Any], Any]) -> None:
    def nearest(release: str) -> Any:
        facts = nearest_release_facts(release)
        return None if facts is None else change(facts)

    # Not raising: a parser that does not read the fact fails the assertions, not the set-up.
    monkeypatch.setattr(model_facts, "nearest_release_facts", nearest, raising=False)


def test_a_release_whose_draft_writes_no_kv_line_gets_the_targets_cell_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """derive_model_facts follows the vendored fact: were 0.5.23's draft not to write its KV line,
    the second KV line would be no part of the cell."""
    golden = journal("0.5.23-qwen3.6-27b-mtp.yml")
    _with_facts(
        monkeypatch,
        lambda f: dataclasses.replace(f, draft_log_lines=tuple(k for k in f.draft_log_lines if k != "kv_cache")),
    )
    derived = derive_model_facts("0.5.23", lines("0.5.23-qwen3.6-27b-mtp.yml"), None, golden["gpu_total_mib"])
    assert derived.facts is not None
    assert derived.facts.kv_bytes_per_token == pytest.approx((28.72 + 28.72) * GIB / 941074)
    assert derived.facts.weights_gib == pytest.approx(51.80 + 0.85)


def test_a_release_whose_draft_loads_after_the_pools_leaves_its_lines_out(monkeypatch: pytest.MonkeyPatch) -> None:
    golden = journal("0.5.23-qwen3.6-27b-mtp.yml")
    _with_facts(monkeypatch, lambda f: dataclasses.replace(f, draft_before_target_pools=False))
    derived = derive_model_facts("0.5.23", lines("0.5.23-qwen3.6-27b-mtp.yml"), None, golden["gpu_total_mib"])
    assert derived.facts is not None
    assert derived.facts.weights_gib == pytest.approx(51.80)
    assert derived.facts.kv_bytes_per_token == pytest.approx((28.72 + 28.72) * GIB / 941074)
