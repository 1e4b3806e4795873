"""The retune action plugin with the connection patched (in the manner of ansible-core's
test_reboot.py): the module executions it makes and the whole result it returns."""

from __future__ import annotations

from typing import Any
from unittest.mock import MagicMock

import pytest
from retune_action import ARGV, FACTS_OLD, make_action, resolved


def scripted(responses: dict[str, dict[str, Any]]):
    calls: list[dict[str, Any]] = []

    def execute_module(module_name: str, module_args: dict[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        assert module_name == "sglang_ops.fleet.retune_phase"
        calls.append(module_args)
        return responses[module_args["op"]]

    return execute_module, calls


CLIENT = "sglang-fleet-generate.service"
SOCK = f"/run/sglang-fleet/clients/{CLIENT}/control.sock"
URL = "http://127.0.0.1:30000"


def test_relaunch_whole_result() -> None:
    action = make_action({"instances": resolved(), "stop_timeout": 30, "smoke_requests": 3})
    execute, calls = scripted(
        {
            "inspect": {"instances": {"gpu0": FACTS_OLD}, "containers": {}},
            "clients": {
                "clients": {
                    CLIENT: {
                        "unit": CLIENT,
                        "running": True,
                        "answered": True,
                        "socket": SOCK,
                        "endpoints": [{"url": URL}],
                        "sends_to": {"gpu0": [URL]},
                    }
                }
            },
            "drain": {"clients": {CLIENT: {"ok": True, "drained": [URL], "abandoned": 0, "waited_s": 0.4}}},
            "stop": {"instances": {"gpu0": {"dead": True, "time_to_dead_s": 2.0, "killed": [], "escalated": False}}},
            "release": {
                "instances": {
                    "gpu0": {
                        "released": True,
                        "time_to_release_s": 4.25,
                        "used_mib": {"0": 0},
                        "used_mib_first": {"0": 120000},
                        "samples": 9,
                    }
                }
            },
            "start": {
                "instances": {
                    "gpu0": {
                        "started": True,
                        "healthy": True,
                        "new_main_pid": 5151,
                        "new_invocation_id": "inv-b",
                        "time_to_healthy_s": 12.5,
                        "effective_max_running_requests": 64,
                    }
                },
                # The wave healthy, the start phase handed its endpoints back itself (on the host).
                "containers": {
                    "host": {
                        "resumed": {
                            CLIENT: {
                                "ok": True,
                                "resumed": [URL],
                                "capacity": {URL: 64},
                                "service": {
                                    URL: {"in_service": True, "why": "completed 1 request(s) again", "waited_s": 0.5}
                                },
                            }
                        }
                    }
                },
            },
        }
    )
    action._execute_module = MagicMock(side_effect=execute)
    result = action.run(task_vars={"inventory_hostname": "node1", "sglang_fleet_lock": {"run_id": "run-1"}})
    assert [c["op"] for c in calls] == ["inspect", "clients", "drain", "stop", "release", "start"]
    assert calls[3]["options"]["stop_timeout"] == 30
    assert calls[5]["options"]["smoke_requests"] == 3
    assert calls[0]["managed_units"] == [{"unit": "sglang-gpu0.service", "container": None}]
    # The client operations prove the lease this run's, as every phase that acts.
    assert {c["lock_run_id"] for c in calls} == {"run-1"}
    assert calls[1]["options"]["client_units"] == [CLIENT]
    drain = calls[2]["options"]
    assert drain["clients"] == {CLIENT: [URL]}
    assert drain["client_drain_timeout"] == 120
    # The lease outlives the wave: the drain, then stop, kills, release, start and checks, twice (rollback).
    assert drain["lease"] == 120 + 2 * (30 + 20 + 300 + 3600 + 120 * 5) + 120
    assert calls[5]["options"]["resume_clients"] == {CLIENT: [URL]}
    assert calls[5]["options"]["client_confirm_timeout"] == 60 and calls[5]["options"]["client_keys"] is True
    elapsed = result.pop("elapsed")
    assert elapsed >= 0
    relaunch_s = result["instances"][0].pop("relaunch_s")
    assert 0 <= relaunch_s <= elapsed
    assert result == {
        "changed": True,
        "msg": "1 relaunched",
        "round_trips": {"inspect": 1, "clients": 1, "drain": 1, "stop": 1, "release": 1, "start": 1},
        "summary": {"relaunched": ["gpu0"]},
        "clients": [
            {
                "unit": CLIENT,
                "mode": "drained",
                "why": f"answers on {SOCK}, sends to gpu0",
                "sends_to": ["gpu0"],
                "waves": [
                    {
                        "instances": ["gpu0"],
                        "waited_s": 0.4,
                        "abandoned": 0,
                        "resumed_capacity": {URL: 64},
                        "back_s": 0.5,
                    }
                ],
            }
        ],
        "clients_stopped": [],
        "notes": [
            f"client {CLIENT}: drained per wave, never stopped (gpu0: 0.4 s, 0 abandoned, back in service in 0.5 s)"
        ],
        "instances": [
            {
                "name": "gpu0",
                "unit": "sglang-gpu0.service",
                "container": None,
                "port": 30000,
                "gpus": [0],
                "action": "relaunched",
                "reasons": [
                    "command line differs: --max-running-requests 16→64",
                    "/server_info reports other settings: max_running_requests=16 (desired 64)",
                ],
                "flag_diff": {"changed": {"--max-running-requests": ["16", "64"]}, "added": {}, "removed": {}},
                "state": "running",
                "old_main_pid": 4242,
                "old_invocation_id": "inv-a",
                "new_main_pid": 5151,
                "new_invocation_id": "inv-b",
                "gpu_memory_before_mib": {"0": 131000},
                "gpu_memory_released_mib": {"0": 0},
                "gpu_memory_after_dead_mib": {"0": 120000},
                "release_polls": 9,
                "effective_max_running_requests_before": 16,
                "effective_max_running_requests_after": 64,
                "time_to_dead_s": 2.0,
                "time_to_release_s": 4.25,
                "time_to_healthy_s": 12.5,
                "has_last_good": True,
                "running_argv": FACTS_OLD["argv"],
                "desired_argv": ARGV,
                "wedged": [],
                "escalated": False,
                "killed": [],
                "relaunch": {},
            }
        ],
    }


def test_check_mode_runs_only_inspect_and_returns_diff() -> None:
    action = make_action({"instances": resolved()}, check_mode=True, diff=True)
    execute, calls = scripted({"inspect": {"instances": {"gpu0": FACTS_OLD}}})
    action._execute_module = MagicMock(side_effect=execute)
    result = action.run(task_vars={})
    # Check mode asks nothing of the generation clients.
    assert [c["op"] for c in calls] == ["inspect"]
    assert (result["clients"], result["clients_stopped"]) == ([], [])
    assert result["changed"] is True
    assert result["instances"][0]["action"] == "would_relaunch"
    assert result["diff"] == [
        {
            "before_header": "gpu0 (running)",
            "after_header": "gpu0 (desired)",
            "before": "\n".join(FACTS_OLD["argv"]) + "\n",
            "after": "\n".join(ARGV) + "\n",
        }
    ]


def test_diff_is_dropped_without_diff_mode() -> None:
    action = make_action({"instances": resolved()}, check_mode=True, diff=False)
    execute, _unused = scripted({"inspect": {"instances": {"gpu0": FACTS_OLD}}})
    action._execute_module = MagicMock(side_effect=execute)
    assert "diff" not in action.run(task_vars={})


def test_unreachable_host_fails_without_touching_anything() -> None:
    action = make_action({"instances": resolved()})
    execute, calls = scripted({"inspect": {"unreachable": True, "msg": "Failed to connect to the host via ssh"}})
    action._execute_module = MagicMock(side_effect=execute)
    result = action.run(task_vars={})
    assert len(calls) == 1
    assert result["failed"] is True
    assert result["changed"] is False
    assert "Failed to connect" in result["msg"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ({"stop_timeout": 0}, "stop_timeout must be > 0"),
        ({"wave_size": -1}, "wave_size must be >= 0"),
        ({"client_drain_timeout": 0}, "client_drain_timeout must be > 0"),
        ({"canary": "gpu9"}, "canary 'gpu9' is not one of the instances"),
        ({"only": ["gpu7"]}, "only: unknown instance(s) ['gpu7']"),
    ],
)
def test_bad_arguments_fail_before_any_module_runs(args: dict[str, Any], needle: str) -> None:
    action = make_action({"instances": resolved(), **args})
    action._execute_module = MagicMock()
    result = action.run(task_vars={})
    assert result["failed"] is True
    assert needle in result["msg"]
    action._execute_module.assert_not_called()


def test_instances_must_be_resolved() -> None:
    action = make_action({"instances": [{"name": "gpu0"}]})
    action._execute_module = MagicMock()
    result = action.run(task_vars={})
    assert "lacks" in result["msg"]
    action._execute_module.assert_not_called()
