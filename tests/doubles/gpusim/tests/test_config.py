"""The simulator's configuration: the timing presets."""

from __future__ import annotations

import pytest

from gpusim.config import DEFAULTS, TIMING_PRESETS, Config, ConfigError


def test_the_default_preset_is_the_fast_test_timing() -> None:
    assert Config({}).timing == DEFAULTS["timing"]
    assert Config({}).timing["startup_s"] < 10


def test_the_reference_preset_gives_the_real_servers_order_of_magnitude() -> None:
    timing = Config({"timing_preset": "reference"}).timing
    assert timing["startup_s"] >= 60  # a model load takes minutes
    assert timing["teardown_s"] >= 30  # GB300 held its memory more than 30 s after SIGKILL
    assert {k: timing[k] for k in TIMING_PRESETS["reference"]} == TIMING_PRESETS["reference"]
    # What the preset does not name stays as the default.
    assert timing["heartbeat_s"] == DEFAULTS["timing"]["heartbeat_s"]


def test_keys_under_timing_win_over_the_preset() -> None:
    timing = Config({"timing_preset": "reference", "timing": {"startup_s": 4.0}}).timing
    assert timing["startup_s"] == 4.0
    assert timing["teardown_s"] == TIMING_PRESETS["reference"]["teardown_s"]


def test_an_unknown_preset_is_refused() -> None:
    with pytest.raises(ConfigError, match="timing_preset must be one of test, reference"):
        Config({"timing_preset": "slow"})
