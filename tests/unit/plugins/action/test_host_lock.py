"""The host_lock action: the run's identity from the controller, the take-over of a lease whose
holder is a dead process of this same controller, and the fact it leaves for later tasks."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import pytest
from ansible.playbook.task import Task

from ansible_collections.sglang_ops.fleet.plugins.action.host_lock import ActionModule
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.run_identity import (
    controller_identity,
    holder_is_dead_here,
)


def make_action(args: dict[str, Any]) -> ActionModule:
    task = MagicMock(Task)
    task.args = args
    task.check_mode = False
    task.diff = False
    task.async_val = 0
    task.action = "sglang_ops.fleet.host_lock"
    return ActionModule(task, MagicMock(), MagicMock(), loader=None, templar=None, shared_loader_obj=None)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_one_run_one_id_on_every_host_and_task() -> None:
    a, b = controller_identity(60), controller_identity(60)
    assert a["run_id"] == b["run_id"] and a["controller_pid"] == os.getppid()
    other = controller_identity(60, pid=os.getpid())
    assert other["run_id"] != a["run_id"]
    assert a["started_at"].endswith("Z") and a["controller"] == socket.gethostname()


def test_a_holder_is_dead_only_if_it_ran_here_and_its_process_is_gone() -> None:
    me = controller_identity(60, pid=os.getpid())
    assert not holder_is_dead_here(me)
    assert holder_is_dead_here(dict(me, controller_pid=dead_pid()))
    assert holder_is_dead_here(dict(me, controller_pid_starttime=1))  # the PID is another process now
    assert not holder_is_dead_here(dict(me, controller_pid=dead_pid(), controller="another-controller"))


def test_without_procfs_only_a_gone_pid_is_dead(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A controller without /proc (macOS) has no start times: a live holder is never taken over."""
    from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune import run_identity as _run_identity  # noqa: PLC0415

    monkeypatch.setattr(_run_identity, "PROC_SELF", str(tmp_path / "no-proc"))
    me = dict(controller_identity(60, pid=os.getpid()), controller_pid_starttime=None)
    assert not holder_is_dead_here(me)
    assert holder_is_dead_here(dict(me, controller_pid=dead_pid()))


def test_a_lease_left_by_a_dead_run_of_this_controller_is_taken_over_at_once() -> None:
    holder = dict(controller_identity(60, pid=os.getpid()), run_id="crashed", controller_pid=dead_pid())
    calls: list[dict[str, Any]] = []

    def execute(module_name: str, module_args: dict[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        assert module_name == "sglang_ops.fleet.host_lock_lease"
        calls.append(module_args)
        if "take_over" not in module_args:
            return {"failed": True, "msg": "the host is locked by run crashed", "holder": holder}
        return {"changed": False, "lock": dict(module_args["identity"]), "took_over": holder}

    action = make_action({})
    action._execute_module = execute
    result = action.run(task_vars={"inventory_hostname": "gpu-a"})
    assert [c.get("take_over") for c in calls] == [None, "crashed"]
    assert not result.get("failed")
    assert result["ansible_facts"]["sglang_fleet_lock"]["run_id"] == calls[0]["identity"]["run_id"]
    assert "took over the host lock left by run crashed" in result["warnings"][0]


def test_a_live_holder_fails_the_task_naming_it_and_nothing_is_taken() -> None:
    holder = dict(controller_identity(60, pid=os.getpid()), run_id="alive")
    calls: list[dict[str, Any]] = []

    def execute(module_name: str, module_args: dict[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        calls.append(module_args)
        return {"failed": True, "msg": "the host is locked by run alive (user x)", "holder": holder}

    action = make_action({"ttl": 600})
    action._execute_module = execute
    result = action.run(task_vars={})
    assert len(calls) == 1 and calls[0]["identity"]["ttl_s"] == 600
    assert (
        result["failed"]
        and result["msg"] == "the host is locked by run alive (user x); nothing was touched on this host"
    )
    assert "ansible_facts" not in result


def test_a_held_lease_is_waited_for_until_it_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    from ansible_collections.sglang_ops.fleet.plugins.action import host_lock  # noqa: PLC0415

    monkeypatch.setattr(host_lock, "WAIT_INTERVAL", 0.01)
    holder = dict(controller_identity(60, pid=os.getpid()), run_id="alive")
    calls: list[dict[str, Any]] = []

    def execute(module_name: str, module_args: dict[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        calls.append(module_args)
        if len(calls) < 3:
            return {"failed": True, "msg": "the host is locked by run alive", "holder": holder}
        return {"changed": False, "lock": dict(module_args["identity"])}

    action = make_action({"wait": 30})
    action._execute_module = execute
    result = action.run(task_vars={})
    assert len(calls) == 3 and not result.get("failed")
    assert result["ansible_facts"]["sglang_fleet_lock"]["run_id"] == calls[0]["identity"]["run_id"]
    assert all("take_over" not in c for c in calls)  # a live holder is waited for, never taken over


def test_the_wait_ends_naming_the_holder_and_how_long_it_waited(monkeypatch: pytest.MonkeyPatch) -> None:
    from ansible_collections.sglang_ops.fleet.plugins.action import host_lock  # noqa: PLC0415

    monkeypatch.setattr(host_lock, "WAIT_INTERVAL", 0.05)
    holder = dict(controller_identity(60, pid=os.getpid()), run_id="alive")
    calls: list[dict[str, Any]] = []

    def execute(module_name: str, module_args: dict[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        calls.append(module_args)
        return {"failed": True, "msg": "the host is locked by run alive (user x)", "holder": holder}

    action = make_action({"wait": 1})
    action._execute_module = execute
    result = action.run(task_vars={})
    assert result["failed"] and "ansible_facts" not in result
    assert result["msg"].startswith("the host is locked by run alive (user x); waited ")
    assert result["msg"].endswith("s; nothing was touched on this host")
    assert 5 <= len(calls) <= 30  # tried again every interval, for about a second


def test_a_failure_without_a_holder_is_not_waited_for() -> None:
    calls: list[dict[str, Any]] = []

    def execute(module_name: str, module_args: dict[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        calls.append(module_args)
        return {"failed": True, "msg": "could not get flock on /run/sglang-fleet/host.lock within 10s"}

    action = make_action({"wait": 600})
    action._execute_module = execute
    result = action.run(task_vars={})
    assert len(calls) == 1 and result["failed"]
