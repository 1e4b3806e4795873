# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""A call to a host bounded on the controller.

A host that stops answering (kernel hang, network partition) cannot keep its own deadlines, and
the connection under a module execution (ssh, podman exec) waits for it as long as it takes. The
action plugin runs each call under :func:`bounded`: past its bound, the child processes the call
started (the hung ``ssh`` or ``podman exec``) are SIGKILLed and reaped, and :class:`CallTimedOut`
is raised in the call, as ansible-core's task ``timeout`` does (``SIGALRM`` in the worker process
that runs the action). An alarm already set (a task's own ``timeout``) keeps its handler and its
time: whichever is due first fires, and the other is restored afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

PROC = "/proc"


class CallTimedOut(BaseException):
    """The bound of a call passed. A BaseException, as ansible-core's TaskTimeoutError: no
    ``except Exception`` between the alarm and :func:`bounded`'s caller may swallow it."""

    def __init__(self, seconds: float, killed: list[int]):
        self.seconds = seconds
        self.killed = killed
        super().__init__(f"no answer within {seconds:.0f}s")


def children(pid: int | None = None, proc: str = PROC) -> set[tuple[int, str]]:
    """The child processes of ``pid`` (this process), as (PID, start time): a PID reused by another
    process after the call is never taken for one the call started. Empty without a procfs."""
    pid = os.getpid() if pid is None else pid
    out: set[tuple[int, str]] = set()
    try:
        entries = os.listdir(proc)
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc, entry, "stat"), encoding="utf-8") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 19 and fields[1] == str(pid):
            out.add((int(entry), fields[19]))
    return out


def kill(processes: set[tuple[int, str]]) -> list[int]:
    """SIGKILL each process (a child, so it is ours to reap); the PIDs signalled."""
    killed = []
    for pid, _start in sorted(processes):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        killed.append(pid)
    return killed


def reap(pids: list[int], within: float = 2.0) -> None:
    """Wait (briefly) for the killed children, so that none is left a zombie of this process. The
    connection's own Popen may have reaped one already: that is not an error."""
    deadline = time.monotonic() + within
    pending = list(pids)
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            try:
                done, _status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                pending.remove(pid)
        if pending:
            time.sleep(0.05)


@contextlib.contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Run the body for at most ``seconds``; past that, kill the children it started and raise
    :class:`CallTimedOut` in it. Only the main thread gets signals: elsewhere the body runs
    unbounded (an action plugin runs in the main thread of its worker process)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    before = children()
    started = time.monotonic()
    outer_handler: Any = signal.getsignal(signal.SIGALRM)
    outer_left, _interval = signal.getitimer(signal.ITIMER_REAL)
    # An outer alarm (the task's timeout) due first fires as if this bound were not here.
    outer_first = 0 < outer_left <= seconds
    fired = {"outer": False}

    def on_alarm(signum: int, frame: Any) -> None:
        killed = kill(children() - before)
        if outer_first and callable(outer_handler):
            fired["outer"] = True
            outer_handler(signum, frame)
        raise CallTimedOut(seconds, killed)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, outer_left if outer_first else seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_left > 0 and not fired["outer"]:
            # The outer alarm goes on with the time it had left.
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - started), 0.001))
