"""tools/demo_advice.py, `make demo`'s glue around the advisor: the patch as one extra-vars file,
and the predicted against the measured throughput per group."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("demo_advice", REPO / "tools" / "demo_advice.py")
assert _spec is not None and _spec.loader is not None
demo_advice = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo_advice)

BLOCK = {"sglang_server_host_args": {"max_mamba_cache_size": 180, "mem_fraction_static": 0.93}}


def test_the_patch_becomes_one_extra_vars_file_the_first_hosts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    patch = tmp_path / "patch.yml"
    other = {"sglang_server_host_args": {"max_mamba_cache_size": 200}}
    patch.write_text(yaml.safe_dump({"host_vars": {"b": other, "a": BLOCK}}))
    assert demo_advice.extravars(patch, tmp_path / "advised.yml") == 0
    assert yaml.safe_load((tmp_path / "advised.yml").read_text()) == BLOCK
    assert "b's block differs from a's; the demo's hosts are alike: a's for all" in capsys.readouterr().out
    patch.write_text(yaml.safe_dump({"host_vars": {}}))
    assert demo_advice.extravars(patch, tmp_path / "none.yml") == 1
    assert not (tmp_path / "none.yml").exists()


def advice(tput: float, predicted: float) -> dict[str, Any]:
    return {
        "groups": [
            {
                "label": "a/gpu0, b/gpu0",
                "instances": ["a/gpu0", "b/gpu0"],
                "proposal": {"changes": {"x": [1, 2]}, "throughput_factor_expected": predicted},
            }
        ],
        "instances": [{"host": h, "name": "gpu0", "stats": {"gen_throughput_mean": tput}} for h in ("a", "b")],
    }


@pytest.mark.parametrize(
    ("after", "code", "words"), [(1500.0, 0, "+3.3% within 10%"), (1200.0, 1, "+29.2% NOT within 10%")]
)
def test_predicted_and_measured_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], after: float, code: int, words: str
) -> None:
    runs = tmp_path / "runs"
    for stamp, name, report in (("1", "advise.json", advice(1000.0, 1.55)), ("2", "advice.json", advice(after, 1.0))):
        directory = runs / f"2026120{stamp}T000000Z-advise"
        directory.mkdir(parents=True)
        (directory / name).write_text(json.dumps(report))
        os.utime(directory, (2000.0 + int(stamp), 2000.0 + int(stamp)))
    assert demo_advice.compare(runs, 1000.0) == code
    line = capsys.readouterr().out.strip()
    assert line.startswith(
        f"a/gpu0, b/gpu0: predicted x1.55 (exponent), measured x{after / 1000:.2f} (1000 -> {after:.0f}"
    )
    assert line.endswith(words)
    assert demo_advice.compare(runs, 5000.0) == 1


def test_a_group_is_held_to_the_prediction_for_the_change_it_got(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo gives every host the first host's block: a host whose own fit ranked another
    candidate first is compared with its prediction for the applied one, not for its own first."""
    lazy = {
        "changes": {"max_mamba_cache_size": [80, 180], "mamba_radix_cache_strategy": ["auto", "extra_buffer_lazy"]},
        "throughput_factor_expected": 1.55,
    }
    no_buffer = {
        "changes": {"max_mamba_cache_size": [80, 156], "disable_overlap_schedule": [False, True]},
        "throughput_factor_expected": 2.17,
    }
    group = {"label": "b/gpu0", "instances": ["b/gpu0"], "proposal": no_buffer, "alternatives": [lazy]}
    applied = {"max_mamba_cache_size": 180, "mamba_radix_cache_strategy": "extra_buffer_lazy"}
    assert demo_advice.applied_candidate(group, applied) is lazy
    assert demo_advice.applied_candidate(group, None) is no_buffer
    assert demo_advice.applied_candidate(group, {"max_mamba_cache_size": 200}) is None
    runs = tmp_path / "runs"
    for stamp, tput in (("1", 1000.0), ("2", 1500.0)):
        directory = runs / f"2026120{stamp}T000000Z-advise"
        directory.mkdir(parents=True)
        report = {
            "groups": [group],
            "instances": [{"host": "b", "name": "gpu0", "stats": {"gen_throughput_mean": tput}}],
        }
        (directory / "advice.json").write_text(json.dumps(report))
        os.utime(directory, (2000.0 + int(stamp), 2000.0 + int(stamp)))
    extravars = tmp_path / "advised.yml"
    extravars.write_text(yaml.safe_dump({"sglang_server_host_args": applied}))
    assert demo_advice.compare(runs, 1000.0, extravars) == 0
    assert "predicted x1.55 (exponent, for the alternative applied), measured x1.50" in capsys.readouterr().out
    assert demo_advice.compare(runs, 1000.0) == 1
    assert "predicted x2.17 (exponent), measured x1.50" in capsys.readouterr().out
