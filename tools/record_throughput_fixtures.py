#!/usr/bin/env python3
"""Records what the advisor sees and what the simulator then measures, for the throughput model's
tests (tests/unit/fixtures/throughput/<scenario>.json): for the four diagnosis scenarios of the
``advisor`` Molecule scenario and the demo fleet, a simulated instance (tests/doubles/gpusim, as
local processes) under the scenario's load (tests/testbed/loadgen.py): the window's /metrics
samples, the agent's stepped measurement (op_measure), /server_info and the startup lines; then
the advisor's proposal launched on another GPU under the load it predicts, and that window's
samples. One scenario at a time (the measurements are timings: a busy machine blurs them).

    PYTHONPATH=collections:tests/unit/plugins/support .venv/bin/python tools/record_throughput_fixtures.py

Takes about four minutes; the test reads the files, it never runs this.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import simulated_fleet as sf

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor import diagnose as _advisor
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor import evidence as _advice_evidence

MTP = {
    "speculative_algorithm": "EAGLE",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
    "enable_metrics": True,
}
FIRST_TUNING = {**MTP, "max_mamba_cache_size": 80, "mamba_full_memory_ratio": 0.4, "reasoning_parser": "qwen3"}
# (name, settings, requests sent, prompt tokens, max new tokens, clients follow the server's max)
SCENARIOS: list[tuple[str, dict[str, Any], int, int, int, bool]] = [
    ("demo", FIRST_TUNING, 20, 200, 4096, True),  # generation_concurrency auto x1.25 of 16
    ("mamba-bound", {**MTP, "max_mamba_cache_size": 80, "mamba_full_memory_ratio": 0.4}, 40, 200, 4096, False),
    ("kv-bound", {"max_mamba_cache_size": 40, "mem_fraction_static": 0.36, "enable_metrics": True}, 6, 6000, 64, False),
    (
        "client-bound",
        {
            **MTP,
            "max_mamba_cache_size": 200,
            "mamba_full_memory_ratio": 0.6,
            "mem_fraction_static": 0.93,
            "max_running_requests": 64,
        },
        4,
        200,
        4096,
        False,
    ),
    (
        "compute-bound",
        {
            **MTP,
            "speculative_num_steps": 7,
            "speculative_num_draft_tokens": 8,
            "max_mamba_cache_size": 40,
            "disable_radix_cache": True,
            "max_running_requests": 32,
        },
        36,
        200,
        4096,
        False,
    ),
]
WINDOW_S, INTERVAL_S = 8.0, 0.2
MEASURE = {"step_s": 3.0, "settle": 0.5, "interval": 0.2, "drain_timeout": 20.0}


OUT = Path(__file__).resolve().parents[1] / "tests" / "unit" / "fixtures" / "throughput"


def mean_throughput(samples: list[dict[str, Any]]) -> float:
    values = [float(s["gen_throughput"]) for s in samples if s.get("gen_throughput")]
    return sum(values) / len(values)


def run(host: sf.SimHost, index: int, scenario: tuple[str, dict[str, Any], int, int, int, bool]) -> dict[str, Any]:
    name, args, sent, prompt, max_new, follows = scenario
    before = host.launch(2 * index, args).wait_ready()
    load = before.load(sent, prompt, max_new)
    obs = before.observation()
    eff = int(obs["server_info"]["internal_states"][0]["effective_max_running_requests_per_dp"])
    before.wait_running(1)
    time.sleep(1.5)  # the batch fills, the gauges catch up with it
    obs["samples"] = before.window(WINDOW_S, INTERVAL_S)
    load.stop()
    obs.update(before.measure(MEASURE, eff, obs["samples"]))
    if follows:
        capacity = math.ceil(eff * 1.25)
        obs["clients"] = [
            {
                "unit": "gen.service",
                "url": "u",
                "capacity": capacity,
                "in_flight": capacity,
                "follows_server": True,
                "factor": 1.25,
            }
        ]
    instance = {"name": name, "version": "0.5.23", "args": args, "gpus": [2 * index]}
    gpus = {str(2 * index): {"total_mib": sf.B200_MIB, "used_mib_max": host.gpu_used_mib(2 * index)}}
    advice = _advisor.advise_instance(
        _advice_evidence.evidence_from_observation("sim", instance, obs, gpus, WINDOW_S, INTERVAL_S)
    )
    out: dict[str, Any] = {"name": name, "diagnosis": advice.diagnosis, "advice": advice}
    out["record"] = {
        "scenario": name,
        "recorded_by": "tools/record_throughput_fixtures.py (the GPU simulator, tests/doubles/gpusim, 0.5.23, B200)",
        "instance": instance,
        "gpus": gpus,
        "window_s": WINDOW_S,
        "interval_s": INTERVAL_S,
        "sent": sent,
        "observation": obs,
    }
    before.stop()
    prop = advice.proposal
    if prop is None:
        return out
    after_args = {**args, **{k: v[1] for k, v in prop.changes.items()}}
    after_sent = sent
    if prop.client_changes:
        after_sent = math.ceil(eff * float(prop.client_changes["generation_concurrency_factor"]))
    elif follows:
        after_sent = math.ceil((prop.effective_max_after or eff) * 1.25)
    after = host.launch(2 * index + 1, after_args).wait_ready()
    load = after.load(after_sent, prompt, max_new)
    after.wait_running(1)
    time.sleep(1.5)
    after_samples = after.window(WINDOW_S, INTERVAL_S)
    measured = mean_throughput(after_samples) / mean_throughput(obs["samples"])
    out["record"]["after"] = {"args": after_args, "sent": after_sent, "samples": after_samples}
    load.stop()
    after.stop()
    out.update(predicted=prop.throughput_factor_expected, measured=measured, model=prop.throughput_model)
    return out


def main() -> int:
    import tempfile  # noqa: PLC0415

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, sf.sim_host(Path(tmp) / "sim", 2 * len(SCENARIOS)) as host:
        for index, scenario in enumerate(SCENARIOS):
            got = run(host, index, scenario)
            (OUT / f"{got['name']}.json").write_text(json.dumps(got["record"], indent=1, sort_keys=True) + "\n")
            print(got["name"], got["diagnosis"], "predicted", got.get("predicted"), "measured", got.get("measured"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
