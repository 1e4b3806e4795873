# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""/proc: the process table (what each process holds: GPU device handles, listening ports, its
cgroup), telling the instance's own processes from foreign ones, and killing by PID."""

from __future__ import annotations

import functools
import os
import re
import signal
import time
from collections.abc import Iterable
from typing import Any, Callable

from .evidence import EvidenceError, Redactor
from .waiting import wait_until

# Markers that identify an SGLang process. Titles are set by setproctitle in the children
# (sglang::scheduler, sglang::detokenizer, ...); the main process keeps its command line.
SGLANG_TITLE_PREFIX = "sglang::"
SGLANG_MAIN_MODULES = ("sglang.launch_server",)
LAUNCHER_BASENAME = "sglang-fleet-launch"


def _read(path: str, mode: str = "r") -> Any:
    with open(path, mode) as handle:
        return handle.read()


def proc_stat(pid: int) -> dict[str, Any] | None:
    """ppid, state and start time (clock ticks since boot, which tells PID reuse apart)."""
    try:
        raw = _read(f"/proc/{pid}/stat")
    except OSError:
        return None
    # comm may contain spaces and parentheses: split after the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    return {"state": rest[0], "ppid": int(rest[1]), "starttime": int(rest[19])}


def proc_cmdline(pid: int) -> list[str]:
    try:
        raw = _read(f"/proc/{pid}/cmdline", "rb")
    except OSError:
        return []
    # setproctitle pads the argv area with NULs: drop the empty words it leaves.
    return [w.decode("utf-8", "replace") for w in raw.split(b"\0") if w]


def proc_cgroup(pid: int) -> str:
    """The process's cgroup path: the unified (v2) line, else the name=systemd (v1) one."""
    try:
        lines = _read(f"/proc/{pid}/cgroup").splitlines()
    except OSError:
        return ""
    v1 = ""
    for line in lines:
        hier, _unused, rest = line.partition(":")
        controllers, _unused, path = rest.partition(":")
        if hier == "0" and controllers == "":
            return path
        if controllers == "name=systemd":
            v1 = path
    return v1


def proc_environ(pid: int) -> dict[str, str] | None:
    try:
        raw = _read(f"/proc/{pid}/environ", "rb")
    except OSError:
        return None
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            key, _unused, value = item.partition(b"=")
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def proc_uid(pid: int) -> int | None:
    try:
        for line in _read(f"/proc/{pid}/status").splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def in_cgroup(path: str, cgroup: str) -> bool:
    """``path`` is the cgroup ``cgroup`` or one below it (an empty ``cgroup`` holds nothing)."""
    return bool(cgroup) and (path == cgroup or path.startswith(cgroup + "/"))


def listening_sockets() -> dict[int, int]:
    """Map socket inode -> TCP port for every listening socket (IPv4 and IPv6)."""
    inodes: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = _read(table).splitlines()[1:]
        except OSError as exc:
            if table == "/proc/net/tcp6" and not os.path.exists(table):
                continue  # IPv6 disabled: nothing can listen there
            # An unreadable socket table is not "no listener": fail closed.
            raise EvidenceError("listening sockets", ["cat", table], 1, "", str(exc)) from None
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A = LISTEN
                continue
            port = int(fields[1].rsplit(":", 1)[1], 16)
            inodes[int(fields[9])] = port
    return inodes


def process_table(devices_dir: str = "/dev", group_of: Callable[[int], str] | None = None) -> dict[int, dict[str, Any]]:
    """Every process with what identifies it and what it holds: GPU device handles
    (open /dev/nvidiaN) and listening TCP ports. One pass over /proc. ``cgroup`` is the process's
    group key (``group_of``: its service's, see ``supervision``; by default its cgroup)."""
    group_of = group_of or proc_cgroup
    listen = listening_sockets()
    gpu_dev = re.compile("^" + re.escape(devices_dir.rstrip("/")) + r"/nvidia(\d+)$")
    table: dict[int, dict[str, Any]] = {}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid == me:
            continue
        stat = proc_stat(pid)
        if stat is None:
            continue
        gpus: list[int] = []
        ports: list[int] = []
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                port = listen.get(int(target[8:-1]))
                if port is not None and port not in ports:
                    ports.append(port)
                continue
            match = gpu_dev.match(target)
            if match:
                index = int(match.group(1))
                if index not in gpus:
                    gpus.append(index)
        table[pid] = {
            "pid": pid,
            "ppid": stat["ppid"],
            "state": stat["state"],
            "starttime": stat["starttime"],
            "cmdline": proc_cmdline(pid),
            "cgroup": group_of(pid),
            "gpus": sorted(gpus),
            "ports": sorted(ports),
        }
    return table


def is_sglang_process(cmdline: list[str]) -> bool:
    """An SGLang server process, by the exact shapes its command line takes: a child's
    setproctitle title, ``python -m sglang.launch_server``, ``sglang serve``, or our launcher.
    A word merely containing "sglang" is not enough (``generate_sglang_report.py`` is not)."""
    if not cmdline:
        return False
    if cmdline[0].startswith(SGLANG_TITLE_PREFIX):
        return True
    for i, word in enumerate(cmdline[:-1]):
        if word == "-m" and cmdline[i + 1] in SGLANG_MAIN_MODULES:
            return True
    if os.path.basename(cmdline[0]) == "sglang" and len(cmdline) > 1 and cmdline[1] == "serve":
        return True
    return any(os.path.basename(word) == LAUNCHER_BASENAME for word in cmdline[:3])


def classify_processes(
    instance: dict[str, Any],
    table: dict[int, dict[str, Any]],
    other_cgroups: Iterable[str],
    compute_app_pids: dict[int, list[int]],
) -> dict[str, list[dict[str, Any]]]:
    """Sort the processes that stand between an instance and its relaunch.

    ``owned``: belong to the instance and may be killed by PID: in its unit's cgroup, or an
    SGLang process (by the exact markers of :func:`is_sglang_process`) holding one of its
    GPUs or listening on its port, and not inside another managed instance's unit.
    ``foreign``: anything else holding its GPUs or port: never touched; the instance fails
    closed naming them. Everything else is left alone.
    ``compute_app_pids`` maps a PID reported by nvidia-smi (only when those PIDs are
    meaningful in this PID namespace) to the GPU indexes it uses.
    """
    cgroup = instance.get("cgroup") or ""
    gpus = set(instance["gpus"])
    port = instance["port"]
    others = [c for c in other_cgroups if c and c != cgroup]
    owned: list[dict[str, Any]] = []
    foreign: list[dict[str, Any]] = []
    for pid, proc in sorted(table.items()):
        if proc["state"] == "Z":
            continue  # a zombie holds nothing; its parent reaps it
        held_gpus = sorted(gpus & (set(proc["gpus"]) | set(compute_app_pids.get(pid, []))))
        on_port = port in proc["ports"]
        in_unit = in_cgroup(proc["cgroup"], cgroup)
        if not (in_unit or held_gpus or on_port):
            continue
        entry = {
            "pid": pid,
            "starttime": proc["starttime"],
            "cmdline": proc["cmdline"],
            "cgroup": proc["cgroup"],
            "gpus": held_gpus,
            "port": port if on_port else None,
        }
        in_other_unit = any(in_cgroup(proc["cgroup"], c) for c in others)
        if in_unit:
            entry["reason"] = "in the instance's unit cgroup"
            owned.append(entry)
        elif in_other_unit:
            entry["reason"] = "belongs to another managed instance"
            foreign.append(entry)
        elif is_sglang_process(proc["cmdline"]):
            what = f"GPU {held_gpus}" if held_gpus else f"port {port}"
            entry["reason"] = f"SGLang process outside the unit holding {what}"
            owned.append(entry)
        else:
            what = f"GPU {held_gpus}" if held_gpus else f"port {port}"
            entry["reason"] = f"not an SGLang process, holding {what}"
            foreign.append(entry)
    return {"owned": owned, "foreign": foreign}


def _all_gone(targets: list[dict[str, Any]]) -> bool:
    return not any(same_process(t["pid"], t["starttime"]) for t in targets)


def same_process(pid: int, starttime: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat["starttime"] == starttime and stat["state"] != "Z"


def kill_with_escalation(
    targets: list[dict[str, Any]], grace: float, redactor: Redactor, poll: float = 0.1
) -> list[dict[str, Any]]:
    """SIGTERM each target by PID, wait up to ``grace``, then SIGKILL the survivors and wait
    again. Before every signal the PID's start time is checked, so a reused PID is never hit."""
    log: list[dict[str, Any]] = []
    alive = list(targets)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        sent = []
        for target in alive:
            if not same_process(target["pid"], target["starttime"]):
                continue
            try:
                os.kill(target["pid"], sig)
            except ProcessLookupError:
                continue
            sent.append(target)
            log.append(
                {
                    "pid": target["pid"],
                    "signal": signal.Signals(sig).name,
                    "cmdline": redactor.argv(target["cmdline"]),
                    "reason": target.get("reason", ""),
                }
            )
        if sent:
            wait_until(functools.partial(_all_gone, list(sent)), time.monotonic() + grace, poll)
        alive = [t for t in alive if same_process(t["pid"], t["starttime"])]
        if not alive:
            break
    return log
