"""/proc helpers: liveness that survives PID reuse, the child walk psutil would do, signals."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return None
    # comm may contain spaces and parentheses; everything after the last ')' is fixed-format.
    tail = data[data.rindex(")") + 2 :].split()
    return tail


def start_time(pid: int) -> int | None:
    f = _stat_fields(pid)
    return int(f[19]) if f else None


def state(pid: int) -> str | None:
    f = _stat_fields(pid)
    return f[0] if f else None


def ppid(pid: int) -> int | None:
    f = _stat_fields(pid)
    return int(f[1]) if f else None


def is_alive(pid: int, start: int | None = None) -> bool:
    """True if the process exists, is not a zombie, and (when given) started at ``start``."""
    f = _stat_fields(pid)
    if not f:
        return False
    if f[0] in ("Z", "X", "x"):
        return False
    return not (start is not None and int(f[19]) != int(start))


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    parts = raw.split(b"\0")
    if parts and parts[-1] == b"":
        parts = parts[:-1]
    return [p.decode("utf-8", "replace") for p in parts]


def children(pid: int, recursive: bool = True) -> list[int]:
    """Descendants by walking the ppid links in /proc, like psutil.Process.children."""
    by_parent: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        p = ppid(int(entry))
        if p is not None:
            by_parent.setdefault(p, []).append(int(entry))
    out: list[int] = []
    todo = list(by_parent.get(pid, []))
    while todo:
        child = todo.pop(0)
        out.append(child)
        if recursive:
            todo.extend(by_parent.get(child, []))
    return out


def send(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_children(pid: int, skip: set[int] | None = None) -> list[int]:
    killed = []
    for child in children(pid):
        if skip and child in skip:
            continue
        if send(child, signal.SIGKILL):
            killed.append(child)
    return killed


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until each pid is gone or a zombie; returns those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if is_alive(p)]
        if left:
            time.sleep(0.02)
    return left
