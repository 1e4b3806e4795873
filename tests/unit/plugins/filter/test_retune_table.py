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
