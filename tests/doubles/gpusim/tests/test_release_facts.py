"""The simulator follows the SGLang facts vendored from each release's source (facts/*.json,
tools/gen_sglang_facts.py), not its own reading: the startup constraints it enforces."""

from __future__ import annotations

import json

import pytest

from gpusim import cli_parser, release_facts, resolve
from gpusim.config import Config
from gpusim.metrics import DOCS

B200 = {"name": "NVIDIA B200", "memory_total_mib": 183359}
NO_BUFFER = {"0.5.9": "--mamba-scheduler-strategy", "0.5.14": "--mamba-radix-cache-strategy"}


def _resolve(version: str, argv: list[str]) -> resolve.Resolved:
    cfg = Config({"sglang_version": version, "gpus": B200, "model": {"profile": "qwen3.6-27b"}})
    raw = cli_parser.parse_args(["--model-path", "m", *argv], cfg.version)
    return resolve.resolve(raw, cfg.version, cfg, cfg.profile_for("m"))


@pytest.mark.parametrize("version", ["0.5.14", "0.5.18", "0.5.21", "0.5.23"])
def test_an_explicit_no_buffer_with_the_overlap_scheduler_on_exits_as_the_release_does(version: str) -> None:
    with pytest.raises(resolve.ResolveError) as err:
        _resolve(version, ["--mamba-radix-cache-strategy", "no_buffer"])
    vendored = [c for c in release_facts.facts_for(version)["constraints"] if c["id"] == "no_buffer_overlap"]
    assert (err.value.exc_type, err.value.message) == (vendored[0]["error"], vendored[0]["message"])
    assert err.value.message == "no_buffer do not support overlap schedule. Try to set disable_overlap_schedule=True."
    started = _resolve(version, ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"])
    assert (started.mamba_strategy, started.overlap, started.mamba_ratio) == ("no_buffer", False, 3)


@pytest.mark.parametrize("version", ["0.5.14", "0.5.23"])
def test_auto_resolving_to_no_buffer_turns_the_overlap_scheduler_off_itself(version: str) -> None:
    res = _resolve(version, ["--disable-overlap-schedule"])
    assert (res.mamba_strategy, res.overlap) == ("no_buffer", False)


def test_0_5_9_turns_the_overlap_scheduler_off_for_no_buffer() -> None:
    res = _resolve("0.5.9", ["--mamba-scheduler-strategy", "no_buffer"])
    assert (res.mamba_strategy, res.overlap) == ("no_buffer", False)


def test_every_release_the_simulator_knows_has_vendored_facts() -> None:
    flags = {p.stem for p in release_facts.FACTS_DIR.parent.joinpath("flags").glob("*.json") if p.stem[0].isdigit()}
    facts = {p.stem for p in release_facts.FACTS_DIR.glob("*.json")}
    assert flags == facts
    for name in facts:
        data = json.loads((release_facts.FACTS_DIR / f"{name}.json").read_text(encoding="utf-8"))
        assert data["release"] == name and data["read_from"]["wheel"].startswith(f"sglang-{name}-")


def test_every_metric_the_simulator_exports_is_the_releases_own() -> None:
    """Name, type and help of each metric as 0.5.23 defines it (metrics_collector.py)."""
    defined = release_facts.facts_for("0.5.23")["metrics"]
    for name, (kind, doc) in DOCS.items():
        assert name in defined, name
        assert (defined[name]["type"], defined[name]["help"]) == (kind, doc), name


@pytest.mark.parametrize("version", ["0.5.9", "0.5.14", "0.5.23"])
def test_token_usage_is_the_fullest_pool_where_the_release_says_so(version: str) -> None:
    pools = release_facts.token_usage_pools(version)
    assert ("mamba_usage" in pools) == (version != "0.5.9")
