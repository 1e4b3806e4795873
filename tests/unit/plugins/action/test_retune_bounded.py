"""A host that stops answering mid-retune: each module execution of the retune action is bounded on
the controller by the deadline of what it asked for plus sglang_retune_call_margin. The connection
is patched with a call that hangs in a child process, as ssh or podman exec hang on a frozen host."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from typing import Any
from unittest.mock import MagicMock

import pytest
from ansible.errors import AnsibleConnectionFailure
from retune_action import FACTS_OLD, make_action, resolved

from ansible_collections.sglang_ops.fleet.plugins.action.retune import ActionModule
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.bounded import CallTimedOut, bounded, children
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.options import Options, call_deadline

# Deadlines of a fraction of a second: the stop phase's is 0.1 + 4 x 0.1 + 0.2 + 2 x 2 x 0.05 s.
FAST = {
    "stop_timeout": 0.1,
    "kill_timeout": 0.1,
    "release_timeout": 0.2,
    "nvidia_smi_timeout": 0.05,
    "http_timeout": 0.05,
    "stall_probe_s": 0.0,
    "call_margin": 0.5,
    "client_units": [],
}
STOP_BOUND = 0.1 + 4 * 0.1 + 0.2 + 4 * 0.05 + 0.5


class FrozenHost:
    """The connection: inspect answers; the stop phase's ``podman exec`` (a child process)
    answers after ``freeze_s`` seconds, or never."""

    def __init__(self, freeze_s: float | None):
        self.freeze_s = freeze_s
        self.ops: list[str] = []
        self.child: subprocess.Popen[bytes] | None = None

    def __call__(self, module_name: str, module_args: dict[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        op = module_args["op"]
        self.ops.append(op)
        if op == "inspect":
            return {"instances": {"gpu0": FACTS_OLD}}
        if op == "stop":
            self.child = subprocess.Popen(["sleep", "600" if self.freeze_s is None else str(self.freeze_s)])
            self.child.communicate()
            return {"instances": {"gpu0": {"dead": True, "time_to_dead_s": 0.1, "killed": [], "escalated": False}}}
        if op == "release":
            return {"instances": {"gpu0": {"released": True, "time_to_release_s": 0.1, "used_mib": {"0": 0}}}}
        if op == "start":
            return {"instances": {"gpu0": {"started": True, "healthy": True, "new_main_pid": 5151}}}
        raise AssertionError(op)


def run_retune(host: FrozenHost) -> tuple[ActionModule, dict[str, Any], float]:
    action = make_action({"instances": resolved(), **FAST})
    action._execute_module = MagicMock(side_effect=host)
    t0 = time.monotonic()
    result = action.run(task_vars={"inventory_hostname": "node1"})
    return action, result, time.monotonic() - t0


def test_a_host_frozen_mid_stop_is_lost_within_the_bound_and_its_call_killed() -> None:
    host = FrozenHost(freeze_s=None)
    action, result, took = run_retune(host)
    assert STOP_BOUND - 0.05 <= took < STOP_BOUND + 3
    assert host.ops == ["inspect", "stop"]
    # The hung child (ssh, podman exec) is killed and reaped: nothing keeps the run waiting.
    assert host.child is not None
    with pytest.raises(ProcessLookupError):
        os.kill(host.child.pid, 0)
    action._connection.close.assert_called_once_with()
    action._connection.reset.assert_not_called()
    assert result["failed"] is True
    lost = result["host_lost"]
    assert (lost["phase"], lost["instances"], lost["margin_s"]) == ("stop", ["gpu0"], 0.5)
    assert lost["bound_s"] == pytest.approx(STOP_BOUND)
    assert lost["waited_s"] >= STOP_BOUND - 0.05
    assert result["msg"].startswith("HOST LOST: no answer to the stop phase of gpu0 within 1.4s (its deadline 0.9s")
    (r,) = result["instances"]
    assert (r["action"], r["state"]) == ("failed", "unknown")
    assert r["msg"].startswith("stop sent, not proven dead")
    # No alarm is left behind for the rest of the worker's life.
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


def test_a_short_freeze_within_the_bound_is_survived() -> None:
    host = FrozenHost(freeze_s=0.4)
    _action, result, _took = run_retune(host)
    assert host.ops == ["inspect", "stop", "release", "start"]
    assert "failed" not in result and "host_lost" not in result
    assert result["instances"][0]["action"] == "relaunched"


def test_a_connection_that_gives_up_first_loses_the_host_too() -> None:
    """ssh's keep-alives end a dead connection before the bound: the host is lost all the same,
    with the connection's word, and no further call is made (no task left unreachable, reportless)."""
    calls: list[str] = []

    def execute(module_name: str, module_args: dict[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        calls.append(module_args["op"])
        if module_args["op"] == "inspect":
            return {"instances": {"gpu0": FACTS_OLD}}
        raise AnsibleConnectionFailure("Failed to connect to the host via ssh: Timeout, server node1 not responding.")

    action = make_action({"instances": resolved(), **FAST})
    action._execute_module = MagicMock(side_effect=execute)
    result = action.run(task_vars={"inventory_hostname": "node1"})
    assert calls == ["inspect", "stop"]
    assert result["failed"] is True and result["host_lost"]["phase"] == "stop"
    # How far into the phase it failed is the machine's own time (a tenth of a second on a loaded one).
    assert re.match(
        r"HOST LOST: the connection failed \(Failed to connect to the host via ssh: Timeout, server node1 not "
        r"responding\.\) during the stop phase of gpu0, [0-9.]+s into it \(its bound: 1\.4s",
        result["msg"],
    ), result["msg"]
    action._connection.close.assert_called_once_with()


def test_the_bound_is_the_deadline_the_call_carries_plus_the_margin() -> None:
    options = {**Options().agent, "nvidia_smi_timeout": 20, "http_timeout": 30, "stall_probe_s": 5}
    # /health, /server_info and three reads of /metrics, the last once the idle report is due (32 s).
    assert call_deadline("inspect", options) == 20 + 2 * 20 + 5 * 30 + 32
    assert call_deadline("inspect", {**options, "stall_probe_s": 0}) == 20 + 2 * 20 + 5 * 30
    stop = {**options, "stop_timeout": 300, "kill_timeout": 10, "release_timeout": 300}
    assert call_deadline("stop", stop) == 300 + 40 + 300 + 80
    start = {**options, "start_timeout": 3600, "health_timeout": 120, "smoke_requests": 2}
    assert call_deadline("start", start) == 3600 + 60 + 240
    # The clients' resume of the healthy wave: their checks (45 s), their word (client_confirm_timeout)
    # and the socket call's margin (15 s); a resume phase of its own, the same.
    resume = {"resume_clients": {"u": ["url"]}, "client_confirm_timeout": 60}
    assert call_deadline("start", {**start, **resume}) == 3600 + 60 + 240 + 45 + 60 + 15
    assert call_deadline("resume", {**options, "client_confirm_timeout": 60}) == 45 + 60 + 15
    assert call_deadline("drain", {**options, "client_drain_timeout": 120}) == 120 + 15
    assert call_deadline("record", options) == 0
    assert Options().call_margin == 120


def test_an_outer_alarm_due_first_keeps_its_handler_and_one_due_later_its_time() -> None:
    """A task's own ``timeout`` (ansible-core's SIGALRM) wraps the action: the first due fires."""
    fired: list[str] = []

    class TaskTimeout(BaseException):
        pass

    def outer(_signum: int, _frame: Any) -> None:
        fired.append("task timeout")
        raise TaskTimeout

    previous = signal.signal(signal.SIGALRM, outer)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(TaskTimeout), bounded(5.0):
            time.sleep(2)
        assert fired == ["task timeout"]
        signal.setitimer(signal.ITIMER_REAL, 5.0)
        with pytest.raises(CallTimedOut), bounded(0.2):
            time.sleep(2)
        # The task's alarm goes on with the time it had left, under its own handler.
        left, _interval = signal.getitimer(signal.ITIMER_REAL)
        assert 4.0 < left < 5.0
        assert signal.getsignal(signal.SIGALRM) is outer
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_only_the_children_the_call_started_are_killed() -> None:
    before = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(CallTimedOut) as caught, bounded(0.2):
            during = subprocess.Popen(["sleep", "30"])
            during.wait()
        assert caught.value.killed == [during.pid]
        assert before.poll() is None
        assert before.pid in {pid for pid, _start in children()}
    finally:
        before.kill()
        before.wait()
