"""The retune action plugin as its unit tests make it: one resolved instance, the facts its inspect
phase finds when the instance runs older settings, and the action with the connection patched (in
the manner of ansible-core's test_reboot.py)."""

from __future__ import annotations

from typing import Any
from unittest.mock import MagicMock

from ansible.playbook.task import Task

from ansible_collections.sglang_ops.fleet.plugins.action.retune import ActionModule

ARGV = ["/py", "-m", "sglang.launch_server", "--port", "30000", "--max-running-requests", "64"]


def resolved() -> list[dict[str, Any]]:
    return [
        {
            "name": "gpu0",
            "unit": "sglang-gpu0.service",
            "gpus": [0],
            "port": 30000,
            "container": None,
            "argv": ARGV,
            "env": {"CUDA_VISIBLE_DEVICES": "0"},
            "expected_server_info": {"max_running_requests": 64},
            "fingerprint": "fp1",
        }
    ]


def make_action(args: dict[str, Any], check_mode: bool = False, diff: bool = False) -> ActionModule:
    task = MagicMock(Task)
    task.args = args
    task.check_mode = check_mode
    task.diff = diff
    task.async_val = 0
    task.action = "sglang_ops.fleet.retune"
    connection = MagicMock()
    play_context = MagicMock()
    play_context.check_mode = check_mode
    return ActionModule(task, connection, play_context, loader=None, templar=None, shared_loader_obj=None)


FACTS_OLD = {
    "name": "gpu0",
    "running": True,
    "active_state": "active",
    "sub_state": "running",
    "main_pid": 4242,
    "invocation_id": "inv-a",
    "argv": ["/py", "-m", "sglang.launch_server", "--port", "30000", "--max-running-requests", "16"],
    "argv_matches": False,
    "env_mismatches": {},
    "health_status": 200,
    "server_info_status": 200,
    "server_info": {"max_running_requests": 16},
    "effective_max_running_requests": 16,
    "installed_fingerprint": "fp1",
    "has_last_good": True,
    "gpu_used_mib": {"0": 131000},
    "foreign": [],
}
