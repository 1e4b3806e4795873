"""The summary table retune.yml prints, whatever happened on each host."""

from __future__ import annotations

from ansible_collections.sglang_ops.fleet.plugins.filter.retune_table import retune_table


def _rows(lines: list[str]) -> dict[str, str]:
    return {line.split()[0]: line for line in lines[2:]}


def test_one_line_per_instance_and_per_host_without_instances() -> None:
    hostvars = {
        "a": {
            "sglang_retune_result": {
                "instances": [
                    {
                        "name": "gpu0",
                        "action": "rolled_back",
                        "effective_max_running_requests_before": 16,
                        "effective_max_running_requests_after": 16,
                        "time_to_dead_s": 0.7,
                        "msg": "new settings failed (crashed while starting); rolled back",
                    },
                    {
                        "name": "gpu1",
                        "action": "relaunched",
                        "effective_max_running_requests_before": 16,
                        "effective_max_running_requests_after": 40,
                        "time_to_healthy_s": 2.5,
                        "flag_diff": {"changed": {"--max-mamba-cache-size": [80, 200]}, "added": {}, "removed": {}},
                    },
                ]
            }
        },
        "b": {"sglang_retune_result": {"skipped": True, "msg": "not retuned: canary host(s) a failed"}},
        "c": {"sglang_retune_result": {"failed": True, "msg": "Pause the generation clients: unit not found"}},
        "d": {},
    }
    lines = retune_table(hostvars, ["a", "b", "c", "d"])
    assert lines[0].split()[:2] == ["instance", "action"] and set(lines[1]) == {"-"}
    rows = _rows(lines)
    assert rows["a/gpu0"].split()[1:5] == ["rolled_back", "16", "->", "16"]
    assert "crashed while starting" in rows["a/gpu0"]
    assert rows["a/gpu1"].split()[1:5] == ["relaunched", "16", "->", "40"]
    assert rows["a/gpu1"].endswith("--max-mamba-cache-size 80->200")
    assert rows["b"].split()[1] == "skipped" and rows["b"].endswith("not retuned: canary host(s) a failed")
    assert rows["c"].split()[1] == "failed" and "unit not found" in rows["c"]
    assert rows["d"].split()[1:3] == ["not", "run"]


def test_processes_killed_by_pid_are_named_under_their_instance() -> None:
    """A started instance whose way was cleared by killing an orphaned scheduler says so: PID,
    command line, signals and why, one line each, under the instance's row."""
    killed = [
        {
            "pid": 4242,
            "signal": "SIGTERM",
            "cmdline": ["sglang::scheduler_TP0"],
            "reason": "SGLang process outside the unit holding GPU [0]",
        },
        {
            "pid": 4242,
            "signal": "SIGKILL",
            "cmdline": ["sglang::scheduler_TP0"],
            "reason": "SGLang process outside the unit holding GPU [0]",
        },
        {"pid": 4300, "signal": "SIGTERM", "cmdline": "python3 -m sglang.launch_server --port 30000", "reason": "x"},
    ]
    hostvars = {"a": {"sglang_retune_result": {"instances": [{"name": "gpu0", "action": "started", "killed": killed}]}}}
    lines = retune_table(hostvars, ["a"])
    row = next(i for i, line in enumerate(lines) if line.startswith("a/gpu0"))
    assert lines[row].split()[1] == "started"
    assert lines[row + 1].strip() == (
        "killed PID 4242 (sglang::scheduler_TP0) with SIGTERM, then SIGKILL: "
        "SGLang process outside the unit holding GPU [0]"
    )
    assert "killed PID 4300 (python3 -m sglang.launch_server --port 30000) with SIGTERM: x" in lines[row + 2]
    assert len(lines) == row + 3


def test_each_generation_client_has_its_line_under_its_host() -> None:
    drained = (
        "client sglang-fleet-generate.service: drained per wave, never stopped "
        "(gpu0: 0.4 s, 0 abandoned; gpu1, gpu2, gpu3: 1.2 s, 0 abandoned)"
    )
    stopped = (
        "client other.service did not answer on /run/sglang-fleet/clients/other.service/control.sock "
        "(connection refused): stopped for the retune (312.4 s), started again"
    )
    hostvars = {
        "a": {
            "sglang_retune_result": {
                "instances": [{"name": "gpu0", "action": "relaunched"}],
                "notes": [drained, stopped],
                "clients_stopped": ["other.service"],
            }
        },
        "b": {
            "sglang_retune_result": {
                "failed": True,
                "msg": "the generation clients could not be found out",
                "instances": [],
                "notes": ["could not record last good settings: x"],
            }
        },
    }
    lines = retune_table(hostvars, ["a", "b"])
    row = next(i for i, line in enumerate(lines) if line.startswith("a/gpu0"))
    assert lines[row + 1].split()[:2] == ["a", "note"] and lines[row + 1].endswith(drained)
    assert lines[row + 2].split()[:2] == ["a", "note"] and lines[row + 2].endswith(stopped)
    assert lines[row + 3].split()[:2] == ["b", "failed"]
    assert lines[row + 4].split()[:2] == ["b", "note"] and lines[row + 4].endswith(
        "could not record last good settings: x"
    )
    assert len(lines) == row + 5


def test_check_mode_shows_the_predicted_capacity_after_or_why_not_in_one_word() -> None:
    """retune.yml --check: the effective max running requests predicted after the relaunch where
    "-" was, and "-" with why in one word when the facts are missing."""
    base = {"action": "would_relaunch", "effective_max_running_requests_before": 16}
    hostvars = {
        "a": {
            "sglang_retune_result": {
                "instances": [
                    {**base, "name": "gpu0", "predicted_effective_max_running_requests": 52},
                    {
                        **base,
                        "name": "gpu1",
                        "predicted_effective_max_running_requests": None,
                        "prediction_missing": "journal",
                    },
                    {**base, "name": "gpu2"},
                ]
            }
        }
    }
    rows = _rows(retune_table(hostvars, ["a"]))
    assert rows["a/gpu0"].split()[1:5] == ["would_relaunch", "16", "->", "52"]
    assert rows["a/gpu1"].split()[1:6] == ["would_relaunch", "16", "->", "-", "(journal)"]
    assert rows["a/gpu2"].split()[1:5] == ["would_relaunch", "16", "->", "-"]


def test_a_wedged_instance_is_named_with_what_hung_and_how_it_was_stopped() -> None:
    hung = "/server_info did not answer within 30s (it asks every scheduler: one is stuck or gone)"
    hostvars = {
        "a": {
            "sglang_retune_result": {
                "instances": [
                    {"name": "gpu1", "action": "relaunched", "escalated": True, "wedged": [hung]},
                    {"name": "gpu2", "action": "unhealthy", "wedged": [hung], "reasons": [f"wedged: {hung}: ..."]},
                    {"name": "gpu3", "action": "relaunched", "wedged": []},
                ]
            }
        }
    }
    rows = _rows(retune_table(hostvars, ["a"]))
    assert rows["a/gpu1"].split()[1] == "relaunched"
    assert "was wedged (/server_info did not answer within 30s" in rows["a/gpu1"]
    assert "SIGKILL after stop deadline" in rows["a/gpu1"]
    assert rows["a/gpu2"].split()[1] == "unhealthy" and rows["a/gpu2"].count("wedged") == 1
    assert "wedged" not in rows["a/gpu3"]
