# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""systemd: unit state, systemctl, a unit's journal, and verifying a unit before it is installed."""

from __future__ import annotations

import os
import shlex
import tempfile
from typing import Any

from .evidence import EvidenceError, Redactor, clip, run_cmd, which

UNIT_DIR = "/etc/systemd/system"
UNIT_PROPERTIES = (
    "Id",
    "LoadState",
    "ActiveState",
    "SubState",
    "Result",
    "MainPID",
    "InvocationID",
    "ExecMainStartTimestampMonotonic",
    "ExecMainStatus",
    "ExecMainCode",
    "ControlGroup",
    "NRestarts",
    "FragmentPath",
    "NeedDaemonReload",
    "UnitFileState",
)


def systemctl_show(units: list[str]) -> dict[str, dict[str, str]]:
    """The systemd state of several units in one call."""
    if not units:
        return {}
    argv = ["systemctl", "show", "--no-pager", "-p", ",".join(UNIT_PROPERTIES), "--", *units]
    rc, out, err = run_cmd(argv)
    if rc != 0:
        raise EvidenceError("systemd unit state", argv, rc, out, err)
    blocks = out.strip("\n").split("\n\n")
    if len(blocks) != len(units):
        raise EvidenceError("systemd unit state (one block per unit expected)", argv, rc, out, err)
    result: dict[str, dict[str, str]] = {}
    for unit, block in zip(units, blocks):
        values: dict[str, str] = {}
        for line in block.splitlines():
            key, _unused, value = line.partition("=")
            values[key] = value
        if "ActiveState" not in values:
            raise EvidenceError("systemd unit state (no ActiveState)", argv, rc, out, err)
        result[unit] = values
    return result


def environment_files(unit: str) -> list[str]:
    """The unit's EnvironmentFile= paths (``systemctl show`` prints ``PATH (ignore_errors=no)``, one
    a line); empty when it has none or systemd does not know it."""
    argv = ["systemctl", "show", "--no-pager", "-p", "EnvironmentFiles", "--value", "--", unit]
    rc, out, err = run_cmd(argv)
    if rc != 0:
        raise EvidenceError("systemd unit environment files", argv, rc, out, err)
    return [line.rsplit(" (", 1)[0].strip() for line in out.splitlines() if line.strip()]


def systemctl(args: list[str], timeout: float = 60.0) -> dict[str, Any]:
    argv = ["systemctl", *args]
    rc, out, err = run_cmd(argv, timeout=timeout)
    return {"cmd": shlex.join(argv), "rc": rc, "stdout": clip(out), "stderr": clip(err)}


def journal_tail(invocation_id: str, unit: str, lines: int, redactor: Redactor) -> list[str]:
    if invocation_id:
        argv = [
            "journalctl",
            "--no-pager",
            "-o",
            "cat",
            "-n",
            str(lines),
            f"_SYSTEMD_INVOCATION_ID={invocation_id}",
        ]
    else:
        argv = ["journalctl", "--no-pager", "-o", "cat", "-n", str(lines), "-u", unit]
    rc, out, err = run_cmd(argv, timeout=20)
    if rc != 0:
        return [f"(journalctl failed: rc={rc} {err.strip()})"]
    return [redactor.text(line) for line in out.splitlines()[-lines:]]


def identity(state: dict[str, str]) -> dict[str, Any]:
    """Which run of a unit this is (main PID, invocation) and how it stands."""
    return {
        "main_pid": int(state.get("MainPID") or 0),
        "invocation_id": state.get("InvocationID", ""),
        "active_state": state.get("ActiveState", ""),
        "sub_state": state.get("SubState", ""),
        "result": state.get("Result", ""),
        "n_restarts": int(state.get("NRestarts") or 0),
    }


def stopped(state: dict[str, str]) -> bool:
    return state.get("ActiveState") in ("inactive", "failed") and state.get("SubState") != "auto-restart"


def verify_unit_text(name: str, content: str) -> str | None:
    """``systemd-analyze verify`` on a unit before it is installed. Unknown keys and bad values
    only print warnings with rc=0, so any output about our unit counts as a failure."""
    if not which("systemd-analyze"):
        return None
    with tempfile.TemporaryDirectory(prefix="sglang-fleet-verify-") as tmp:
        path = os.path.join(tmp, name)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(content)
        argv = ["systemd-analyze", "verify", path]
        rc, out, err = run_cmd(argv, timeout=60)
        problems = [
            line for line in (out + err).splitlines() if line.strip() and (name in line or tmp in line or rc != 0)
        ]
        if rc != 0 or problems:
            return f"systemd-analyze verify {name}: rc={rc}: " + " | ".join(problems or [err.strip()])
    return None
