"""The advisor's throughput model (plugin_utils/_advisor/throughput.py): the step time fitted to
what an instance showed, its fallback, and its predictions against what was measured - the real
RTX PRO 6000 run's figures, and the simulator's after each proposal of the four diagnosis
scenarios and the demo fleet (recorded by tools/record_throughput_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor import diagnose as _advisor
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor import evidence as _advice_evidence
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.throughput import (
    EXPONENT,
    MEASUREMENT,
    WINDOW,
    fit_step_time,
    instance_model,
    step_points,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "throughput"
SCENARIOS = ("demo", "mamba-bound", "kv-bound", "client-bound")


def samples_at(levels: list[tuple[float, float, int]], accept: float | None = None) -> list[dict[str, Any]]:
    """Samples of a window: ``count`` ticks at each (running, gen_throughput) level, in order."""
    out: list[dict[str, Any]] = []
    for running, tput, count in levels:
        for _tick in range(count):
            sample: dict[str, Any] = {"t": len(out), "num_running_reqs": running, "gen_throughput": tput}
            if accept is not None:
                sample["spec_accept_length"] = accept
            out.append(sample)
    return out


def test_a_line_is_fitted_to_the_step_times_and_predicts_between_and_beyond() -> None:
    # 20 ms + 1 ms x running, 2.4 tokens per request and step: n x 2.4 / step tok/s.
    levels = [(n, n * 2.4 / (0.020 + 0.001 * n), 5) for n in (4, 8, 16)]
    model = fit_step_time(step_points(samples_at(levels, 2.4), spec=True), MEASUREMENT)
    assert model.method == MEASUREMENT
    assert model.fixed_s == pytest.approx(0.020) and model.per_request_s == pytest.approx(0.001)
    assert model.accept == pytest.approx(2.4) and model.r2 == pytest.approx(1.0)
    # 16 -> 52 running: (52 / 16) x (36 ms / 72 ms) = x1.625, not 3.25 ** 0.7 = x2.28.
    assert model.factor(52, 16) == pytest.approx(1.625)
    assert "step time 20.0 ms + 1.00 ms x running" in model.words()
    assert model.to_dict()["levels"] == [[4, 24.0, 4], [8, 28.0, 4], [16, 36.0, 4]]


def test_a_sample_whose_batch_just_changed_is_left_out() -> None:
    # The gauge speaks for the last logging interval: the first sample at a new level does not count.
    samples = samples_at([(4, 400.0, 3), (16, 9999.0, 1), (16, 800.0, 3)])
    points = step_points(samples, spec=False)
    assert [p.throughput for p in points] == [400.0, 400.0, 800.0, 800.0, 800.0]


@pytest.mark.parametrize(
    ("levels", "why"),
    [
        ([(16, 1000.0, 10)], "the window showed 1 level of running requests"),
        ([(15, 1000.0, 5), (16, 1050.0, 5)], "varied only 15-16 (less than x1.5)"),
        ([(4, 1000.0, 5), (16, 1000.0 * 16 / 4 * 1.1, 5)], "did not fit a fixed part plus a part per request"),
        ([], "the window has no 2 samples in a row at one batch size"),
    ],
)
def test_without_levels_that_separate_the_terms_the_exponent_stands_in(levels: Any, why: str) -> None:
    model = fit_step_time(step_points(samples_at(levels), spec=False), WINDOW, exponent=0.7)
    assert model.method == EXPONENT and why in model.why
    assert model.factor(32, 16) == pytest.approx(2**0.7)
    assert "the documented exponent" in model.words()


def test_a_scattered_fit_is_refused() -> None:
    levels = [(4, 4 / 0.024, 3), (8, 8 / 0.020, 3), (16, 16 / 0.036, 3)]
    model = fit_step_time(step_points(samples_at(levels), spec=False), MEASUREMENT)
    assert model.method == EXPONENT and "not a straight line" in model.why


def test_the_window_first_then_the_measurement_then_the_exponent_saying_why() -> None:
    pinned = samples_at([(16, 1000.0, 10)])
    stepped = samples_at([(4, 4 / 0.024, 3), (8, 8 / 0.028, 3), (16, 16 / 0.036, 3)])
    assert instance_model({"samples": pinned}, spec=False).why.endswith(
        "(sglang_advise_measure / advise --measure measures it)"
    )
    measured = instance_model({"samples": pinned, "measure_samples": stepped}, spec=False)
    assert measured.method == MEASUREMENT
    failed = instance_model({"samples": pinned, "measure_error": "the instance still ran 3 requests"}, spec=False)
    assert failed.method == EXPONENT and "the measurement: the instance still ran 3 requests" in failed.why
    varied = samples_at([(8, 8 / 0.028, 5), (16, 16 / 0.036, 5)])
    assert instance_model({"samples": varied, "measure_samples": stepped}, spec=False).method == WINDOW


def test_the_real_runs_figures_are_reproduced_from_its_evidence() -> None:
    """The RTX PRO 6000 run (inventories/example/host_vars/pve-rtx.yml, SGLang 0.5.9, no speculative
    decoding): 32 running requests per GPU gave 670 tok/s, and after its retune 72 gave 1,180. Its
    evidence is the window over the retune as Prometheus keeps it, every 5 s for 10 minutes: 5
    minutes at 32 running, then the relaunch's wave (running 0, then the new batch filling), then 5
    minutes at 72; the running gauge dips by one between a request's end and the refill from the
    queue, with the throughput of the smaller batch, and the gauge wobbles by 1%."""
    samples: list[dict[str, Any]] = []
    for i in range(60):
        dip = i % 7 == 3
        samples.append(
            {
                "num_running_reqs": 31 if dip else 32,
                "gen_throughput": (650 if dip else 670) * (1 + 0.01 * ((i % 3) - 1)),
            }
        )
    samples += [{"num_running_reqs": 0, "gen_throughput": 0.0}] * 3 + [{"num_running_reqs": 40, "gen_throughput": 0.0}]
    for i in range(60):
        dip = i % 5 == 2
        samples.append(
            {
                "num_running_reqs": 71 if dip else 72,
                "gen_throughput": (1172 if dip else 1180) * (1 + 0.01 * ((i % 3) - 1)),
            }
        )
    model = instance_model({"samples": samples}, spec=False)
    assert model.method == WINDOW, model.why
    assert model.throughput(32) == pytest.approx(670, rel=0.02)
    assert model.throughput(72) == pytest.approx(1180, rel=0.02)
    assert model.factor(72, 32) == pytest.approx(1180 / 670, rel=0.03)
    # The two terms of an RTX PRO 6000 running the model: about 37 ms a step and 0.33 ms a request.
    assert model.fixed_s == pytest.approx(0.0372, rel=0.1) and model.per_request_s == pytest.approx(0.00033, rel=0.1)


def recorded(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def mean_throughput(samples: list[dict[str, Any]]) -> float:
    values = [float(s["gen_throughput"]) for s in samples if s.get("gen_throughput")]
    return sum(values) / len(values)


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_predicted_gain_is_within_10_percent_of_what_the_simulator_measured(name: str) -> None:
    rec = recorded(name)
    ev = _advice_evidence.evidence_from_observation(
        "sim", rec["instance"], rec["observation"], rec["gpus"], rec["window_s"], rec["interval_s"]
    )
    advice = _advisor.advise_instance(ev)
    assert advice.diagnosis == name.replace("demo", "mamba-bound")
    prop = advice.proposal
    assert prop is not None and prop.throughput_factor_expected is not None
    after = rec["after"]
    # What the simulator ran next: the proposal (server settings, or the clients' concurrency).
    assert after["args"] == {**rec["instance"]["args"], **{k: v[1] for k, v in prop.changes.items()}}
    measured = mean_throughput(after["samples"]) / mean_throughput(rec["observation"]["samples"])
    assert prop.throughput_factor_expected == pytest.approx(measured, rel=0.10), (measured, prop.to_dict())
    assert prop.throughput_model is not None and prop.throughput_model["method"] == MEASUREMENT


def test_the_alike_instances_of_a_host_pool_their_measurements() -> None:
    """Alike instances (the same release and settings; only port and GPU differ, as the layout
    writes them) share one curve: each is fitted to all their measurements, so that one noisy
    measurement (alone not a straight line) no longer sends its instance to the exponent; an
    instance of other settings keeps its own; a failed one gets its alike instances' figures."""
    from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.throughput import (  # noqa: PLC0415
        pool_measurements,
    )

    def inst(name: str, port: int, slots: int = 80) -> dict[str, Any]:
        args = {"max_mamba_cache_size": slots, "host": "0.0.0.0", "port": port, "base_gpu_id": 0}
        return {"name": name, "version": "0.5.23", "port": port, "args": args}

    instances = [inst("gpu0", 30000), inst("gpu1", 30001), inst("gpu2", 30002), inst("gpu3", 30003, slots=200)]
    clean = samples_at([(4, 4 / 0.024, 8), (8, 8 / 0.028, 8), (16, 16 / 0.036, 8)])
    # 4 and 8 running at one step time: alone, not a straight line (r2 under 0.9).
    noisy = samples_at([(4, 4 / 0.0249, 8), (8, 8 / 0.0249, 8), (16, 16 / 0.0372, 8)])
    assert instance_model({"samples": [], "measure_samples": noisy}, spec=False).method == EXPONENT
    observations: dict[str, dict[str, Any]] = {
        "gpu0": {"measure": {}, "measure_samples": clean},
        "gpu1": {"measure": {}, "measure_samples": noisy},
        "gpu2": {"measure": {}, "measure_samples": [], "measure_error": "the instance still ran 3 requests"},
        "gpu3": {"measure": {}, "measure_samples": noisy},
    }
    pool_measurements(instances, observations)
    assert observations["gpu1"]["measure_pool"] == [clean, noisy]
    pooled = instance_model(observations["gpu1"], spec=False)
    assert pooled.method == MEASUREMENT and pooled.instances == 2 and pooled.points == 42
    assert "on 2 alike instances (42 samples" in pooled.words()
    assert pooled.to_dict()["instances"] == 2
    assert instance_model(observations["gpu2"], spec=False).method == MEASUREMENT
    assert observations["gpu3"]["measure_pool"] == [noisy]
    assert instance_model(observations["gpu3"], spec=False).method == EXPONENT


def test_the_compute_bound_scenario_gets_no_proposal_to_predict() -> None:
    rec = recorded("compute-bound")
    ev = _advice_evidence.evidence_from_observation(
        "sim", rec["instance"], rec["observation"], rec["gpus"], rec["window_s"], rec["interval_s"]
    )
    advice = _advisor.advise_instance(ev)
    assert advice.diagnosis == "compute-bound" and advice.proposal is None and "after" not in rec
