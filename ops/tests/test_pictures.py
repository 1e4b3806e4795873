"""The advice's and the trial's pictures (pictures.py): a PNG per group, and a clear line when
matplotlib is not installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sglang_fleet_ops import pictures

PNG = b"\x89PNG\r\n\x1a\n"


def item(host: str, name: str, running: float, tput: float) -> dict[str, Any]:
    return {
        "host": host,
        "name": name,
        "series": {"t": [0, 1, 2], "running": [running] * 3, "gen_throughput": [tput, tput * 1.01, tput]},
    }


REPORT = {
    "groups": [
        {
            "label": "a/gpu0,gpu1",
            "diagnosis": "mamba-bound",
            "instances": ["a/gpu0", "a/gpu1"],
            "proposal": {"throughput_factor_expected": 1.5, "throughput_model": {"method": "measurement"}},
        },
        {"label": "b/gpu0", "diagnosis": "client-bound", "instances": ["b/gpu0"], "proposal": None},
    ],
    "instances": [item("a", "gpu0", 16, 1900), item("a", "gpu1", 16, 1880), item("b", "gpu0", 4, 750)],
}


def test_a_png_per_group_of_the_advice(tmp_path: Path) -> None:
    paths, missing = pictures.advice_pictures(REPORT, tmp_path)
    assert missing is None
    assert [p.name for p in paths] == ["advice-1-a-gpu0-gpu1.png", "advice-2-b-gpu0.png"]
    assert all(p.read_bytes().startswith(PNG) for p in paths)


def test_the_trial_is_drawn_before_and_after(tmp_path: Path) -> None:
    after = {"instances": [item("a", "gpu0", 40, 2800), item("a", "gpu1", 16, 1890)]}
    trial = {"canary": "a/gpu0", "group": {"instances": ["a/gpu0", "a/gpu1"]}, "decision": "kept", "gain": 1.47}
    path, missing = pictures.trial_picture(REPORT, after, trial, tmp_path)
    assert missing is None and path == tmp_path / "trial.png" and path.read_bytes().startswith(PNG)
    none, why = pictures.trial_picture({}, {}, trial, tmp_path)
    assert none is None and why == "no pictures: neither window has samples of the group"


def test_without_matplotlib_it_says_so_and_draws_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pictures, "_pyplot", lambda: None)
    assert pictures.advice_pictures(REPORT, tmp_path) == ([], pictures.MISSING)
    assert "pip install 'sglang-fleet-ops[pictures]'" in pictures.MISSING
    assert list(tmp_path.iterdir()) == []
