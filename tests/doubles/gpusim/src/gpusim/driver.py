"""The simulated driver's process teardown: a killed GPU process lingers before it is gone.

Reference section 8: "SIGKILL only queues teardown. A process in uninterruptible GPU teardown
can hold its memory and ports for a while" (seconds; more than 30 s was observed on GB300).
A SIGKILLed process cannot run code, so the delay comes from the kernel: one tracer per host
(``gpusim driver``, started by ``gpusim setup`` outside every server's cgroup) attaches to each
simulated SGLang process with ``PTRACE_SEIZE`` and ``PTRACE_O_TRACEEXIT``. A dying tracee stops
at ``PTRACE_EVENT_EXIT``, before the kernel closes its files or drops its memory. If it was
killed by a signal, the tracer keeps it there for the process's ``teardown_s`` and then lets
it go; a voluntary exit is let go at once.

While stopped the process keeps its PID, ``/proc/PID/cmdline`` (title), its cgroup membership,
every open fd (``<devices_dir>/nvidiaN``, listening sockets) and its allocation record, which
counts as alive; ``/proc/PID/stat`` shows state ``t`` (tracing stop) where a real one shows
``D``. Further signals, SIGKILL included, are discarded by the kernel because the process is
already exiting. The stop is bounded: each tracee is released after its own delay (capped at
``MAX_TEARDOWN_S``), and if the tracer dies the kernel detaches every tracee, which then
finishes exiting.

Processes register themselves over ``<state_dir>/driver.sock`` ("trace me"); the driver
takes the PID from the socket's peer credentials, so a process can only offer itself.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import hashlib
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusim import procutil, registry

SOCKET_NAME = "driver.sock"
PIDFILE_NAME = "driver.pid"
LOGFILE_NAME = "driver.log"
MAX_TEARDOWN_S = 600.0
DEFAULT_STATE_DIR = Path("/run/gpusim")
SYSTEMD_UNIT = "gpusim-driver"

PTRACE_CONT = 7
PTRACE_DETACH = 17
PTRACE_GETEVENTMSG = 0x4201
PTRACE_SEIZE = 0x4206
PTRACE_LISTEN = 0x4208
PTRACE_O_TRACEEXIT = 0x40
PTRACE_EVENT_EXIT = 6
PTRACE_EVENT_STOP = 128
WALL = 0x40000000
PR_SET_PTRACER = 0x59616D61
GROUP_STOP_SIGNALS = (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc  # noqa: PLW0603  (one handle per process)
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.ptrace.argtypes = (ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
        _libc.ptrace.restype = ctypes.c_long
    return _libc


def ptrace(request: int, pid: int, addr: int = 0, data: int = 0) -> int:
    res = _lib().ptrace(request, pid, ctypes.c_void_p(addr), ctypes.c_void_p(data))
    if res == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return res


def socket_path(state_dir: Path) -> Path:
    return state_dir / SOCKET_NAME


# ---------------------------------------------------------------------------- client side
def _peer_pid(sock: socket.socket) -> int:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)[0]


def _request(state_dir: Path, msg: dict[str, Any], timeout: float) -> dict[str, Any] | None:
    path = socket_path(state_dir)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(path))
            if msg.get("op") == "trace":
                # Yama's ptrace_scope=1 lets only a declared tracer attach to a non-descendant.
                with contextlib.suppress(OSError):
                    _lib().prctl(PR_SET_PTRACER, _peer_pid(s), 0, 0, 0)
            s.sendall(json.dumps(msg).encode() + b"\n")
            buf = b""
            while b"\n" not in buf:
                chunk = s.recv(65536)
                if not chunk:
                    return None
                buf += chunk
            return json.loads(buf.split(b"\n", 1)[0])
    except (OSError, ValueError):
        return None


def register(state_dir: Path, teardown_s: float, title: str = "", timeout: float = 5.0) -> bool:
    """Ask the host's driver to hold this process in teardown for ``teardown_s`` when it is killed.

    Returns False when teardown is off (0) or no driver answers; the process then dies at once.
    """
    if teardown_s <= 0:
        return False
    reply = _request(state_dir, {"op": "trace", "teardown_s": float(teardown_s), "title": title}, timeout)
    return bool(reply and reply.get("ok"))


def status(state_dir: Path, timeout: float = 2.0) -> dict[str, Any] | None:
    return _request(state_dir, {"op": "status"}, timeout)


# ---------------------------------------------------------------------------- the tracer
@dataclass
class Tracee:
    pid: int
    start_time: int
    title: str
    teardown_s: float
    state: str = "running"  # running | teardown
    killed_by: int | None = None
    release_at: float | None = None
    since: float | None = None

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "title": self.title,
            "teardown_s": self.teardown_s,
            "state": self.state,
            "killed_by": self.killed_by,
            "releases_in_s": None if self.release_at is None else round(max(0.0, self.release_at - now), 3),
        }


class Driver:
    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.tracees: dict[int, Tracee] = {}
        self.sel = selectors.DefaultSelector()
        self.listener: socket.socket | None = None
        self.wake_r, self.wake_w = os.pipe()
        self.stopping = False
        self.sock_ino = 0

    def log(self, msg: str) -> None:
        sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} gpusim-driver[{os.getpid()}]: {msg}\n")
        sys.stderr.flush()

    # --- setup ------------------------------------------------------------
    def open(self) -> None:
        registry.ensure_state_dir(self.state_dir)
        path = socket_path(self.state_dir)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lst.bind(str(path))
        with contextlib.suppress(PermissionError):
            os.chmod(path, 0o666)  # noqa: S103  (an unprivileged server registers itself)
        lst.listen(128)
        lst.setblocking(False)
        self.listener = lst
        self.sock_ino = os.stat(path).st_ino
        self.sel.register(lst, selectors.EVENT_READ, "accept")
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        signal.set_wakeup_fd(self.wake_w)
        # Ptrace stops of the tracees are reported to the tracer with SIGCHLD.
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        (self.state_dir / PIDFILE_NAME).write_text(f"{os.getpid()}\n")

    def _on_term(self, *_: Any) -> None:
        self.stopping = True

    # --- loop ---------------------------------------------------------------
    def serve_forever(self) -> None:
        self.log(f"tracing for {self.state_dir}")
        while not self.stopping:
            now = time.monotonic()
            due = [t.release_at for t in self.tracees.values() if t.release_at is not None]
            timeout = 0.5 if not due else max(0.0, min(min(due) - now, 0.5))
            for key, _ in self.sel.select(timeout):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self.wake_r, 4096):
                            pass
            self._reap()
            self._release_due()
            if not self._socket_is_mine():
                self.log("socket removed or taken over")
                self.stopping = True
                return
        self.log("stopping; the kernel releases every tracee")
        with contextlib.suppress(OSError):
            socket_path(self.state_dir).unlink()

    def _socket_is_mine(self) -> bool:
        try:
            return os.stat(socket_path(self.state_dir)).st_ino == self.sock_ino
        except OSError:
            return False

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    reply = self._handle(conn)
                except (OSError, ValueError) as exc:
                    reply = {"ok": False, "error": str(exc)}
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps(reply).encode() + b"\n")

    def _handle(self, conn: socket.socket) -> dict[str, Any]:
        buf = b""
        while b"\n" not in buf:
            chunk = conn.recv(65536)
            if not chunk:
                raise ValueError("connection closed before a request")
            buf += chunk
        msg = json.loads(buf.split(b"\n", 1)[0])
        op = msg.get("op")
        if op == "status":
            now = time.monotonic()
            return {
                "ok": True,
                "pid": os.getpid(),
                "state_dir": str(self.state_dir),
                "tracees": [t.to_dict(now) for t in sorted(self.tracees.values(), key=lambda t: t.pid)],
            }
        if op == "trace":
            pid = _peer_pid(conn)
            teardown = min(max(float(msg.get("teardown_s", 0.0)), 0.0), MAX_TEARDOWN_S)
            return self._seize(pid, teardown, str(msg.get("title") or ""))
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _seize(self, pid: int, teardown_s: float, title: str) -> dict[str, Any]:
        if pid in self.tracees:
            self.tracees[pid].teardown_s = teardown_s
            return {"ok": True, "already": True}
        try:
            ptrace(PTRACE_SEIZE, pid, 0, PTRACE_O_TRACEEXIT)
        except OSError as exc:
            self.log(f"cannot trace pid {pid}: {exc.strerror}")
            return {"ok": False, "error": f"PTRACE_SEIZE: {exc.strerror}"}
        start = procutil.start_time(pid) or 0
        self.tracees[pid] = Tracee(pid, start, title or " ".join(procutil.cmdline(pid))[:120], teardown_s)
        return {"ok": True}

    # --- tracee events --------------------------------------------------------
    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG | WALL)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            self._event(pid, status)

    def _event(self, pid: int, status: int) -> None:
        t = self.tracees.get(pid)
        if not os.WIFSTOPPED(status):
            self.tracees.pop(pid, None)  # gone (exited or killed while attached)
            return
        sig = os.WSTOPSIG(status)
        event = status >> 16
        try:
            if event == PTRACE_EVENT_EXIT:
                code = ctypes.c_ulong()
                ptrace(PTRACE_GETEVENTMSG, pid, 0, ctypes.addressof(code))
                wstatus = int(code.value)
                if t is not None and os.WIFSIGNALED(wstatus) and t.teardown_s > 0:
                    now = time.monotonic()
                    t.state = "teardown"
                    t.killed_by = os.WTERMSIG(wstatus)
                    t.since = now
                    t.release_at = now + t.teardown_s
                else:
                    self._let_go(pid)
            elif event == PTRACE_EVENT_STOP:
                if sig in GROUP_STOP_SIGNALS:
                    ptrace(PTRACE_LISTEN, pid)
                else:
                    ptrace(PTRACE_CONT, pid)
            elif event == 0:
                ptrace(PTRACE_CONT, pid, 0, sig)  # signal-delivery stop: deliver it unchanged
            else:
                ptrace(PTRACE_CONT, pid)
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                self.log(f"pid {pid}: {exc.strerror}")
            if exc.errno == errno.ESRCH and not procutil.is_alive(pid):
                self.tracees.pop(pid, None)

    def _release_due(self) -> None:
        now = time.monotonic()
        for t in list(self.tracees.values()):
            if t.release_at is not None and now >= t.release_at:
                self._let_go(t.pid)

    def _let_go(self, pid: int) -> None:
        t = self.tracees.pop(pid, None)
        if t is not None:
            # The driver frees a context's memory only after the process is gone: restart the
            # allocation's release delay from now, not from the last heartbeat before the kill.
            for path in registry.alloc_dir(self.state_dir).glob(f"*-{t.pid}-{t.start_time}.json"):
                with contextlib.suppress(OSError):
                    os.utime(path)
        with contextlib.suppress(OSError):
            ptrace(PTRACE_DETACH, pid)


def serve(state_dir: Path) -> int:
    d = Driver(state_dir)
    d.open()
    d.serve_forever()
    return 0


# ---------------------------------------------------------------------------- lifecycle
def _unit_name(state_dir: Path) -> str:
    if state_dir == DEFAULT_STATE_DIR:
        return SYSTEMD_UNIT
    return f"{SYSTEMD_UNIT}-{hashlib.sha256(str(state_dir).encode()).hexdigest()[:8]}"


def _systemd_usable() -> bool:
    return Path("/run/systemd/system").is_dir() and os.geteuid() == 0 and shutil.which("systemd-run") is not None


def _pidfile_pid(state_dir: Path) -> int | None:
    try:
        pid = int((state_dir / PIDFILE_NAME).read_text().strip())
    except (OSError, ValueError):
        return None
    cl = procutil.cmdline(pid)
    if procutil.is_alive(pid) and any("gpusim.driver" in part or part == "driver" for part in cl):
        return pid
    return None


def stop(state_dir: Path) -> None:
    """Stop this state dir's driver (a transient unit or a daemon); the kernel releases its tracees."""
    if _systemd_usable():
        subprocess.run(["systemctl", "stop", f"{_unit_name(state_dir)}.service"], capture_output=True, check=False)
        subprocess.run(
            ["systemctl", "reset-failed", f"{_unit_name(state_dir)}.service"], capture_output=True, check=False
        )
    pid = _pidfile_pid(state_dir)
    if pid is not None:
        procutil.send(pid, signal.SIGTERM)
        if procutil.wait_gone([pid], 3.0):
            procutil.send(pid, signal.SIGKILL)
            procutil.wait_gone([pid], 3.0)
    with contextlib.suppress(OSError):
        socket_path(state_dir).unlink()


def start(state_dir: Path, mode: str = "auto") -> dict[str, Any]:
    """(Re)start the driver for ``state_dir``; ``mode``: auto, systemd, fork or none."""
    stop(state_dir)
    if mode == "auto":
        if not _systemd_usable():
            return {"mode": "none", "running": False, "reason": "not root under systemd; use --driver fork"}
        mode = "systemd"
    if mode == "none":
        return {"mode": "none", "running": False}
    env = {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "PATH", "LANG", "LC_ALL")}
    cmd = [sys.executable, "-m", "gpusim.driver", "serve", "--state-dir", str(state_dir)]
    if mode == "systemd":
        unit = _unit_name(state_dir)
        run = [
            "systemd-run",
            f"--unit={unit}",
            "--collect",
            "--no-block",
            "--property=DefaultDependencies=no",
            f"--description=Simulated GPU driver: process teardown ({state_dir})",
        ]
        run += [f"--setenv={k}={v}" for k, v in env.items()]
        res = subprocess.run([*run, *cmd], capture_output=True, text=True, check=False)
        if res.returncode != 0:
            return {"mode": mode, "running": False, "error": res.stderr.strip()}
        where: dict[str, Any] = {"unit": f"{unit}.service"}
    else:
        log = open(state_dir / LOGFILE_NAME, "ab")  # noqa: SIM115  (handed to the daemon)
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                close_fds=True,
                env={**os.environ},
            )
        finally:
            log.close()
        where = {"pid": proc.pid}
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        st = status(state_dir, timeout=0.5)
        if st and st.get("ok"):
            return {"mode": mode, "running": True, "pid": st["pid"], **where}
        time.sleep(0.05)
    return {"mode": mode, "running": False, "error": "the driver did not answer within 5 s", **where}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpusim-driver")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--state-dir", default=None)
    ns = p.parse_args(argv)
    state_dir = Path(ns.state_dir or os.environ.get("GPUSIM_STATE_DIR") or DEFAULT_STATE_DIR)
    return serve(state_dir)


if __name__ == "__main__":
    sys.exit(main())
