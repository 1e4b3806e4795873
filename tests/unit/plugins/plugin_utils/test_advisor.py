"""The tuning advisor (plugin_utils/_advisor/diagnose.py): the diagnoses on synthetic observations, the
7 x B200 case of the real generation run, and every proposal checked against the simulator's
memory math (tests/doubles/gpusim memory.py, through tests/unit/plugins/support/simulated_instance.py:
the proposed settings start and give the predicted effective max running requests)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
import yaml
from simulated_instance import B200, FIRST_TUNING, H200, simulate

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor import diagnose as advisor
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor import patch as advice_patch
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor import report as advice_report
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.checks import validate_args
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.resolve import resolve_host

# FIRST_TUNING (simulated_instance): the 7 x B200 run's first tuning.
# inventories/example/host_vars/b200-node.yml: the retune the run made.
RETUNED = {
    **FIRST_TUNING,
    "max_mamba_cache_size": 200,
    "mamba_full_memory_ratio": 0.6,
    "mem_fraction_static": 0.93,
    "max_running_requests": 64,
}


def samples(
    n: int = 61,
    *,
    running: float,
    queue: float,
    token_usage: float,
    mamba_usage: float | None,
    gen: float,
    kv: int,
    release: str = "0.5.23",
) -> list[dict[str, Any]]:
    """The gauges as the release exports them: ``token_usage`` here is the KV cache's usage, which
    0.5.14+ export as ``full_token_usage``; their ``token_usage`` is the fullest pool
    (pool_stats_observer.get_max_pool_usage); 0.5.9's is the KV cache's."""
    out = []
    for i in range(n):
        s: dict[str, Any] = {
            "t": 5.0 * i,
            "num_running_reqs": running,
            "num_queue_reqs": queue,
            "token_usage": token_usage,
            "num_used_tokens": round(token_usage * kv),
            "gen_throughput": gen,
            "generation_tokens_total": 1.0e6 + gen * 5.0 * i,
            "max_total_num_tokens": kv,
        }
        if mamba_usage is not None:
            s["mamba_usage"] = mamba_usage
        if release != "0.5.9":
            s["full_token_usage"] = token_usage
            s["token_usage"] = round(max(token_usage, mamba_usage or 0.0), 2)
        out.append(s)
    return out


def evidence(
    args: dict[str, Any],
    mfs: float,
    *,
    running: float | None = None,
    queue: float,
    token_usage: float,
    mamba_usage: float | None = None,
    gen: float = 1200.0,
    release: str = "0.5.23",
    profile: str = "qwen3.6-27b",
    gpu: int = B200,
    name: str = "gpu0",
    gpu_used: int | None = -1,
) -> advisor.Evidence:
    journal, info, plan, used = simulate(args, mfs, release, profile, gpu)
    eff = plan.max_running
    run = eff if running is None else running
    if mamba_usage is None and plan.mamba_k:
        # Occupancy: each running request holds its working slot and extra_buffer's tracking
        # slots (5 per request reserved with overlap on, 3 held), not the reserve the pool is sized by.
        held = plan.mamba_ratio - 2 if plan.mamba_ratio >= 3 else 1
        mamba_usage = round(run * held / plan.mamba_k, 2)
    observation = {
        "running": True,
        "server_info": info,
        "journal": journal,
        "samples": samples(
            running=run,
            queue=queue,
            token_usage=token_usage,
            mamba_usage=mamba_usage,
            gen=gen,
            kv=plan.kv_tokens,
            release=release,
        ),
    }
    return advisor.Evidence(
        host="b200-node",
        name=name,
        release=release,
        flag_table=release,
        args=args,
        observation=observation,
        gpu_total_mib=gpu,
        gpu_used_mib_max=used if gpu_used == -1 else gpu_used,
        window_s=300,
        interval_s=5,
    )


def all_proposals(advice: advisor.InstanceAdvice) -> list[advisor.Proposal]:
    return [p for p in [advice.proposal, *advice.alternatives] if p is not None]


def applied(args: dict[str, Any], mfs: float, proposal: advisor.Proposal) -> tuple[dict[str, Any], float]:
    new = dict(args)
    for key, (_old, value) in proposal.changes.items():
        if key != "mem_fraction_static":
            new[key] = value
    return new, float(proposal.changes.get("mem_fraction_static", [None, mfs])[1])


def test_the_b200_run_is_mamba_bound_and_gets_more_slots_within_memory() -> None:
    ev = evidence(FIRST_TUNING, 0.854, queue=240, token_usage=0.03)
    advice = advisor.advise_instance(ev)
    assert advice.diagnosis == advisor.MAMBA_BOUND
    assert advice.model_check is True and advice.problems == []
    assert advice.why[:4] == [
        "sglang:num_running_reqs = 16 = effective max 16 for 100% of the window",
        "sglang:num_queue_reqs mean 240 (max 240)",
        "sglang:mamba_usage 0.60 (occupancy of the Mamba pool)",
        "sglang:full_token_usage 0.03 (90th percentile 0.03)",
    ]
    assert (
        "/server_info effective_max_running_requests_per_dp 16 = max_mamba_cache_size 80 // 5 Mamba slots per "
        "running request (extra_buffer, overlap on, speculative decoding, 4 draft tokens)"
    ) in advice.why
    assert "GPU memory.used at most 158989 of 183359 MiB (nvidia-smi): 23.8 GiB idle" in advice.why
    proposal = advice.proposal
    assert proposal is not None and proposal.effective_max_before == 16
    assert proposal.effective_max_after is not None and proposal.effective_max_after > 16
    assert proposal.throughput_factor is not None and proposal.throughput_factor > 2
    more_slots = proposal.changes.get("max_mamba_cache_size", [80, 80])[1] > 80
    no_buffer = proposal.changes.get("mamba_radix_cache_strategy", [None, None])[1] == "no_buffer"
    assert more_slots or no_buffer
    assert proposal.changes.get("mem_fraction_static", [0, 0.93])[1] <= 0.93
    for prop in all_proposals(advice):
        # Every value is one SGLang 0.5.23 accepts...
        validate_args({k: v[1] for k, v in prop.changes.items()}, "0.5.23")
        # ...starts in the simulator, whose memory math gives the same effective max.
        new_args, new_mfs = applied(FIRST_TUNING, 0.854, prop)
        _unused, _unused, sim_plan, _unused = simulate(new_args, new_mfs)
        assert sim_plan.max_running == prop.effective_max_after
        assert sim_plan.kv_tokens == pytest.approx(prop.kv_tokens_after, rel=2e-3)
        # Never fewer KV tokens than one request of the full context.
        assert sim_plan.kv_tokens >= 262144
    # The real retune's shape (200 slots, 0.93) is among them: 16 -> 40.
    real = [p for p in all_proposals(advice) if set(p.changes) == {"max_mamba_cache_size", "mem_fraction_static"}]
    assert [
        (p.changes["max_mamba_cache_size"][1], p.changes["mem_fraction_static"][1], p.effective_max_after) for p in real
    ] == [(200, 0.93, 40)]


def test_a_running_gauge_dipping_between_admissions_with_a_queue_is_still_at_the_max() -> None:
    """SGLang's running gauge dips between a request's end and the next batch's admission: short
    completions make it read 14-15 of 16 in a quarter of the samples while requests wait. With a
    queue refilling those slots the server is at its max: Mamba-bound, not client-bound."""
    ev = evidence(FIRST_TUNING, 0.854, queue=4, token_usage=0.03)
    for i, sample in enumerate(ev.observation["samples"]):
        if i % 4 == 0:
            sample["num_running_reqs"] = 14
    advice = advisor.advise_instance(ev)
    assert advice.diagnosis == advisor.MAMBA_BOUND
    assert advice.why[0] == (
        "sglang:num_running_reqs = 16 = effective max 16 for 100% of the window "
        "(26% just below it, the queue refilling slots freed by finished requests)"
    )
    # Without the queue the same dips are a server below its max: not pinned.
    for sample in ev.observation["samples"]:
        sample["num_queue_reqs"] = 0
    assert advisor.advise_instance(ev).diagnosis != advisor.MAMBA_BOUND


def test_the_b200_report_and_patch_for_the_fleet() -> None:
    advices = [
        advisor.advise_instance(evidence(FIRST_TUNING, 0.854, queue=240, token_usage=0.03, name=f"gpu{i}")).to_dict()
        for i in range(7)
    ]
    inventory = {"b200-node": {"sglang_server_host_args": dict(FIRST_TUNING)}}
    report = advice_report.fleet_report(advices, inventory, {"window_s": 300, "interval_s": 5})
    assert report["diagnoses"] == {"mamba-bound": 7}
    (group,) = report["groups"]
    assert group["label"] == "b200-node/gpu0,gpu1,gpu2,gpu3,gpu4,gpu5,gpu6"
    text = advice_report.report_text(report, "advice/sglang-fleet-advice.yml")
    assert "b200-node/gpu0,gpu1,gpu2,gpu3,gpu4,gpu5,gpu6 (7 instances, SGLang 0.5.23): MAMBA-BOUND" in text
    assert "  why: sglang:num_running_reqs = 16 = effective max 16 for 100% of the window" in text
    assert "predicted: effective max running requests 16 -> " in text
    assert text.rstrip().endswith(
        "patch: advice/sglang-fleet-advice.yml (review it, copy it into the inventory, then "
        "ansible-playbook retune.yml --check --diff)"
    )
    patch_text = advice_patch.patch_yaml(report)
    patch = yaml.safe_load(patch_text)
    host_args = patch["host_vars"]["b200-node"]["sglang_server_host_args"]
    changes = group["proposal"]["changes"]
    # The whole host layer (Ansible replaces a dict), with the changes.
    assert host_args == {**FIRST_TUNING, **{k: v[1] for k, v in changes.items()}}
    assert patch["group_vars"] == {}
    assert f"max_mamba_cache_size: {changes['max_mamba_cache_size'][1]}  # was 80" in patch_text
    json.dumps(report)  # all of it is data


def test_a_kv_bound_instance_gets_no_more_mamba_slots() -> None:
    # 200 slots at SGLang's default fraction: the KV cache (75k tokens) fills first.
    args = {**FIRST_TUNING, "max_mamba_cache_size": 200}
    ev = evidence(args, 0.854, running=30, queue=100, token_usage=0.95, gpu_used=B200 - 24370)
    advice = advisor.advise_instance(ev)
    assert advice.diagnosis == advisor.KV_BOUND
    assert "the KV cache is nearly full (sglang:full_token_usage >= 0.9)" in advice.why
    proposals = all_proposals(advice)
    assert proposals
    for prop in proposals:
        assert prop.changes.get("max_mamba_cache_size", [200, 200])[1] <= 200
        assert "mamba_radix_cache_strategy" not in prop.changes
        assert prop.kv_tokens_after is not None and prop.kv_tokens_after > 75000
        new_args, new_mfs = applied(args, 0.854, prop)
        _unused, _unused, sim_plan, _unused = simulate(new_args, new_mfs)
        assert sim_plan.kv_tokens == pytest.approx(prop.kv_tokens_after, rel=2e-3)
    assert advice.proposal is not None and advice.proposal.changes["mem_fraction_static"][1] == 0.93


def test_at_equal_predicted_throughput_a_proposal_keeps_the_effective_max() -> None:
    # A small KV cache (fraction 0.36) filled by long prompts; the clients send 5. Fewer Mamba
    # slots (40 -> 25) and a higher fraction both predict the 5 running; only the fraction keeps
    # the effective max of 8 for when the clients send more.
    args = {"max_mamba_cache_size": 40, "mem_fraction_static": 0.36}
    ev = evidence(args, 0.36, running=3, queue=2, token_usage=0.95, gpu_used=68409)
    for i, sample in enumerate(ev.observation["samples"]):
        if i % 3 == 0:  # 4 running at times, 3 on average: the idle slots are cut to 5 x 5
            sample["num_running_reqs"], sample["num_queue_reqs"] = 4, 1
    advice = advisor.advise_instance(ev)
    assert advice.diagnosis == advisor.KV_BOUND
    prop = advice.proposal
    assert prop is not None and prop.effective_max_after is not None
    assert prop.effective_max_after >= prop.effective_max_before == 8, prop.changes
    assert "mem_fraction_static" in prop.changes


def test_a_client_bound_instance_gets_client_concurrency_only() -> None:
    ev = evidence(RETUNED, 0.93, running=12, queue=0, token_usage=0.02)
    advice = advisor.advise_instance(ev)
    assert advice.diagnosis == advisor.CLIENT_BOUND
    assert (
        advice.why[0] == "sglang:num_running_reqs mean 12 (max 12) of effective max 40; at the max for 0% of the window"
    )
    prop = advice.proposal
    assert prop is not None and prop.changes == {}
    assert prop.client_changes == {"generation_concurrency": "auto", "generation_concurrency_factor": 1.25}
    assert prop.throughput_factor == pytest.approx(40 / 12)
    report = advice_report.fleet_report([advice.to_dict()], {})
    assert report["patch"] == {
        "host_vars": {},
        "group_vars": {"generation": {"generation_concurrency": "auto", "generation_concurrency_factor": 1.25}},
    }
    assert "generation_concurrency_factor: 1.25" in advice_patch.patch_yaml(report)


def test_compute_bound_proposes_nothing() -> None:
    # Running at the max, but 256 running x 1 token per step is past the knee.
    plain = {"max_running_requests": 256, "enable_metrics": True}
    advice = advisor.advise_instance(evidence(plain, 0.903, queue=50, token_usage=0.4, profile="qwen3-8b", gpu=H200))
    assert advice.diagnosis == advisor.COMPUTE_BOUND and advice.proposal is None
    assert advice.why[-1] == (
        "256 running x 1 tokens per step >= 256: decode is past the point where more concurrency raises throughput"
    )
    # Just below the max, nothing waiting, memory to spare: no limit binds.
    advice = advisor.advise_instance(evidence(RETUNED, 0.93, running=38, queue=0, token_usage=0.1))
    assert advice.diagnosis == advisor.COMPUTE_BOUND and advice.proposal is None
    assert advice.why[-1] == "no memory limit binds: no tuning change is expected to help much"


def test_max_running_bound_raises_max_running_requests_within_the_kv_cache() -> None:
    plain = {"max_running_requests": 32, "enable_metrics": True}
    advice = advisor.advise_instance(evidence(plain, 0.903, queue=80, token_usage=0.05, profile="qwen3-8b", gpu=H200))
    assert advice.diagnosis == advisor.MAX_RUNNING_BOUND
    prop = advice.proposal
    assert prop is not None and set(prop.changes) == {"max_running_requests"}
    assert prop.changes["max_running_requests"] == [32, 256]
    _unused, _unused, sim_plan, _unused = simulate(
        {**plain, "max_running_requests": 256}, 0.903, profile="qwen3-8b", gpu=H200
    )
    assert sim_plan.max_running == prop.effective_max_after == 256


def test_a_dense_model_has_no_mamba_pool_to_show() -> None:
    """SGLang exports sglang:mamba_usage for a dense model too (at 0): the evidence does not name a
    Mamba pool the model does not have; a hybrid model's occupancy is shown."""
    plain = {"max_running_requests": 32, "enable_metrics": True}
    ev = evidence(plain, 0.903, queue=80, token_usage=0.05, mamba_usage=0.0, profile="qwen3-8b", gpu=H200)
    advice = advisor.advise_instance(ev)
    assert not [w for w in advice.why if "mamba" in w.lower()], advice.why
    hybrid = advisor.advise_instance(evidence(FIRST_TUNING, 0.854, queue=240, token_usage=0.03))
    assert [w for w in hybrid.why if w.startswith("sglang:mamba_usage")]


def test_without_gpu_evidence_the_memory_fraction_stays() -> None:
    advice = advisor.advise_instance(evidence(FIRST_TUNING, 0.854, queue=240, token_usage=0.03, gpu_used=None))
    assert advice.diagnosis == advisor.MAMBA_BOUND
    assert all("mem_fraction_static" not in p.changes for p in all_proposals(advice))
    assert advice.proposal is not None and advice.proposal.effective_max_after > 16


def test_policy_limits_the_memory_fraction() -> None:
    ev = evidence(FIRST_TUNING, 0.854, queue=240, token_usage=0.03)
    advice = advisor.advise_instance(ev, advisor.Policy(max_mem_fraction_static=0.9))
    assert {p.changes.get("mem_fraction_static", [0, 0.9])[1] for p in all_proposals(advice)} <= {0.9}


def test_on_0_5_9_the_strategy_is_no_choice_to_offer() -> None:
    # 0.5.9 resolves auto to no_buffer and, with speculative decoding, turns the radix cache off.
    args = {k: v for k, v in FIRST_TUNING.items() if k != "max_mamba_cache_size"}
    args["mamba_scheduler_strategy"] = "no_buffer"
    ev = evidence(args, 0.857, release="0.5.9", queue=100, token_usage=0.05)
    advice = advisor.advise_instance(ev)
    assert advice.model_check is True
    for prop in all_proposals(advice):
        assert not any(k.endswith("strategy") for k in prop.changes)
        validate_args({k: v[1] for k, v in prop.changes.items()}, "0.5.9")


def test_unknown_without_evidence() -> None:
    ev = advisor.Evidence(
        host="h",
        name="gpu0",
        release="0.5.23",
        flag_table="0.5.23",
        args={},
        observation={"server_info_error": "the unit is not running", "samples": []},
        gpu_total_mib=B200,
        gpu_used_mib_max=0,
    )
    advice = advisor.advise_instance(ev)
    assert advice.diagnosis == advisor.UNKNOWN and advice.why == ["no /server_info: the unit is not running"]
    ev2 = evidence(FIRST_TUNING, 0.854, queue=0, token_usage=0.0)
    observation = {**ev2.observation, "samples": [], "metrics_errors": ["/metrics answered 404: not found"]}
    advice = advisor.advise_instance(advisor.Evidence(**{**ev2.__dict__, "observation": observation}))
    assert advice.diagnosis == advisor.UNKNOWN
    assert advice.problems == ["/metrics answered 404: not found"]
    assert advice.why[0].startswith("0 metrics sample(s) with sglang:num_running_reqs")


def test_an_idle_window_is_no_evidence_and_predicts_no_gain() -> None:
    """Nothing ran and nothing waited: no limit was reached and there is no throughput to scale
    (a gain over 0 running requests came out as x4e9)."""
    ev = evidence(RETUNED, 0.93, running=0, queue=0, token_usage=0.0, gen=0.0)
    advice = advisor.advise_instance(ev)
    assert advice.diagnosis == advisor.UNKNOWN and advice.proposal is None
    assert advice.why == [
        "the window was idle: sglang:num_running_reqs and sglang:num_queue_reqs were 0 in all 61 samples; "
        "measure while the job sends requests"
    ]


def test_the_last_throughput_report_of_an_idle_server_is_no_production() -> None:
    """sglang:gen_throughput is the scheduler's last decode report: an idle server keeps showing it."""
    rows = [
        {"t": 0, "num_running_reqs": 16, "num_queue_reqs": 0, "gen_throughput": 900.0},
        {"t": 5, "num_running_reqs": 16, "num_queue_reqs": 0, "gen_throughput": 1100.0},
        {"t": 10, "num_running_reqs": 0, "num_queue_reqs": 0, "gen_throughput": 1100.0},
        {"t": 15, "num_running_reqs": 0, "num_queue_reqs": 0, "gen_throughput": 1100.0},
    ]
    assert advisor.window_stats(rows, 16, 100000).gen_throughput_mean == pytest.approx(1000.0)
    idle = [{**r, "num_running_reqs": 0} for r in rows]
    assert advisor.window_stats(idle, 16, 100000).gen_throughput_mean is None


def test_window_stats_read_like_a_dashboard() -> None:
    rows = [
        {"t": 0, "num_running_reqs": 16, "num_queue_reqs": 10, "token_usage": 0.02, "generation_tokens_total": 100},
        {"t": 5, "num_running_reqs": 16, "num_queue_reqs": 20, "token_usage": 0.04, "generation_tokens_total": 600},
        # A counter that went down: the server restarted, it counts from 0 again.
        {"t": 10, "num_running_reqs": 8, "num_queue_reqs": 0, "token_usage": 0.01, "generation_tokens_total": 50},
    ]
    stats = advisor.window_stats(rows, 16, 100000)
    assert stats.pinned_fraction == pytest.approx(2 / 3)
    assert (stats.running_mean, stats.queue_mean, stats.queue_max) == (pytest.approx(40 / 3), 10, 20)
    assert stats.generation_rate == pytest.approx((500 + 50) / 10)
    assert stats.tokens_per_request_p90 == pytest.approx(0.04 * 100000 / 16)
    assert stats.demand_mean == pytest.approx((26 + 36 + 8) / 3)


def _two_instances(gpu1_args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """gpu0 with the B200 run's proposal and gpu1 (its own args), on one host with its layout."""
    a = advisor.advise_instance(evidence(FIRST_TUNING, 0.854, queue=240, token_usage=0.03, name="gpu0")).to_dict()
    b = json.loads(json.dumps(a))
    b["name"] = "gpu1"
    layers = {
        "sglang_server_host_args": dict(FIRST_TUNING),
        "instances": [
            {"name": "gpu0", "gpus": [0], "port": 30000},
            {"name": "gpu1", "gpus": [1], "port": 30001, **({"args": dict(gpu1_args)} if gpu1_args else {})},
        ],
    }
    return a, b, {"b200-node": layers}


def test_a_host_whose_instances_agree_gets_its_host_layer() -> None:
    a, b, inventory = _two_instances({})
    patch, notes = advice_patch.build_patch([a, b], inventory)
    entry = patch["host_vars"]["b200-node"]
    assert set(entry) - {"_changes", "_previous", "_why"} == {"sglang_server_host_args"}
    assert entry["sglang_server_host_args"] == advice_patch.args_after(FIRST_TUNING, a["proposal"]["changes"])
    assert notes == []


def test_a_host_whose_instances_disagree_gets_each_proposal_in_its_own_args() -> None:
    a, b, inventory = _two_instances({"reasoning_parser": "qwen3", "max_mamba_cache_size": 90})
    b["proposal"]["changes"] = {"max_mamba_cache_size": [90, 120]}
    report = advice_report.fleet_report([a, b], inventory)
    (note,) = report["patch_notes"]
    assert note == (
        "b200-node: its instances got different proposals; gpu1 sets a changed key in its own args: the patch sets "
        "each proposal in its instance's own args (sglang_server_instances, the whole list)"
    )
    text = advice_patch.patch_yaml(report)
    written = yaml.safe_load(text)["host_vars"]["b200-node"]
    # Exactly the host's variable, nothing of the annotations: the block is the host's file.
    assert written == {
        "sglang_server_instances": [
            {"name": "gpu0", "gpus": [0], "port": 30000, "args": advice_patch.args_after({}, a["proposal"]["changes"])},
            {
                "name": "gpu1",
                "gpus": [1],
                "port": 30001,
                "args": {"reasoning_parser": "qwen3", "max_mamba_cache_size": 120},
            },
        ]
    }
    assert "          max_mamba_cache_size: 120  # was 90" in text
    slots = a["proposal"]["changes"]["max_mamba_cache_size"][1]
    assert f"          max_mamba_cache_size: {slots}  # added; the server ran 80" in text
    # advise --trial relaunches a canary with its own args after the proposal.
    assert [i.get("args_after") for i in report["instances"]] == [w["args"] for w in written["sglang_server_instances"]]


def test_an_instance_without_a_proposal_keeps_its_settings() -> None:
    a, b, inventory = _two_instances({})
    b["proposal"] = None
    patch, notes = advice_patch.build_patch([a, b], inventory)
    entries = patch["host_vars"]["b200-node"]["sglang_server_instances"]
    assert entries[1] == {"name": "gpu1", "gpus": [1], "port": 30001}
    assert entries[0]["args"] == advice_patch.args_after({}, a["proposal"]["changes"])
    assert notes[0].startswith("b200-node: gpu1 got none: the patch sets each proposal in its instance's own args")


def test_a_patch_for_instances_that_run_other_settings_than_the_inventory_sets_what_runs() -> None:
    # The inventory already holds another tuning (not retuned yet); the instances run the first.
    ev = evidence(FIRST_TUNING, 0.854, queue=4, token_usage=0.0)
    pending = {**FIRST_TUNING, "max_mamba_cache_size": 200, "mamba_full_memory_ratio": 0.6}
    advice = advisor.advise_instance(dataclasses.replace(ev, args=pending)).to_dict()
    assert advice["drift"] == {"max_mamba_cache_size": [200, 80], "mamba_full_memory_ratio": [0.6, 0.4]}
    changes = advice["proposal"]["changes"]
    assert "mamba_full_memory_ratio" not in changes  # computed with the 0.4 that runs
    report = advice_report.fleet_report([advice], {"b200-node": {"sglang_server_host_args": pending}})
    host_args = report["patch"]["host_vars"]["b200-node"]["sglang_server_host_args"]
    # The proposal, and the running ratio it was computed with - not the inventory's 0.6.
    assert host_args == {**pending, **{k: v[1] for k, v in changes.items()}, "mamba_full_memory_ratio": 0.4}
    (note,) = report["patch_notes"]
    assert note == (
        "b200-node: the instances do not run the inventory's mamba_full_memory_ratio, max_mamba_cache_size: the "
        "advice is for what runs, so the patch sets them back to the running values (retune first to advise on "
        "the inventory's)"
    )
    # Two hosts with the same note: one line naming both.
    twin = {**advice, "host": "b200-node-2"}
    inventory = {h: {"sglang_server_host_args": pending} for h in ("b200-node", "b200-node-2")}
    (note,) = advice_report.fleet_report([advice, twin], inventory)["patch_notes"]
    assert note.startswith("b200-node, b200-node-2: the instances do not run the inventory's")
    assert "      mamba_full_memory_ratio: 0.4  # was 0.6" in advice_patch.patch_yaml(report)


def test_args_after_removes_a_setting_set_back_to_sglangs_default() -> None:
    assert advice_patch.args_after({"a": 1, "b": 2}, {"a": [1, None], "c": [None, 3]}) == {"b": 2, "c": 3}


def test_clients_that_follow_the_servers_max_are_counted_at_the_new_max() -> None:
    # The demo fleet's first tuning: 16 running, the host's client sends 20 (auto concurrency,
    # x1.25), so 4 wait. Without the client's word the prediction stops at the 20 it sends now.
    ev = evidence(FIRST_TUNING, 0.854, queue=4, token_usage=0.0)
    blind = advisor.advise_instance(ev).proposal
    assert blind is not None and blind.throughput_factor == pytest.approx(20 / 16)
    client = {"unit": "gen.service", "url": "http://127.0.0.1:30000", "capacity": 20, "in_flight": 20, "factor": 1.25}
    follows = dataclasses.replace(ev, observation={**ev.observation, "clients": [{**client, "follows_server": True}]})
    prop = advisor.advise_instance(follows).proposal
    assert prop is not None and prop.effective_max_after is not None
    sends = math.ceil(prop.effective_max_after * 1.25)
    assert prop.throughput_factor == pytest.approx(min(prop.effective_max_after, 64) / 16, rel=0.06)
    assert any(
        n.startswith(
            f"the generation clients on the host will send {sends} requests at the new max (gen.service "
            "follows the server's max (auto concurrency x1.25)"
        )
        for n in prop.notes
    ), prop.notes
    # Expected: running requests x r give throughput x r^0.7 (the policy's measured scaling).
    ratio = min(prop.effective_max_after, 64) / 16
    overlap = 0.95 if "mamba_radix_cache_strategy" in prop.changes else 1.0
    assert prop.throughput_factor_expected == pytest.approx(ratio**0.7 * overlap, rel=0.06)
    data = advisor.advise_instance(follows).to_dict()
    text = advice_report.report_text(advice_report.fleet_report([data]))
    expected, most = data["proposal"]["throughput_factor_expected"], data["proposal"]["throughput_factor"]
    assert f"  throughput x{expected:.2f} expected (the documented exponent), x{most:.2f} at most (1200 -> ~" in text
    # A fixed concurrency of 20 stays 20 after the relaunch: the prediction counts 20 running.
    fixed = dataclasses.replace(ev, observation={**ev.observation, "clients": [{**client, "follows_server": False}]})
    prop = advisor.advise_instance(fixed).proposal
    assert prop is not None and prop.throughput_factor == pytest.approx(20 / 16)
    assert any("gen.service has a fixed concurrency of 20" in n and "keep at least" in n for n in prop.notes)
    # An older client that does not say: as without a client.
    older = dataclasses.replace(ev, observation={**ev.observation, "clients": [client]})
    assert advisor.advise_instance(older).proposal.throughput_factor == pytest.approx(20 / 16)  # type: ignore[union-attr]


def test_with_the_clients_sending_40_the_real_retune_comes_first() -> None:
    # 16 running + 24 queued: no change can run more than 40, so the least invasive way to 40 wins -
    # the retune the run made (docs/advisor.md says so).
    advice = advisor.advise_instance(evidence(FIRST_TUNING, 0.854, queue=24, token_usage=0.03))
    prop = advice.proposal
    assert prop is not None
    assert prop.changes == {"max_mamba_cache_size": [80, 200], "mem_fraction_static": [0.854, 0.93]}
    assert (prop.effective_max_after, prop.throughput_factor) == (40, 2.5)
    assert prop.notes[0].startswith("mem_fraction_static 0.93: 13.6 GiB more for the pools")


def test_an_instance_running_other_settings_than_the_inventory_is_advised_on_what_it_runs() -> None:
    # The inventory still has the first tuning (80 slots, ratio 0.4) while the instance runs the
    # retune (200 slots, 0.6, 0.93): an extra-vars override (advise --trial's canary, the advisor
    # scenario), or a retune not run since the inventory changed. The memory math must be done on
    # what it runs, and say so.
    ev = dataclasses.replace(evidence(RETUNED, 0.93, queue=24, token_usage=0.05), args=dict(FIRST_TUNING))
    advice = advisor.advise_instance(ev)
    assert advice.model_check is True
    assert (
        "/server_info effective_max_running_requests_per_dp 40 = max_mamba_cache_size 200 // 5 Mamba slots per "
        "running request (extra_buffer, overlap on, speculative decoding, 4 draft tokens)"
    ) in advice.why
    assert advice.problems == [
        "the instance runs max_mamba_cache_size 200, mamba_full_memory_ratio 0.6 where the inventory has 80, 0.4 "
        "(not relaunched since the inventory changed, or an override): the advice is for what it runs"
    ]
    assert advice.diagnosis == advisor.MAMBA_BOUND
    prop = advice.proposal
    assert prop is not None and prop.effective_max_before == 40
    assert prop.changes["max_mamba_cache_size"][0] == 200
    # Where the inventory and the server agree, nothing is said.
    assert advisor.running_drift(RETUNED, {"max_mamba_cache_size": 200, "mem_fraction_static": 0.93}) == {}


@pytest.mark.parametrize("release", ["0.5.14", "0.5.23"])
def test_a_no_buffer_proposal_turns_the_overlap_scheduler_off_and_counts_its_cost(release: str) -> None:
    """0.5.14+ refuse an explicit no_buffer with the overlap scheduler on (the release's
    mamba_hook / server_args assert): every proposal must start, so no_buffer comes with
    disable_overlap_schedule: true, and the overlap it turns off is counted."""
    ev = evidence(FIRST_TUNING, 0.854, queue=240, token_usage=0.03, release=release)
    advice = advisor.advise_instance(ev)
    proposals = all_proposals(advice)
    with_no_buffer = [
        p for p in proposals if p.changes.get("mamba_radix_cache_strategy", [None, None])[1] == "no_buffer"
    ]
    assert with_no_buffer, [p.changes for p in proposals]
    for prop in with_no_buffer:
        assert prop.changes["disable_overlap_schedule"] == [False, True]
        assert any("runs without SGLang's overlap scheduler (disable_overlap_schedule: true" in n for n in prop.notes)
    for prop in proposals:
        new_args, new_mfs = applied(FIRST_TUNING, 0.854, prop)
        hostvars = {
            "sglang_server_version": release,
            "sglang_server_model_path": "/models/qwen3.6-27b",
            "sglang_server_gpu_count": 1,
            "sglang_server_host_args": {**new_args, "mem_fraction_static": new_mfs},
        }
        assert resolve_host("b200-node", hostvars)


def test_on_0_5_14_plus_token_usage_is_the_fullest_pool_not_the_kv_cache() -> None:
    """A hybrid model at its Mamba cap: sglang:token_usage follows the Mamba pool (0.96), the KV
    cache (sglang:full_token_usage) is 3% used. It is Mamba-bound, not KV-bound."""
    ev = evidence(FIRST_TUNING, 0.854, queue=240, token_usage=0.03, mamba_usage=0.96)
    assert {s["token_usage"] for s in ev.observation["samples"]} == {0.96}
    advice = advisor.advise_instance(ev)
    assert advice.diagnosis == advisor.MAMBA_BOUND
    assert "sglang:full_token_usage 0.03 (90th percentile 0.03)" in advice.why


def test_the_mamba_cap_is_read_from_the_effective_max_not_from_occupancy() -> None:
    """At the cap, mamba_usage (occupancy) need not be near 1: the effective max against the
    running requests and the queue, with the arithmetic, say what caps it."""
    ev = evidence(FIRST_TUNING, 0.854, queue=240, token_usage=0.03, mamba_usage=0.55)
    advice = advisor.advise_instance(ev)
    assert advice.diagnosis == advisor.MAMBA_BOUND
    assert "sglang:mamba_usage 0.55 (occupancy of the Mamba pool)" in advice.why


def test_0_5_9_reads_kv_usage_from_token_usage() -> None:
    ev = evidence({**FIRST_TUNING}, 0.857, queue=10, token_usage=0.95, release="0.5.9")
    assert all("full_token_usage" not in s for s in ev.observation["samples"])
    stats = advisor.window_stats(ev.observation["samples"], 48, None, "sglang:token_usage")
    assert stats.kv_usage_metric == "sglang:token_usage"
    assert stats.kv_usage_mean == pytest.approx(0.95)


def test_no_proposal_turns_extra_buffer_lazy_on_without_the_overlap_scheduler() -> None:
    """SGLang 0.5.14+ asserts at pool sizing that the lazy extra buffer has the overlap scheduler
    (a relaunch would die after the old server is gone): the search refuses that candidate."""
    args = {**FIRST_TUNING, "mamba_radix_cache_strategy": "extra_buffer", "disable_overlap_schedule": True}
    advice = advisor.advise_instance(evidence(args, 0.854, queue=240, token_usage=0.03))
    assert advice.diagnosis == advisor.MAMBA_BOUND and all_proposals(advice)
    for prop in all_proposals(advice):
        after = {**args, **{k: v[1] for k, v in prop.changes.items()}}
        assert not (after["mamba_radix_cache_strategy"] == "extra_buffer_lazy" and after["disable_overlap_schedule"])
