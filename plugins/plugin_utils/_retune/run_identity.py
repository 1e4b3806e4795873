# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Who is running: the identity a host lock carries, derived on the controller.

Every task of one ``ansible-playbook`` run is executed by a worker forked from the same main
process, so that process (its PID and start time on this controller) identifies the run: every
host and every task of the run derive the same run id without passing it around, and another
run, even of the same playbook, gets another.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import socket
import time
from typing import Any

PROC_SELF = "/proc/self"


def _starttime(pid: int) -> int | None:
    """Clock ticks since boot at which ``pid`` started (tells a reused PID apart), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            raw = handle.read()
    except OSError:
        return None
    return int(raw[raw.rfind(")") + 2 :].split()[19])


def controller_identity(ttl_s: int, pid: int | None = None) -> dict[str, Any]:
    pid = os.getppid() if pid is None else pid
    host = socket.gethostname()
    start = _starttime(pid)
    run_id = hashlib.sha256(f"{host}:{pid}:{start}".encode()).hexdigest()[:16]
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return {
        "run_id": run_id,
        "controller": host,
        "user": user,
        "controller_pid": pid,
        "controller_pid_starttime": start,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_process_started(pid))),
        "ttl_s": ttl_s,
    }


def _process_started(pid: int) -> float:
    """Wall-clock start of ``pid``: boot time plus its start in clock ticks."""
    start = _starttime(pid)
    try:
        with open("/proc/stat", encoding="utf-8") as handle:
            btime = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return time.time()
    return time.time() if start is None else btime + start / os.sysconf("SC_CLK_TCK")


def holder_is_dead_here(holder: dict[str, Any]) -> bool:
    """The holder ran on this controller and its process is gone (or the PID is another
    process now): its lease was left behind and can be taken over at once."""
    if holder.get("controller") != socket.gethostname():
        return False
    pid = holder.get("controller_pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if not os.path.isdir(PROC_SELF):
        # No procfs on this controller (macOS): no start times, so only "is that PID alive".
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    start = _starttime(pid)
    return start is None or start != holder.get("controller_pid_starttime")
