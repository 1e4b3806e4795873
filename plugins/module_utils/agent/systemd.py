# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""systemd: unit state, systemctl, a unit's journal, and verifying a unit before it is installed;
:class:`Systemd`, the supervision of a systemd host (see ``supervision``)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tempfile
import threading
from typing import Any, Callable

from .evidence import EvidenceError, Redactor, clip, kill_group, run_cmd, which
from .procfs import proc_cgroup
from .supervision import Outcome, Supervision

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


# The scheduler's startup lines to read are the controller's (``journal_pattern``: what
# plugin_utils/_capacity/model_facts.py parses, JOURNAL_PATTERN), sent with the request.
# The last startup line: reading a journal from its start (no --grep) stops there.
LAST_STARTUP_LINE = "max_total_num_tokens="
JOURNAL_MAX_LINES = 200
HEAD_MAX_LINES = 50000


def _journal_argv(invocation_id: str, unit: str) -> list[str]:
    where = [f"_SYSTEMD_INVOCATION_ID={invocation_id}"] if invocation_id else ["-u", unit, "-b"]
    return ["journalctl", "--no-pager", "-o", "cat", *where]


def journal_startup_lines(
    invocation_id: str, unit: str, pattern: str, redactor: Redactor
) -> tuple[list[str], str, str | None]:
    """The lines of the unit's run matching ``pattern``, with ``journalctl --grep``, and from the
    run's start up to the last startup line where journalctl cannot match patterns."""
    argv = [*_journal_argv(invocation_id, unit), "--grep", pattern]
    rc, out, err = run_cmd(argv, timeout=60)
    lines = [redactor.text(line) for line in out.splitlines() if line.strip()]
    if rc == 0 or (rc == 1 and not err.strip()) or (lines and rc is not None):
        return lines[-JOURNAL_MAX_LINES:], "journalctl --grep", None
    if rc is not None and ("pattern" in err.lower() or "grep" in err.lower() or "pcre" in err.lower()):
        return journal_head(invocation_id, unit, pattern, redactor)
    return [], "journalctl --grep", f"ran {' '.join(argv)!r}: rc={rc}, stderr={clip(err, 300)!r}"


def journal_head(
    invocation_id: str, unit: str, pattern: str, redactor: Redactor, timeout: float = 60.0
) -> tuple[list[str], str, str | None]:
    """The matching lines of the journal from the run's start, reading no further than the last
    startup line (or ``HEAD_MAX_LINES``): for a journalctl built without pattern matching."""
    argv = _journal_argv(invocation_id, unit)
    wanted = re.compile(pattern)
    found: list[str] = []
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
        )
    except FileNotFoundError as exc:
        return [], "journalctl", str(exc)
    timer = threading.Timer(timeout, kill_group, args=(proc.pid,))
    try:
        timer.start()
        if proc.stdout is None:
            raise AssertionError("Popen with stdout=PIPE has a stdout")
        for count, line in enumerate(proc.stdout):
            if wanted.search(line):
                found.append(redactor.text(line.rstrip("\n")))
                if LAST_STARTUP_LINE in line:
                    break
            if count >= HEAD_MAX_LINES:
                break
    finally:
        timer.cancel()
        kill_group(proc.pid)
        proc.wait()
    return found[-JOURNAL_MAX_LINES:], "journalctl (from the start of the run)", None


class Systemd(Supervision):
    """A systemd host: each service a unit, its processes its cgroup, its output the journal.
    ``systemctl(args, timeout)`` runs systemctl (the host's; a test's fake)."""

    kind = "systemd"
    definitions_dir = UNIT_DIR
    reload_action = "systemctl daemon-reload"
    start_waits_for_health = True

    def __init__(self, systemctl_runner: Callable[[list[str], float], Outcome]):
        self._systemctl = systemctl_runner

    def show(self, services: list[str]) -> dict[str, dict[str, str]]:
        return systemctl_show(services)

    def start(self, services: list[str], wait: bool, timeout: float = 60.0) -> Outcome:
        return self._systemctl(["start", *([] if wait else ["--no-block"]), "--", *services], timeout)

    def stop(self, services: list[str], wait: bool, timeout: float = 60.0) -> Outcome:
        # The unit's KillMode=mixed and TimeoutStopSec: SIGTERM to the main process, SIGKILL to
        # the whole cgroup at the stop timeout.
        return self._systemctl(["stop", *([] if wait else ["--no-block"]), "--", *services], timeout)

    def kill_all(self, services: list[str]) -> Outcome:
        return self._systemctl(["kill", "--kill-whom=all", "--signal=SIGKILL", "--", *services], 60.0)

    def reset_failed(self, services: list[str]) -> Outcome:
        return self._systemctl(["reset-failed", "--", *services], 60.0)

    def reload(self) -> Outcome:
        return self._systemctl(["daemon-reload"], 60.0)

    def is_enabled(self, service: str) -> bool:
        return str(self._systemctl(["is-enabled", "--", service], 30.0)["stdout"]).strip() == "enabled"

    def enable(self, service: str) -> Outcome:
        return self._systemctl(["enable", "--", service], 60.0)

    def log_tail(self, invocation_id: str, service: str, lines: int, redactor: Redactor) -> list[str]:
        return journal_tail(invocation_id, service, lines, redactor)

    def startup_lines(
        self, invocation_id: str, service: str, pattern: str, redactor: Redactor
    ) -> tuple[list[str], str, str | None]:
        return journal_startup_lines(invocation_id, service, pattern, redactor)

    def env_files(self, service: str) -> list[str]:
        return environment_files(service)

    def group_of(self, pid: int) -> str:
        return proc_cgroup(pid)

    def verify(self, name: str, content: str) -> str | None:
        return verify_unit_text(name, content)

    def is_definition(self, path: str) -> bool:
        return path.endswith((".service", ".conf")) and path.startswith(self.definitions_dir)

    def definition_path(self, service: str) -> str:
        return os.path.join(self.definitions_dir, service)
