"""retune.yml --check predicts the effective max running requests after a relaunch
(plugin_utils/_retune/predict.py): the model facts of the running instance (its startup journal
lines, read by the inspect phase in check mode, and /server_info) and SGLang's memory math. The
instance's evidence is what the GPU simulator prints and serves (``simulate`` of
tests/unit/plugins/support/simulated_instance.py), so a prediction is checked against what the
simulator would start with."""

from __future__ import annotations

from typing import Any

from simulated_instance import B200, FIRST_TUNING, simulate

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.model_facts import JOURNAL_PATTERN
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.flow import Options, Retune
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.predict import predict_after

NEW = {
    **FIRST_TUNING,
    "max_mamba_cache_size": 156,
    "mem_fraction_static": 0.93,
    "max_running_requests": 52,
    "mamba_radix_cache_strategy": "no_buffer",
    "disable_overlap_schedule": True,
}


def instance(args: dict[str, Any], version: str = "0.5.23") -> dict[str, Any]:
    return {
        "name": "gpu0",
        "unit": "sglang-gpu0.service",
        "gpus": [0],
        "port": 30000,
        "container": None,
        "version": version,
        "args": args,
        "env": {},
        "argv": ["/py", "-m", "sglang.launch_server", "--port", "30000"],
        "expected_server_info": {"max_mamba_cache_size": args.get("max_mamba_cache_size")},
        "fingerprint": "fp-new",
    }


def running_facts(journal: list[str] | None, info: dict[str, Any], **more: Any) -> dict[str, Any]:
    facts = {
        "name": "gpu0",
        "running": True,
        "main_pid": 1000,
        "invocation_id": "inv-1",
        "argv": ["/py", "-m", "sglang.launch_server", "--port", "30000", "--max-mamba-cache-size", "80"],
        "argv_matches": False,
        "env_mismatches": {},
        "health_status": 200,
        "server_info_status": 200,
        "server_info": info,
        "effective_max_running_requests": info["internal_states"][0]["effective_max_running_requests_per_dp"],
        "installed_fingerprint": "fp-new",
        "has_last_good": True,
        "gpu_used_mib": {"0": 158989},
        "foreign": [],
        **more,
    }
    if journal is not None:
        facts["journal"] = journal
    return facts


class Host:
    def __init__(self, facts: dict[str, Any]):
        self.facts = facts
        self.options: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, op: str, instances: list[dict[str, Any]], options: dict[str, Any]) -> dict[str, Any]:
        self.options.append((op, dict(options)))
        assert op == "inspect", op
        # As the retune_phase module returns it: the agent's GPUs under its container's key.
        gpus = {"0": {"total_mib": B200, "used_mib": 158989}}
        return {"instances": {"gpu0": self.facts}, "containers": {"host": {"gpus": gpus}}}


def check(facts: dict[str, Any], args: dict[str, Any], check_mode: bool = True) -> tuple[dict[str, Any], Host]:
    host = Host(facts)
    out = Retune([instance(args)], Options(client_units=[]), host, check_mode=check_mode).run()
    return out["instances"][0], host


def test_check_mode_predicts_the_b200_retune_as_the_simulator_would_start_it() -> None:
    journal, info, before, _used = simulate(FIRST_TUNING, 0.854)
    assert before.max_running == 16
    _j, _i, after, _u = simulate({k: v for k, v in NEW.items() if k != "mem_fraction_static"}, 0.93)
    result, host = check(running_facts(journal, info), NEW)
    assert host.options[0][0] == "inspect" and host.options[0][1]["startup_journal"] == "all"
    assert host.options[0][1]["journal_pattern"] == JOURNAL_PATTERN  # the parser's lines, named once
    assert result["action"] == "would_relaunch"
    assert result["effective_max_running_requests_before"] == 16
    assert result["predicted_effective_max_running_requests"] == after.max_running == 52
    assert result["prediction_missing"] is None
    assert result["prediction"]["binding"] in ("mamba", "requested")


def test_the_same_settings_predict_what_the_instance_reports() -> None:
    """The arithmetic reproduces the running instance when the settings do not change."""
    journal, info, before, _used = simulate(FIRST_TUNING, 0.854)
    result = predict_after(
        instance({**FIRST_TUNING, "mem_fraction_static": 0.854}),
        running_facts(journal, info),
        {"0": {"total_mib": B200}},
    )
    assert result["predicted_effective_max_running_requests"] == before.max_running


def test_a_hybrid_model_without_its_journal_keeps_the_dash_and_says_journal() -> None:
    _journal, info, _plan, _used = simulate(FIRST_TUNING, 0.854)
    result, _host = check(running_facts(None, info, journal_error="journalctl: rc=1"), NEW)
    assert result["predicted_effective_max_running_requests"] is None
    assert result["prediction_missing"] == "journal"
    assert "Mamba Cache is allocated" in result["prediction"]["why"]


def test_a_plain_model_without_memory_usage_or_journal_says_facts_or_journal() -> None:
    info = {"max_total_num_tokens": 500000, "internal_states": [{"effective_max_running_requests_per_dp": 40}]}
    assert predict_after(instance({}), running_facts([], info), {"0": {"total_mib": B200}})["prediction_missing"] == (
        "journal"
    )
    assert (
        predict_after(instance({}), running_facts(["unrelated"], info), {"0": {"total_mib": B200}})[
            "prediction_missing"
        ]
        == "facts"
    )
    assert predict_after(instance({}), running_facts([], info), {})["prediction_missing"] == "gpu"
    assert predict_after(instance({}), {"running": False}, {})["prediction_missing"] == "down"


def test_settings_that_would_not_start_say_unfit() -> None:
    journal, info, _plan, _used = simulate(FIRST_TUNING, 0.854)
    result = predict_after(
        instance({**FIRST_TUNING, "max_mamba_cache_size": 100000}),
        running_facts(journal, info),
        {"0": {"total_mib": B200}},
    )
    assert result["prediction_missing"] == "unfit"
    assert result["prediction"]["why"].startswith("would not fit")
