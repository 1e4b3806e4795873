# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Host agent: everything sglang-fleet does on a GPU host, in one self-contained file.

The modules import it on a bare host; for an instance inside a Proxmox LXC container the same
source is run there with ``pct exec CTID -- python3 -c SOURCE`` and a JSON request on stdin.
So this file must stay standard-library only, importable on Python 3.9+, and never import
anything from Ansible.

Each operation (``op``) takes a request dict and returns a JSON-serialisable dict. Operations
gather or act on *all* the instances they are given in one run: one module execution per host
per phase, never one round trip per check.

Evidence is never inferred from silence: a command that fails, hangs or prints something we
cannot parse is returned as an ``EvidenceError`` quoting what was run and what came back, and
the instance it concerns is not relaunched.
"""

from __future__ import annotations

import contextlib
import grp
import hashlib
import json
import math
import os
import pwd
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any, Callable

AGENT_VERSION = 1
SECRETS_FILE_DEFAULT = "/etc/sglang-fleet/secrets.env"
STATE_DIR_DEFAULT = "/var/lib/sglang-fleet"
DESIRED_DIR_DEFAULT = "/etc/sglang-fleet/instances"
UNIT_DIR = "/etc/systemd/system"
REDACTED = "********"
# Markers that identify an SGLang process. Titles are set by setproctitle in the children
# (sglang::scheduler, sglang::detokenizer, ...); the main process keeps its command line.
SGLANG_TITLE_PREFIX = "sglang::"
SGLANG_MAIN_MODULES = ("sglang.launch_server",)
LAUNCHER_BASENAME = "sglang-fleet-launch"
SECRET_FLAGS = ("--api-key", "--admin-api-key")


class EvidenceError(Exception):
    """A command whose output we needed did not give usable evidence."""

    def __init__(self, what: str, argv: list[str], rc: int | None, stdout: str, stderr: str):
        self.what = what
        self.argv = argv
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(self.describe())

    def describe(self) -> str:
        rc = "timed out" if self.rc is None else f"rc={self.rc}"
        return (
            f"{self.what}: ran {shlex.join(self.argv)!r}: {rc}, "
            f"stdout={_clip(self.stdout)!r}, stderr={_clip(self.stderr)!r}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "cmd": shlex.join(self.argv),
            "rc": self.rc,
            "stdout": _clip(self.stdout),
            "stderr": _clip(self.stderr),
            "msg": self.describe(),
        }


def _clip(text: str, limit: int = 2000) -> str:
    text = text or ""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more chars)"


# --------------------------------------------------------------------------------------------
# Secrets and redaction
# --------------------------------------------------------------------------------------------


class Redactor:
    """Removes secret values from anything the agent returns (journal lines, command lines,
    /server_info, which echoes api_key in plain text)."""

    def __init__(self, secrets: Iterable[str] = ()):
        self.secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)

    def text(self, value: str) -> str:
        for secret in self.secrets:
            value = value.replace(secret, REDACTED)
        return value

    def argv(self, argv: list[str]) -> list[str]:
        out: list[str] = []
        hide_next = False
        for word in argv:
            if hide_next:
                out.append(REDACTED)
                hide_next = False
                continue
            flag, eq, _ = word.partition("=")
            if flag in SECRET_FLAGS:
                if eq:
                    out.append(flag + "=" + REDACTED)
                else:
                    out.append(word)
                    hide_next = True
                continue
            out.append(self.text(word))
        return out

    def obj(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.obj(v) for v in value]
        if isinstance(value, dict):
            return {k: (REDACTED if k in ("api_key", "admin_api_key") and v else self.obj(v)) for k, v in value.items()}
        return value


def read_env_file(path: str) -> dict[str, str]:
    """Parse a systemd EnvironmentFile (KEY=VALUE lines, optional quotes)."""
    env: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return env
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith(("#", ";")) or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def run_cmd(argv: list[str], timeout: float = 30.0, input_text: str | None = None) -> tuple[int | None, str, str]:
    """Run a command; rc None means it timed out, 127 that it was not found.

    The command runs in a process group of its own: on timeout the whole group is SIGKILLed
    and reaped, so a hung wrapper (an ``nvidia-smi`` script, a stuck driver call) leaves no
    children behind, and no grandchild holding our pipes can keep this call waiting."""
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except FileNotFoundError as exc:
        return 127, "", str(exc)
    try:
        out, err = proc.communicate(input_text, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        try:
            # Every holder of the pipes was in the group: EOF comes at once.
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a member that left the group still holds a pipe
            proc.kill()
            out, err = "", ""
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            proc.wait()
        return None, out or "", err or ""
    return proc.returncode, out, err


def kill_group(pgid: int) -> None:
    """SIGKILL a process group we created (its leader's PID is its id)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def systemctl_show(units: list[str]) -> dict[str, dict[str, str]]:
    """The systemd state of several units in one call."""
    if not units:
        return {}
    props = [
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
    ]
    argv = ["systemctl", "show", "--no-pager", "-p", ",".join(props), "--", *units]
    rc, out, err = run_cmd(argv)
    if rc != 0:
        raise EvidenceError("systemd unit state", argv, rc, out, err)
    blocks = [b for b in out.strip("\n").split("\n\n")]
    if len(blocks) != len(units):
        raise EvidenceError("systemd unit state (one block per unit expected)", argv, rc, out, err)
    result: dict[str, dict[str, str]] = {}
    for unit, block in zip(units, blocks):
        values: dict[str, str] = {}
        for line in block.splitlines():
            key, _, value = line.partition("=")
            values[key] = value
        if "ActiveState" not in values:
            raise EvidenceError("systemd unit state (no ActiveState)", argv, rc, out, err)
        result[unit] = values
    return result


def systemctl(args: list[str], timeout: float = 60.0) -> dict[str, Any]:
    argv = ["systemctl", *args]
    rc, out, err = run_cmd(argv, timeout=timeout)
    return {"cmd": shlex.join(argv), "rc": rc, "stdout": _clip(out), "stderr": _clip(err)}


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


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


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
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
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
            key, _, value = item.partition(b"=")
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


def process_table(devices_dir: str = "/dev") -> dict[int, dict[str, Any]]:
    """Every process with what identifies it and what it holds: GPU device handles
    (open /dev/nvidiaN) and listening TCP ports. One pass over /proc."""
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
            "cgroup": proc_cgroup(pid),
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
        in_unit = bool(cgroup) and (proc["cgroup"] == cgroup or proc["cgroup"].startswith(cgroup + "/"))
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
        in_other_unit = any(proc["cgroup"] == c or proc["cgroup"].startswith(c + "/") for c in others)
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
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            sent = [t for t in sent if same_process(t["pid"], t["starttime"])]
            if not sent:
                break
            time.sleep(poll)
        alive = [t for t in alive if same_process(t["pid"], t["starttime"])]
        if not alive:
            break
    return log


# --------------------------------------------------------------------------------------------
# nvidia-smi
# --------------------------------------------------------------------------------------------


def parse_csv_rows(text: str, fields: int) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != fields:
            raise ValueError(f"expected {fields} fields, got {len(cells)} in {line!r}")
        rows.append(cells)
    return rows


def query_gpus(nvidia_smi: str, timeout: float) -> dict[int, dict[str, Any]]:
    """Per-GPU memory.used/total. Fails closed: a missing binary, a hang, an error exit, empty
    output or a value that is not a number raise EvidenceError."""
    argv = [nvidia_smi, "--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader,nounits"]
    rc, out, err = run_cmd(argv, timeout=timeout)
    if rc != 0:
        raise EvidenceError("GPU memory", argv, rc, out, err)
    try:
        rows = parse_csv_rows(out, 4)
        if not rows:
            raise ValueError("no GPU rows")
        gpus = {
            int(r[0]): {"index": int(r[0]), "uuid": r[1], "used_mib": int(r[2]), "total_mib": int(r[3])} for r in rows
        }
    except ValueError as exc:
        raise EvidenceError(f"GPU memory (unparsable: {exc})", argv, rc, out, err) from None
    return gpus


def query_compute_apps(nvidia_smi: str, timeout: float, uuid_to_index: dict[str, int]) -> list[dict[str, Any]]:
    argv = [nvidia_smi, "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"]
    rc, out, err = run_cmd(argv, timeout=timeout)
    if rc != 0:
        raise EvidenceError("GPU compute processes", argv, rc, out, err)
    apps = []
    try:
        for r in parse_csv_rows(out, 3):
            used = None if r[2].startswith("[") else int(r[2])
            apps.append({"pid": int(r[0]), "gpu": uuid_to_index.get(r[1]), "used_mib": used})
    except ValueError as exc:
        raise EvidenceError(f"GPU compute processes (unparsable: {exc})", argv, rc, out, err) from None
    return apps


def meaningful_app_pids(
    apps: list[dict[str, Any]], table: dict[int, dict[str, Any]]
) -> tuple[dict[int, list[int]], bool]:
    """nvidia-smi shows host-namespace PIDs: inside a container they name nothing, or the wrong
    process. Use them only when every one exists here and holds that GPU's device handle."""
    mapping: dict[int, list[int]] = {}
    for app in apps:
        proc = table.get(app["pid"])
        if proc is None or app["gpu"] is None or app["gpu"] not in proc["gpus"]:
            return {}, False
        mapping.setdefault(app["pid"], []).append(app["gpu"])
    return mapping, True


# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------


def http_request(
    url: str, timeout: float, api_key: str = "", body: dict[str, Any] | None = None
) -> tuple[int | None, str]:
    """(status, body); status None when the connection failed (body says why)."""
    data = None if body is None else json.dumps(body).encode()
    if not url.startswith("http://"):
        raise ValueError(f"refusing to fetch {url!r}: only http:// to the instance's own port")
    req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET")  # noqa: S310
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback URLs we build
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, socket.timeout) as exc:
        reason = getattr(exc, "reason", exc)
        return None, f"{type(exc).__name__}: {reason}"


def timed_out(error: str) -> bool:
    """An ``http_request`` error body that says the server accepted nothing in time or stopped
    answering (as opposed to refusing the connection at once)."""
    return "timed out" in error or error.startswith(("TimeoutError", "timeout"))


def instance_url(instance: dict[str, Any], path: str) -> str:
    host = instance.get("http_host") or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{instance['port']}{path}"


def effective_max_running_requests(server_info: dict[str, Any]) -> int | None:
    states = server_info.get("internal_states") or []
    if states and isinstance(states[0], dict):
        value = states[0].get("effective_max_running_requests_per_dp")
        if isinstance(value, int):
            return value
    return None


# --------------------------------------------------------------------------------------------
# Expected settings
# --------------------------------------------------------------------------------------------


def compare_server_info(expected: dict[str, Any], reported: dict[str, Any]) -> list[dict[str, Any]]:
    """Keys of ``expected`` whose value the running server reports differently. Numbers compare
    by value with a tolerance (64 == 64.0, 0.93 == 0.9300000001), booleans only equal booleans,
    lists and mappings compare element by element."""
    mismatches = []
    for key, want in sorted(expected.items()):
        if key not in reported:
            mismatches.append({"arg": key, "expected": want, "reported": "(not reported)"})
            continue
        got = reported[key]
        if not _same_value(want, got):
            mismatches.append({"arg": key, "expected": want, "reported": got})
    return mismatches


def _same_value(want: Any, got: Any) -> bool:
    if isinstance(want, bool) or isinstance(got, bool):
        return isinstance(want, bool) and isinstance(got, bool) and want == got
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        return math.isclose(want, got, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        return len(want) == len(got) and all(_same_value(a, b) for a, b in zip(want, got))
    if isinstance(want, dict) and isinstance(got, dict):
        return set(want) == set(got) and all(_same_value(want[k], got[k]) for k in want)
    return bool(want == got)


def argv_matches(expected: list[str], running: list[str]) -> bool:
    """The running command line equals the desired one. ``${VAR}`` words in the desired argv are
    systemd environment substitutions (secrets): any single word matches them."""
    if len(expected) != len(running):
        return False
    for want, got in zip(expected, running):
        if re.fullmatch(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}", want):
            continue
        if want != got:
            return False
    return True


def env_mismatches(expected: dict[str, str], environ: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The desired environment variables a running process does not have as desired."""
    return {k: {"expected": v, "running": environ.get(k)} for k, v in sorted(expected.items()) if environ.get(k) != v}


def argv_flags(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Split an SGLang command line into its command words (interpreter, ``-m module``) and a
    {flag: value} map: a bare switch is True, one value a string, several (nargs) a list."""
    first = next((i for i, w in enumerate(argv) if w.startswith("--")), len(argv))
    flags: dict[str, Any] = {}
    key: str | None = None
    for word in argv[first:]:
        if word.startswith("--"):
            key, eq, value = word.partition("=")
            flags[key] = [value] if eq else []
            if eq:
                key = None
        elif key is not None:
            flags[key].append(word)
    simple = {k: (True if not v else v[0] if len(v) == 1 else v) for k, v in flags.items()}
    return argv[:first], simple


def argv_diff(before: list[str], after: list[str]) -> dict[str, Any]:
    """Flag-level difference of two SGLang command lines."""
    cmd_a, a = argv_flags(before)
    cmd_b, b = argv_flags(after)
    changed = {k: [a[k], b[k]] for k in sorted(a.keys() & b.keys()) if a[k] != b[k]}
    if cmd_a != cmd_b:
        changed["(command)"] = [" ".join(cmd_a), " ".join(cmd_b)]
    return {
        "changed": changed,
        "added": {k: b[k] for k in sorted(b.keys() - a.keys())},
        "removed": {k: a[k] for k in sorted(a.keys() - b.keys())},
    }


# --------------------------------------------------------------------------------------------
# Files (units, desired-state records, secrets) and users
# --------------------------------------------------------------------------------------------


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _owner_ids(owner: str, group: str) -> tuple[int, int]:
    return pwd.getpwnam(owner).pw_uid, grp.getgrnam(group).gr_gid


def write_atomic(path: str, content: str, mode: int, owner: str = "root", group: str = "root") -> None:
    """Write via a temporary file in the same directory and rename, so a reader (systemd, a
    crash) never sees a half-written unit or secrets file. The mode is set before any byte
    is written, so a secret is never world-readable even for an instant."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".sglang-fleet-")
    try:
        os.fchmod(fd, mode)
        uid, gid = _owner_ids(owner, group)
        os.fchown(fd, uid, gid)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def file_state(path: str) -> dict[str, Any]:
    try:
        st = os.stat(path)
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return {"exists": False}
    return {
        "exists": True,
        "sha256": _sha256(data),
        "text": data.decode("utf-8", "replace"),
        "mode": st.st_mode & 0o7777,
        "uid": st.st_uid,
        "gid": st.st_gid,
    }


def verify_unit_text(name: str, content: str) -> str | None:
    """``systemd-analyze verify`` on a unit before it is installed. Unknown keys and bad values
    only print warnings with rc=0, so any output about our unit counts as a failure."""
    if not _which("systemd-analyze"):
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


def _which(cmd: str) -> str | None:
    for directory in os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").split(os.pathsep):
        candidate = os.path.join(directory, cmd)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def ensure_user(spec: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    """A system user for the servers, in the groups that may open /dev/nvidia* (those that
    exist here)."""
    name = spec["name"]
    groups = [g for g in spec.get("groups", []) if _group_exists(g)]
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        entry = None
    changed = False
    actions: list[str] = []
    if entry is None:
        changed = True
        actions.append(f"create system user {name}")
        if not check_mode:
            argv = [
                "useradd",
                "--system",
                "--user-group",
                "--home-dir",
                spec["home"],
                "--create-home",
                "--shell",
                "/usr/sbin/nologin",
            ]
            if groups:
                argv += ["--groups", ",".join(groups)]
            rc, out, err = run_cmd([*argv, name])
            if rc != 0:
                raise EvidenceError(f"create user {name}", [*argv, name], rc, out, err)
    else:
        missing = [g for g in groups if name not in grp.getgrnam(g).gr_mem and grp.getgrnam(g).gr_gid != entry.pw_gid]
        if missing:
            changed = True
            actions.append(f"add {name} to groups {','.join(missing)}")
            if not check_mode:
                argv = ["usermod", "--append", "--groups", ",".join(missing), name]
                rc, out, err = run_cmd(argv)
                if rc != 0:
                    raise EvidenceError(f"add {name} to groups", argv, rc, out, err)
    return {"changed": changed, "actions": actions}


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def op_apply(req: dict[str, Any]) -> dict[str, Any]:
    """Converge the host's desired state: system user, directories, files (units, desired-state
    records, helper scripts, the secrets file); daemon-reload when a unit changed; enable and
    start instances that are not running. Never restarts a running instance: relaunching is
    the retune plugin's job, with its checks."""
    check = bool(req.get("check_mode"))
    result: dict[str, Any] = {"changed": False, "files": [], "actions": [], "started": []}
    for name in keep_running_as_last_good(req, check):
        result["changed"] = True
        result["actions"].append(f"keep the settings {name} runs now as its last good settings")
    if req.get("user"):
        user = ensure_user(req["user"], check)
        result["actions"] += user["actions"]
        result["changed"] |= user["changed"]
    for spec in req.get("directories", []):
        path = spec["path"]
        mode = int(spec.get("mode", "0755"), 8)
        if not os.path.isdir(path):
            result["changed"] = True
            result["actions"].append(f"create directory {path}")
            if not check:
                os.makedirs(path, mode=mode, exist_ok=True)
                uid, gid = _owner_ids(spec.get("owner", "root"), spec.get("group", "root"))
                os.chown(path, uid, gid)
                os.chmod(path, mode)
    unit_changed = False
    for spec in req.get("files", []):
        path = spec["path"]
        content = spec["content"]
        mode = int(spec.get("mode", "0644"), 8)
        owner, group = spec.get("owner", "root"), spec.get("group", "root")
        secret = bool(spec.get("secret"))
        before = file_state(path)
        want_sha = _sha256(content.encode())
        content_changed = not before["exists"] or before["sha256"] != want_sha
        meta_changed = before["exists"] and (
            before["mode"] != mode or (before["uid"], before["gid"]) != _owner_ids(owner, group)
        )
        entry: dict[str, Any] = {"path": path, "changed": bool(content_changed or meta_changed)}
        if content_changed and req.get("diff") and not secret:
            entry["diff"] = {
                "before_header": path,
                "after_header": path,
                "before": before.get("text", ""),
                "after": content,
            }
        if content_changed and path.endswith(".service") and spec.get("verify", True) and not secret:
            problem = verify_unit_text(os.path.basename(path), content)
            if problem:
                return {"failed": True, "msg": problem, "files": result["files"]}
        if entry["changed"]:
            result["changed"] = True
            if path.endswith((".service", ".conf")) and path.startswith(UNIT_DIR):
                unit_changed = True
            if not check:
                write_atomic(path, content, mode, owner, group)
        result["files"].append(entry)
    if unit_changed:
        result["actions"].append("systemctl daemon-reload")
        if not check:
            res = systemctl(["daemon-reload"])
            if res["rc"] != 0:
                return {"failed": True, "msg": f"daemon-reload failed: {res}", **result}
    units = list(req.get("units", []))
    if units and req.get("enable"):
        for unit in units:
            _rc, out, _ = run_cmd(["systemctl", "is-enabled", unit])
            if out.strip() != "enabled":
                result["changed"] = True
                result["actions"].append(f"enable {unit}")
                if not check:
                    res = systemctl(["enable", unit])
                    if res["rc"] != 0:
                        return {"failed": True, "msg": f"enable {unit} failed: {res}", **result}
    if units and req.get("start"):
        state = systemctl_show(units) if not unit_changed or not check else {}
        to_start = [
            u for u in units if state.get(u, {}).get("ActiveState") not in ("active", "activating", "reloading")
        ]
        if to_start:
            result["changed"] = True
            result["started"] = to_start
            result["actions"].append("start " + " ".join(to_start))
            if not check:
                # A deploy asks for these starts: clear a start-rate limit left by earlier failures
                # (the unit's start guard still waits for free GPUs and port).
                systemctl(["reset-failed", *to_start])
                # Blocks until each unit's ExecStartPost health wait succeeds (TimeoutStartSec).
                res = systemctl(["start", *to_start], timeout=float(req.get("start_timeout", 3600)))
                if res["rc"] != 0:
                    redactor = Redactor(read_env_file(req.get("secrets_file", SECRETS_FILE_DEFAULT)).values())
                    after = systemctl_show(to_start)
                    tails = {
                        u: journal_tail(after[u].get("InvocationID", ""), u, 25, redactor)
                        for u in to_start
                        if after[u].get("ActiveState") != "active"
                    }
                    return {
                        "failed": True,
                        "msg": f"starting {' '.join(to_start)} failed: rc={res['rc']} {res['stderr'].strip()}",
                        "journal": tails,
                        **result,
                    }
    return result


# --------------------------------------------------------------------------------------------
# Instance evidence
# --------------------------------------------------------------------------------------------


class Context:
    """What every retune operation needs: the secret values to redact, the API key to talk to
    the servers, tools and timeouts."""

    def __init__(self, req: dict[str, Any]):
        secrets = read_env_file(req.get("secrets_file", SECRETS_FILE_DEFAULT))
        self.api_key = secrets.get("SGLANG_API_KEY", "")
        self.redactor = Redactor(secrets.values())
        self.nvidia_smi = req.get("nvidia_smi", "nvidia-smi")
        self.nvidia_smi_timeout = float(req.get("nvidia_smi_timeout", 20))
        self.devices_dir = req.get("devices_dir", "/dev")
        self.http_timeout = float(req.get("http_timeout", 30))
        self.state_dir = req.get("state_dir", STATE_DIR_DEFAULT)
        self.desired_dir = req.get("desired_dir", DESIRED_DIR_DEFAULT)
        self.poll = float(req.get("poll_interval", 0.25))
        self.managed_units = list(req.get("managed_units", []))

    def last_good_path(self, name: str) -> str:
        return os.path.join(self.state_dir, "instances", name, "last-good.json")

    def desired_path(self, name: str) -> str:
        return os.path.join(self.desired_dir, f"{name}.json")


def _load_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None
    except ValueError:
        return {"_corrupt": True}


def _identity(state: dict[str, str]) -> dict[str, Any]:
    return {
        "main_pid": int(state.get("MainPID") or 0),
        "invocation_id": state.get("InvocationID", ""),
        "active_state": state.get("ActiveState", ""),
        "sub_state": state.get("SubState", ""),
        "result": state.get("Result", ""),
        "n_restarts": int(state.get("NRestarts") or 0),
    }


def _user_name(uid: int | None) -> str | None:
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def gpu_snapshot(ctx: Context) -> tuple[dict[int, dict[str, Any]] | None, dict[str, Any] | None]:
    try:
        return query_gpus(ctx.nvidia_smi, ctx.nvidia_smi_timeout), None
    except EvidenceError as exc:
        return None, exc.to_dict()


def probe_server(ctx: Context, instance: dict[str, Any]) -> dict[str, Any]:
    """/health, then /server_info (with the API key from the secrets file)."""
    out: dict[str, Any] = {"unanswered": []}
    status, body = http_request(instance_url(instance, "/health"), ctx.http_timeout)
    out["health_status"] = status
    if status is None:
        out["health_error"] = body
        if timed_out(body):
            out["unanswered"].append(f"/health did not answer within {ctx.http_timeout:.0f}s")
    status, body = http_request(instance_url(instance, "/server_info"), ctx.http_timeout, ctx.api_key)
    out["server_info_status"] = status
    if status is None and timed_out(body):
        out["unanswered"].append(
            f"/server_info did not answer within {ctx.http_timeout:.0f}s "
            "(it asks every scheduler: one is stuck or gone)"
        )
    if status == 200:
        try:
            info = json.loads(body)
        except ValueError:
            out["server_info_error"] = f"not JSON: {_clip(body, 300)!r}"
        else:
            out["server_info"] = ctx.redactor.obj(info)
            out["effective_max_running_requests"] = effective_max_running_requests(info)
    else:
        out["server_info_error"] = ctx.redactor.text(_clip(body, 300))
    return out


def _parallel(func: Callable[[dict[str, Any]], dict[str, Any]], items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run func over the instances at once (HTTP probes and waits are I/O bound)."""
    results: list[Any] = [None] * len(items)

    def worker(index: int, item: dict[str, Any]) -> None:
        try:
            results[index] = func(item)
        except EvidenceError as exc:
            results[index] = {"failed": True, "evidence_error": exc.to_dict(), "msg": exc.describe()}
        except Exception as exc:
            results[index] = {"failed": True, "msg": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=worker, args=(i, item), daemon=True) for i, item in enumerate(items)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def op_inspect(req: dict[str, Any]) -> dict[str, Any]:
    """Everything the decision needs, for every instance of the host, in one pass."""
    ctx = Context(req)
    instances = req["instances"]
    units = systemctl_show([i["unit"] for i in instances])
    gpus, gpu_error = gpu_snapshot(ctx)
    others = systemctl_show(sorted(set(ctx.managed_units) - set(units)))
    cgroups = {i["name"]: units[i["unit"]].get("ControlGroup", "") for i in instances}
    cgroups.update({f"other:{u}": s.get("ControlGroup", "") for u, s in others.items()})
    holders, holder_notes = collect_holders(ctx, instances, cgroups)

    def inspect_one(inst: dict[str, Any]) -> dict[str, Any]:
        state = units[inst["unit"]]
        ident = _identity(state)
        pid = ident["main_pid"]
        running = state.get("ActiveState") == "active" and pid > 0
        facts: dict[str, Any] = {
            "name": inst["name"],
            "unit": inst["unit"],
            "load_state": state.get("LoadState"),
            "running": running,
            "cgroup": state.get("ControlGroup", ""),
            "need_daemon_reload": state.get("NeedDaemonReload") == "yes",
            **ident,
        }
        if pid > 0:
            argv = proc_cmdline(pid)
            facts["argv"] = ctx.redactor.argv(argv)
            facts["argv_matches"] = argv_matches(inst.get("argv", []), argv)
            facts["env_mismatches"] = env_mismatches(inst.get("env") or {}, proc_environ(pid) or {})
            facts["user"] = _user_name(proc_uid(pid))
        if running:
            facts.update(probe_server(ctx, inst))
        facts["foreign"] = [_describe(p, ctx) for p in holders[inst["name"]]["foreign"]]
        facts["outside_unit"] = [
            _describe(p, ctx) for p in holders[inst["name"]]["owned"] if not p["reason"].startswith("in the instance")
        ]
        desired = _load_json(ctx.desired_path(inst["name"]))
        facts["installed_fingerprint"] = (desired or {}).get("fingerprint")
        facts["has_last_good"] = os.path.exists(ctx.last_good_path(inst["name"]))
        if gpus is not None:
            facts["gpu_used_mib"] = {str(g): gpus[g]["used_mib"] for g in inst["gpus"] if g in gpus}
            missing = [g for g in inst["gpus"] if g not in gpus]
            if missing:
                facts["gpu_missing"] = missing
        return facts

    results = _parallel(inspect_one, instances)
    host_errors = evidence_errors(gpu_error, holder_notes)
    for inst, facts in zip(instances, results):
        facts["evidence_errors"] = host_errors + instance_evidence_errors(inst, facts)
    return {
        "instances": {inst["name"]: res for inst, res in zip(instances, results)},
        "gpus": {str(k): v for k, v in (gpus or {}).items()},
        "gpu_error": gpu_error,
        "holder_notes": holder_notes,
    }


def evidence_errors(gpu_error: dict[str, Any] | None, holder_notes: dict[str, Any]) -> list[dict[str, Any]]:
    """The host's sources of evidence that did not answer correctly before anything was
    touched. The stop, release and start proofs need every one of them: with one broken, an
    instance stopped now could not be proven dead or its GPU free, and would be left down."""
    errors = []
    if gpu_error:
        errors.append(gpu_error)
    smi = holder_notes.get("nvidia_smi_error")
    if smi and smi.get("cmd") not in {e.get("cmd") for e in errors}:
        errors.append(smi)
    return errors


def instance_evidence_errors(inst: dict[str, Any], facts: dict[str, Any]) -> list[dict[str, Any]]:
    """Per instance: nvidia-smi lists its GPUs, and a running instance's main process is in the
    unit's cgroup and its /proc entry is readable (the stop proof scans both)."""
    errors: list[dict[str, Any]] = []
    if facts.get("gpu_missing"):
        errors.append(
            {"what": "GPU memory", "msg": f"GPU memory: nvidia-smi does not list GPU(s) {facts['gpu_missing']}"}
        )
    pid = int(facts.get("main_pid") or 0)
    if facts.get("running") and pid > 0:
        cgroup = facts.get("cgroup") or ""
        actual = proc_cgroup(pid)
        if not cgroup or not (actual == cgroup or actual.startswith(cgroup + "/")):
            errors.append(
                {
                    "what": "the unit's cgroup",
                    "msg": f"the unit's cgroup: systemd names cgroup {cgroup!r} for {inst['unit']} "
                    f"but its main PID {pid} is in {actual!r}",
                }
            )
        if not os.access(f"/proc/{pid}/fd", os.R_OK | os.X_OK):
            errors.append(
                {"what": "/proc", "msg": f"/proc: cannot read /proc/{pid}/fd (the GPU handles of the main process)"}
            )
    return errors


# --------------------------------------------------------------------------------------------
# Stop and prove dead
# --------------------------------------------------------------------------------------------


def _wait_units(
    units: list[str], done: Callable[[dict[str, str]], bool], timeout: float, poll: float
) -> dict[str, dict[str, str]]:
    deadline = time.monotonic() + timeout
    while True:
        state = systemctl_show(units)
        if all(done(state[u]) for u in units) or time.monotonic() >= deadline:
            return state
        time.sleep(poll)


def _stopped(state: dict[str, str]) -> bool:
    return state.get("ActiveState") in ("inactive", "failed") and state.get("SubState") != "auto-restart"


def collect_holders(
    ctx: Context, instances: list[dict[str, Any]], cgroups: dict[str, str]
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Classify, per instance, the processes between it and a relaunch."""
    table = process_table(ctx.devices_dir)
    notes: dict[str, Any] = {}
    try:
        gpus = query_gpus(ctx.nvidia_smi, ctx.nvidia_smi_timeout)
        apps = query_compute_apps(ctx.nvidia_smi, ctx.nvidia_smi_timeout, {g["uuid"]: i for i, g in gpus.items()})
        app_pids, meaningful = meaningful_app_pids(apps, table)
        notes["compute_apps"] = apps
        notes["compute_app_pids_meaningful"] = meaningful
    except EvidenceError as exc:
        # Device handles still tell who holds a GPU; the memory check will fail closed on
        # its own if nvidia-smi stays unusable.
        app_pids = {}
        notes["nvidia_smi_error"] = exc.to_dict()
    other = [c for c in cgroups.values() if c]
    out = {}
    for inst in instances:
        view = {"gpus": inst["gpus"], "port": inst["port"], "cgroup": cgroups.get(inst["name"], "")}
        out[inst["name"]] = classify_processes(view, table, other, app_pids)
    return out, notes


def op_stop(req: dict[str, Any]) -> dict[str, Any]:
    """Stop the units, then prove each instance dead: its cgroup empty, nothing of it holding
    its GPUs or listening on its port. Survivors that are the instance's own are killed by PID
    (SIGTERM, then SIGKILL); anything else in the way fails the instance closed."""
    ctx = Context(req)
    instances = req["instances"]
    units = [i["unit"] for i in instances]
    stop_timeout = float(req.get("stop_timeout", 120))
    kill_timeout = float(req.get("kill_timeout", 10))
    t0 = time.monotonic()
    before = systemctl_show(units)
    # Every managed instance's cgroup, to tell "another instance's process" from "foreign".
    all_units = sorted(set(ctx.managed_units) | set(units))
    cgroups_all = {u: s.get("ControlGroup", "") for u, s in systemctl_show(all_units).items()}
    cgroups = {i["name"]: cgroups_all.get(i["unit"], "") or _default_cgroup(cgroups_all, i["unit"]) for i in instances}
    actions: dict[str, list[str]] = {i["name"]: [] for i in instances}
    to_stop = [
        u
        for u in units
        if before[u].get("ActiveState") not in ("inactive",) or before[u].get("SubState") == "auto-restart"
    ]
    if to_stop:
        res = systemctl(["stop", "--no-block", *to_stop])
        for inst in instances:
            if inst["unit"] in to_stop:
                actions[inst["name"]].append(f"systemctl stop (rc={res['rc']})")
    state = _wait_units(units, _stopped, stop_timeout, ctx.poll)
    escalated = [u for u in units if not _stopped(state[u])]
    # Processes known to have been SIGKILLed (pid, start time): one still present is in teardown
    # (the kernel and the GPU driver release its memory, handles and sockets; over 30 s seen on
    # large GPUs), not a survivor: it is waited for within the release deadline.
    sigkilled: set[tuple[int, int]] = set()
    if escalated:
        # The drain did not finish in time (or the main process ignores SIGTERM): SIGKILL the
        # whole unit cgroup, which is exactly the instance's processes.
        escalated_cgroups = [cgroups_all.get(u, "") for u in escalated]
        sigkilled |= {
            (pid, p["starttime"])
            for pid, p in process_table(ctx.devices_dir).items()
            if any(c and (p["cgroup"] == c or p["cgroup"].startswith(c + "/")) for c in escalated_cgroups)
        }
        res = systemctl(["kill", "--kill-whom=all", "--signal=SIGKILL", *escalated])
        for inst in instances:
            if inst["unit"] in escalated:
                actions[inst["name"]].append(
                    f"stop deadline {stop_timeout:.0f}s passed: systemctl kill SIGKILL (rc={res['rc']})"
                )
        state = _wait_units(units, _stopped, kill_timeout, ctx.poll)
    unit_stopped_at = {u: time.monotonic() - t0 for u in units}
    # This wave's cgroups by instance name, and the other managed units' (never killed).
    holder_cgroups = {**cgroups, **{f"other:{u}": c for u, c in cgroups_all.items() if u not in units}}
    holders, notes = collect_holders(ctx, instances, holder_cgroups)
    killed: dict[str, list[dict[str, Any]]] = {i["name"]: [] for i in instances}
    owned_all = []
    for inst in instances:
        owned_all += [
            dict(o, instance=inst["name"])
            for o in holders[inst["name"]]["owned"]
            if not dying(o, sigkilled)  # a second SIGKILL does nothing to a process in teardown
        ]
    if owned_all:
        unique = {o["pid"]: o for o in owned_all}
        log = kill_with_escalation(list(unique.values()), kill_timeout, ctx.redactor, ctx.poll)
        for entry in log:
            killed[unique[entry["pid"]]["instance"]].append(entry)
            if entry["signal"] == "SIGKILL":
                sigkilled.add((entry["pid"], unique[entry["pid"]]["starttime"]))
        holders, notes = collect_holders(ctx, instances, holder_cgroups)
    teardown_t0 = time.monotonic()
    release_deadline = teardown_t0 + float(req.get("release_timeout", 300))
    teardown_s = 0.0
    while any(_in_teardown(holders[i["name"]], sigkilled) for i in instances) and time.monotonic() < release_deadline:
        time.sleep(ctx.poll)
        holders, notes = collect_holders(ctx, instances, holder_cgroups)
        teardown_s = round(time.monotonic() - teardown_t0, 3)
    final = systemctl_show(units)
    if not all(_stopped(final[u]) for u in units):
        # Once the last process of a unit is gone, systemd needs a moment to mark it stopped.
        final = _wait_units(units, _stopped, kill_timeout, ctx.poll)
    out: dict[str, Any] = {}
    for inst in instances:
        name, unit = inst["name"], inst["unit"]
        h = holders[name]
        st = final[unit]
        if st.get("ActiveState") == "failed":
            # A stop that ended in SIGKILL leaves the unit failed; clear it so a start is clean.
            systemctl(["reset-failed", unit])
            actions[name].append("systemctl reset-failed")
        dead = not h["owned"] and not h["foreign"] and _stopped(st)
        entry = {
            "dead": dead,
            "old_main_pid": int(before[unit].get("MainPID") or 0),
            "old_invocation_id": before[unit].get("InvocationID", ""),
            "unit_state": f"{st.get('ActiveState')}/{st.get('SubState')}",
            "escalated": unit in escalated,
            "killed": killed[name],
            "survivors": [_describe(p, ctx) for p in h["owned"]],
            "foreign": [_describe(p, ctx) for p in h["foreign"]],
            "time_to_dead_s": round(time.monotonic() - t0, 3) if dead else None,
            "unit_stopped_s": round(unit_stopped_at[unit], 3),
            "actions": actions[name],
        }
        in_teardown = [p for p in h["owned"] if dying(p, sigkilled)]
        if teardown_s > 0:
            entry["teardown_s"] = teardown_s  # waited for processes in teardown after SIGKILL
        if h["foreign"]:
            entry["msg"] = "; ".join(
                f"PID {p['pid']} ({' '.join(ctx.redactor.argv(p['cmdline'])) or '?'}) {p['reason']}"
                for p in h["foreign"]
            )
        elif in_teardown and len(in_teardown) == len(h["owned"]):
            entry["msg"] = f"still in teardown {teardown_s:.0f}s after SIGKILL (the release deadline): " + ", ".join(
                f"PID {p['pid']} ({' '.join(ctx.redactor.argv(p['cmdline']))})" for p in in_teardown
            )
        elif h["owned"]:
            entry["msg"] = "survived SIGKILL: " + ", ".join(str(p["pid"]) for p in h["owned"])
        elif not _stopped(st):
            entry["msg"] = f"unit still {entry['unit_state']} after the stop deadline and SIGKILL"
        out[name] = entry
    return {"instances": out, "notes": notes}


def dying(proc: dict[str, Any], sigkilled: set[tuple[int, int]]) -> bool:
    """Already SIGKILLed (by us, or by the unit's escalation) and still present: in teardown."""
    return (proc["pid"], proc["starttime"]) in sigkilled


def _in_teardown(holders: dict[str, list[dict[str, Any]]], sigkilled: set[tuple[int, int]]) -> bool:
    """Everything still between the instance and a relaunch is its own processes in teardown:
    worth waiting for (anything else is not: a foreign holder or a process never killed)."""
    return bool(holders["owned"]) and not holders["foreign"] and all(dying(p, sigkilled) for p in holders["owned"])


def _default_cgroup(cgroups: dict[str, str], unit: str) -> str:
    """An inactive unit has no ControlGroup: derive its path from a sibling's, so stragglers
    that systemd still files under it are recognised."""
    for known_unit, path in cgroups.items():
        if path and path.endswith("/" + known_unit):
            return path[: -len(known_unit)] + unit
    return ""


def _describe(proc: dict[str, Any], ctx: Context) -> dict[str, Any]:
    return {
        "pid": proc["pid"],
        "cmdline": " ".join(ctx.redactor.argv(proc["cmdline"])),
        "reason": proc["reason"],
        "gpus": proc["gpus"],
        "port": proc["port"],
    }


# --------------------------------------------------------------------------------------------
# GPU memory release
# --------------------------------------------------------------------------------------------


def op_release(req: dict[str, Any]) -> dict[str, Any]:
    """Poll per-GPU memory.used (correct inside containers too, unlike compute-app PIDs) until
    every GPU of the instances is at or below the threshold, or the deadline passes."""
    ctx = Context(req)
    instances = req["instances"]
    threshold = int(req.get("threshold_mib", 1024))
    timeout = float(req.get("release_timeout", 300))
    t0 = time.monotonic()
    deadline = t0 + timeout
    pending = {i["name"]: list(i["gpus"]) for i in instances}
    out: dict[str, Any] = {i["name"]: {"released": False, "samples": 0} for i in instances}
    first: dict[int, dict[str, Any]] | None = None
    while True:
        try:
            gpus = query_gpus(ctx.nvidia_smi, ctx.nvidia_smi_timeout)
        except EvidenceError as exc:
            for name in pending:
                out[name].update({"released": False, "evidence_error": exc.to_dict(), "msg": exc.describe()})
            return {"instances": out}
        first = first or gpus
        now = time.monotonic()
        for inst in instances:
            name = inst["name"]
            if name not in pending:
                continue
            missing = [g for g in inst["gpus"] if g not in gpus]
            if missing:
                out[name].update({"msg": f"nvidia-smi does not list GPU(s) {missing}"})
                del pending[name]
                continue
            used = {str(g): gpus[g]["used_mib"] for g in inst["gpus"]}
            out[name]["samples"] += 1
            out[name]["used_mib"] = used
            out[name]["used_mib_first"] = {str(g): first[g]["used_mib"] for g in inst["gpus"] if g in first}
            if all(v <= threshold for v in used.values()):
                out[name].update({"released": True, "time_to_release_s": round(now - t0, 3)})
                del pending[name]
        if not pending or now >= deadline:
            break
        time.sleep(ctx.poll)
    for name in pending:
        out[name]["msg"] = (
            f"GPU memory not released within {timeout:.0f}s: memory.used {out[name].get('used_mib')} MiB "
            f"> threshold {threshold} MiB, with no process of the instance left"
        )
    return {"instances": out}


# --------------------------------------------------------------------------------------------
# Start and prove healthy
# --------------------------------------------------------------------------------------------


def op_start(req: dict[str, Any]) -> dict[str, Any]:
    """Start each instance (its desired unit, or its last good one for a rollback), prove it
    is a new process (new main PID and invocation), healthy (/health 200), serving exactly the
    expected settings (/server_info, its own command line and environment), with the asserted
    capacity, and able to answer real completions. Records the last good settings on success."""
    ctx = Context(req)
    instances = req["instances"]
    start_timeout = float(req.get("start_timeout", 1800))
    health_timeout = float(req.get("health_timeout", 120))
    out: dict[str, Any] = {}
    ready: list[dict[str, Any]] = []
    listen_ports = set(listening_sockets().values())
    table: dict[int, dict[str, Any]] | None = None
    for inst in instances:
        name = inst["name"]
        res: dict[str, Any] = {"started": False, "healthy": False, "actions": []}
        out[name] = res
        if inst.get("use_last_good"):
            record = _load_json(ctx.last_good_path(name))
            if not record or record.get("_corrupt"):
                res["msg"] = f"no usable last good settings recorded at {ctx.last_good_path(name)}"
                continue
            inst.update(
                argv=record["argv"],
                env=record["env"],
                expected_server_info=record["expected_server_info"],
                fingerprint=record["fingerprint"],
            )
            unit_path = record["unit_path"]
            if file_state(unit_path).get("sha256") != _sha256(record["unit_text"].encode()):
                write_atomic(unit_path, record["unit_text"], 0o644)
                res["actions"].append(f"restored last good unit {unit_path}")
                systemctl(["daemon-reload"])
        else:
            desired = _load_json(ctx.desired_path(name)) or {}
            if desired.get("fingerprint") != inst["fingerprint"]:
                res["msg"] = (
                    f"the desired state installed on the host ({ctx.desired_path(name)}, fingerprint "
                    f"{desired.get('fingerprint')}) is not the inventory's ({inst['fingerprint']}): "
                    "apply the server role first (retune.yml does)"
                )
                continue
        if inst["port"] in listen_ports:
            table = table or process_table(ctx.devices_dir)
            holders = [p for p in table.values() if inst["port"] in p["ports"]]
            res["msg"] = f"port {inst['port']} is already in use by " + ", ".join(
                f"PID {p['pid']} ({' '.join(ctx.redactor.argv(p['cmdline']))})" for p in holders
            )
            continue
        ready.append(inst)
    if not ready:
        return {"instances": out}
    units = [i["unit"] for i in ready]
    systemctl(["reset-failed", *units])
    t0 = time.monotonic()
    res_start = systemctl(["start", "--no-block", *units])
    for inst in ready:
        out[inst["name"]]["actions"].append(f"systemctl start --no-block (rc={res_start['rc']})")

    def start_one(inst: dict[str, Any]) -> dict[str, Any]:
        return _prove_started(ctx, inst, t0, start_timeout, health_timeout, req)

    for inst, res in zip(ready, _parallel(start_one, ready)):
        out[inst["name"]].update(res)
    return {"instances": out}


def _prove_started(
    ctx: Context,
    inst: dict[str, Any],
    t0: float,
    start_timeout: float,
    health_timeout: float,
    req: dict[str, Any],
) -> dict[str, Any]:
    unit = inst["unit"]
    old_pid = int(inst.get("old_main_pid") or 0)
    old_inv = inst.get("old_invocation_id") or ""
    res: dict[str, Any] = {"started": False, "healthy": False}
    deadline = t0 + start_timeout
    first_state: dict[str, Any] | None = None
    state: dict[str, str] = {}
    seen_activity = False
    while True:
        state = systemctl_show([unit])[unit]
        ident = _identity(state)
        first_state = first_state or ident
        new_identity = ident["main_pid"] > 0 and ident["main_pid"] != old_pid and ident["invocation_id"] != old_inv
        # A queued start job leaves the unit inactive for a moment: "inactive" means it ended
        # only once it had been seen activating (or long after the start was asked for).
        seen_activity = seen_activity or ident["active_state"] in ("activating", "active") or new_identity
        crashed = (
            ident["active_state"] == "failed"
            or ident["sub_state"] == "auto-restart"
            or ident["n_restarts"] > first_state["n_restarts"]
            or (ident["active_state"] == "inactive" and (seen_activity or time.monotonic() - t0 > 30))
        )
        if crashed:
            res.update(
                msg=f"crashed while starting: unit {ident['active_state']}/{ident['sub_state']} "
                f"(result {ident['result']})",
                crashed=True,
                journal=journal_tail(ident["invocation_id"] or old_inv, unit, 30, ctx.redactor),
                new_main_pid=ident["main_pid"],
            )
            return res
        if new_identity:
            res["started"] = True
            res["new_main_pid"] = ident["main_pid"]
            res["new_invocation_id"] = ident["invocation_id"]
            status, _ = http_request(
                instance_url(inst, "/health"), min(ctx.http_timeout, max(1.0, deadline - time.monotonic()))
            )
            if status == 200:
                res["time_to_healthy_s"] = round(time.monotonic() - t0, 3)
                break
        if time.monotonic() >= deadline:
            res.update(
                msg=f"not healthy within the start deadline of {start_timeout:.0f}s "
                f"(unit {ident['active_state']}/{ident['sub_state']})",
                journal=journal_tail(ident["invocation_id"], unit, 30, ctx.redactor),
            )
            return res
        time.sleep(ctx.poll)
    return _prove_settings(ctx, inst, res, state, health_timeout, req)


def _prove_settings(
    ctx: Context,
    inst: dict[str, Any],
    res: dict[str, Any],
    state: dict[str, str],
    health_timeout: float,
    req: dict[str, Any],
) -> dict[str, Any]:
    problems: list[str] = []
    pid = res["new_main_pid"]
    cgroup = state.get("ControlGroup", "")
    # Who owns the port: the new server, not a leftover that answered its warmup.
    table = process_table(ctx.devices_dir)
    listeners = [p for p in table.values() if inst["port"] in p["ports"]]
    strangers = [
        p for p in listeners if not (cgroup and (p["cgroup"] == cgroup or p["cgroup"].startswith(cgroup + "/")))
    ]
    if not listeners or strangers:
        problems.append(
            f"port {inst['port']} is not served by the unit's processes: "
            + (", ".join(f"PID {p['pid']}" for p in strangers) or "nobody listens")
        )
    argv = proc_cmdline(pid)
    res["argv"] = ctx.redactor.argv(argv)
    if not argv_matches(inst["argv"], argv):
        problems.append("the running command line differs from the desired one")
        res["argv_diff"] = argv_diff(ctx.redactor.argv(argv), inst["argv"])
    environ = proc_environ(pid) or {}
    env_bad = {k: environ.get(k) for k, v in inst.get("env", {}).items() if environ.get(k) != v}
    if env_bad:
        problems.append(f"environment differs: {sorted(env_bad)}")
    probe = probe_server(ctx, inst)
    res["health_status"] = probe.get("health_status")
    if probe.get("unanswered"):
        problems += probe["unanswered"]
    elif probe.get("server_info_status") != 200:
        problems.append(f"/server_info answered {probe.get('server_info_status')}: {probe.get('server_info_error')}")
    else:
        info = probe["server_info"]
        mismatches = compare_server_info(inst.get("expected_server_info", {}), info)
        if mismatches:
            res["server_info_mismatches"] = mismatches
            problems.append(
                "/server_info reports other settings: "
                + ", ".join(f"{m['arg']}={m['reported']!r} (expected {m['expected']!r})" for m in mismatches)
            )
        res["effective_max_running_requests"] = probe.get("effective_max_running_requests")
        res["version"] = info.get("version")
        minimum = req.get("min_max_running_requests")
        if minimum and (res["effective_max_running_requests"] or 0) < int(minimum):
            problems.append(
                f"effective max running requests {res['effective_max_running_requests']} "
                f"is below the asserted minimum {minimum}"
            )
    if not problems:
        smoke = smoke_requests(ctx, inst, int(req.get("smoke_requests", 2)), health_timeout, req)
        res["smoke"] = smoke
        if smoke["ok"] < smoke["sent"]:
            problems.append(
                f"{smoke['sent'] - smoke['ok']} of {smoke['sent']} smoke completions failed: {smoke['errors'][:2]}"
            )
    if problems:
        res["msg"] = "; ".join(problems)
        res["journal"] = journal_tail(res.get("new_invocation_id", ""), inst["unit"], 20, ctx.redactor)
        return res
    res["healthy"] = True
    if req.get("record_last_good", True):
        record_last_good(ctx, inst)
        res["recorded_last_good"] = True
    return res


def smoke_requests(
    ctx: Context, inst: dict[str, Any], count: int, timeout: float, req: dict[str, Any]
) -> dict[str, Any]:
    """A few real completions: /health alone passes while generation hangs (sglang#22779)."""
    sent, ok, errors = 0, 0, []
    for i in range(count):
        body = {
            "model": inst.get("served_model_name") or "default",
            "prompt": f"sglang-fleet health check {i}: the capital of France is",
            "max_tokens": int(req.get("smoke_max_tokens", 8)),
            "temperature": 0,
        }
        sent += 1
        status, text = http_request(instance_url(inst, "/v1/completions"), timeout, ctx.api_key, body)
        if status == 200:
            try:
                choices = json.loads(text).get("choices") or []
            except ValueError:
                choices = []
            if choices:
                ok += 1
                continue
        errors.append(f"status {status}: {ctx.redactor.text(_clip(text, 200))}")
    return {"sent": sent, "ok": ok, "errors": errors}


def _last_good_record(inst: dict[str, Any], unit_path: str, unit_text: str) -> str:
    record = {
        "name": inst["name"],
        "unit": inst["unit"],
        "unit_path": unit_path,
        "unit_text": unit_text,
        "argv": inst["argv"],
        "env": inst.get("env") or {},
        "expected_server_info": inst.get("expected_server_info") or {},
        "fingerprint": inst.get("fingerprint"),
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return json.dumps(record, indent=2, sort_keys=True) + "\n"


def record_last_good(ctx: Context, inst: dict[str, Any]) -> None:
    unit_path = os.path.join(UNIT_DIR, inst["unit"])
    text = _last_good_record(inst, unit_path, file_state(unit_path).get("text", ""))
    write_atomic(ctx.last_good_path(inst["name"]), text, 0o644)


def keep_running_as_last_good(req: dict[str, Any], check: bool) -> list[str]:
    """Before new settings overwrite an instance's unit, keep the settings it runs now as its last
    good settings if none are recorded yet (the first change after a deploy), so that a retune
    whose new settings fail has something to roll back to. Kept only on evidence that the old
    unit is what runs: the unit is active (its start waited for /health), and its main process
    has the command line and environment of the installed desired-settings record."""
    state_dir = req.get("state_dir", STATE_DIR_DEFAULT)
    desired_dir = req.get("desired_dir", DESIRED_DIR_DEFAULT)
    specs = {spec["path"]: spec for spec in req.get("files", [])}
    kept = []
    for path, spec in specs.items():
        if os.path.dirname(path) != desired_dir or not path.endswith(".json"):
            continue
        try:
            new = json.loads(spec["content"])
        except ValueError:
            continue
        name, unit = new.get("name"), new.get("unit")
        if not isinstance(name, str) or not isinstance(unit, str):
            continue
        unit_path = os.path.join(UNIT_DIR, unit)
        unit_spec = specs.get(unit_path)
        before = file_state(unit_path)
        if unit_spec is None or not before["exists"] or before["sha256"] == _sha256(unit_spec["content"].encode()):
            continue  # no unit yet, or it is not about to change
        last_good = os.path.join(state_dir, "instances", name, "last-good.json")
        old = _load_json(path)
        if os.path.exists(last_good) or not old or old.get("name") != name or not old.get("argv"):
            continue
        state = systemctl_show([unit]).get(unit, {})
        pid = _identity(state)["main_pid"]
        if state.get("ActiveState") != "active" or pid <= 0 or not argv_matches(old["argv"], proc_cmdline(pid)):
            continue
        if env_mismatches(old.get("env") or {}, proc_environ(pid) or {}):
            continue
        kept.append(name)
        if not check:
            old["unit"] = unit
            write_atomic(last_good, _last_good_record(old, unit_path, before.get("text", "")), 0o644)
    return kept


def op_record(req: dict[str, Any]) -> dict[str, Any]:
    """Record the last good settings of instances verified unchanged (first run after a deploy)."""
    ctx = Context(req)
    for inst in req["instances"]:
        record_last_good(ctx, inst)
    return {"recorded": [i["name"] for i in req["instances"]]}


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------

OPS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "apply": op_apply,
    "inspect": op_inspect,
    "stop": op_stop,
    "release": op_release,
    "start": op_start,
    "record": op_record,
}


def run(req: dict[str, Any]) -> dict[str, Any]:
    op = req.get("op")
    if op not in OPS:
        return {"failed": True, "msg": f"unknown agent operation {op!r}"}
    try:
        result = OPS[op](req)
    except EvidenceError as exc:
        return {"failed": True, "msg": exc.describe(), "evidence_error": exc.to_dict()}
    result.setdefault("agent_version", AGENT_VERSION)
    return result


def main() -> None:
    request = json.loads(sys.stdin.read())
    json.dump(run(request), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
