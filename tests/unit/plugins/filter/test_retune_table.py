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
