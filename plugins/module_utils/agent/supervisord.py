# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""supervisord: the supervision of a pod, a host whose PID 1 is not systemd (see ``supervision``).

Everything of it lives under one root (``supervisor_root``, on the pod's persistent volume), laid
out by :func:`layout`: supervisord's own virtualenv and configuration, one program file per
service, each service's log files (rotated by supervisord) and working directory, and the start
ledger of each instance. Only the control socket is elsewhere (:data:`SOCKET`, on tmpfs: a network
volume may not hold sockets); it is root's alone (mode 0700), so supervisord asks no password.

Identity without cgroups: every process of a service runs in the service's own working directory
(``services/<program>``), set by supervisord and inherited by every child, detached and
re-parented ones included. ``/proc/PID/cwd`` names it even where SGLang's ``setproctitle`` has
wiped what ``/proc/PID/environ`` shows (it does, for every titled child: a marker in the
environment cannot be read back from the schedulers). So the service's process group key (its
``ControlGroup``) is that directory.

Launches: the instance's start command (``sglang-fleet-supervised-start``) writes one line,
``LAUNCH_MARK pid=<pid>``, to the program's log before it runs the start guard; the service's
``InvocationID`` is ``<start time>-<pid>`` and its log since that launch is what follows the
line. Restarts: that command counts each start in the ledger (``starts/<program>``) and refuses a
start beyond the limit; :meth:`Supervisord.reset_failed` clears it, as ``systemctl reset-failed``
clears systemd's count.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import signal
import socket
import xmlrpc.client
from typing import Any

from .evidence import Redactor, run_cmd
from .procfs import proc_stat
from .supervision import Outcome, Supervision

SOCKET = "/run/sglang-fleet/supervisord.sock"
LAUNCH_MARK = "sglang-fleet: launch"
# The exit status of a start refused by the start ledger (a server that failed at every start):
# supervisord treats it as expected, so it does not restart it again.
START_LIMIT_EXIT = 78
# A start ledger holds one line per start (its time), and ``REFUSED TIME`` after a start refused.
LEDGER_REFUSED = "REFUSED"
LOG_MAX_LINES = 200
RPC_TIMEOUT = 30.0

# supervisord's process states, in systemd's words: (ActiveState, SubState).
STATES = {
    "STOPPED": ("inactive", "dead"),
    "STARTING": ("activating", "start"),
    "RUNNING": ("active", "running"),
    "BACKOFF": ("activating", "auto-restart"),
    "STOPPING": ("deactivating", "stop-sigterm"),
    "EXITED": ("inactive", "dead"),
    "FATAL": ("failed", "failed"),
    "UNKNOWN": ("failed", "failed"),
}


def layout(root: str) -> dict[str, str]:
    """The paths under the supervision root (the server role installs them where this says)."""
    return {
        "root": root,
        "venv": os.path.join(root, "venv"),
        # The start command every program runs (sglang-fleet-supervised-start), beside the host agent.
        "bin": os.path.join(root, "bin"),
        "start_command": os.path.join(root, "bin", "sglang-fleet-supervised-start"),
        # supervisor's wheel, copied from the controller (the pod needs no package index).
        "wheels": os.path.join(root, "wheels"),
        "config": os.path.join(root, "supervisord.conf"),
        "programs": os.path.join(root, "programs"),
        "logs": os.path.join(root, "logs"),
        "services": os.path.join(root, "services"),
        "starts": os.path.join(root, "starts"),
        "pidfile": os.path.join(os.path.dirname(SOCKET), "supervisord.pid"),
        "socket": SOCKET,
        # Not a path: the exit status of a start the ledger refuses (the program file declares it).
        "start_limit_exit": str(START_LIMIT_EXIT),
    }


def service_directory(services_dir: str, service: str) -> str:
    """A service's working directory under the services' directory: the key of its processes."""
    return os.path.join(services_dir, program_name(service))


def directories(root: str, services: list[str]) -> list[dict[str, str]]:
    """The directories the server role creates under the supervision root, with their modes (root
    owns them): the logs readable by root's group only, the start ledgers by root only, and each
    service's working directory."""
    paths = layout(root)
    fixed = [
        (paths["root"], "0755"),
        (paths["programs"], "0755"),
        (paths["logs"], "0750"),
        (paths["services"], "0755"),
        (paths["starts"], "0700"),
        (paths["wheels"], "0755"),
        (paths["bin"], "0755"),
    ]
    services_dirs = [(service_directory(paths["services"], s), "0755") for s in services]
    return [{"path": path, "mode": mode, "owner": "root", "group": "root"} for path, mode in fixed + services_dirs]


def is_start(line: str) -> bool:
    """A line of a start ledger that counts a start (not a refused one)."""
    try:
        float(line)
    except ValueError:
        return False
    return True


def program_name(service: str) -> str:
    """supervisord's name for a service: the unit's name without ``.service``."""
    return service[: -len(".service")] if service.endswith(".service") else service


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class _UnixTransport(xmlrpc.client.Transport):
    def __init__(self, path: str, timeout: float):
        super().__init__()
        self._path = path
        self._timeout = timeout

    def make_connection(self, host: Any) -> http.client.HTTPConnection:
        return _UnixConnection(self._path, self._timeout)


def rpc(path: str = SOCKET, timeout: float = RPC_TIMEOUT) -> Any:
    """supervisord's XML-RPC interface over its unix socket."""
    return xmlrpc.client.ServerProxy("http://localhost", transport=_UnixTransport(path, timeout), allow_none=True)


class Supervisord(Supervision):
    kind = "supervisord"
    reload_action = "supervisorctl reread"

    def __init__(self, root: str, socket_path: str = SOCKET):
        if not root:
            raise ValueError(
                "the supervisord supervision needs supervisor_root (the server role's sglang_server_supervisor_root)"
            )
        self.paths = layout(root)
        self.paths["socket"] = socket_path
        self.definitions_dir = self.paths["programs"]

    # -- calls ----------------------------------------------------------------------------------

    def _rpc(self, timeout: float = RPC_TIMEOUT) -> Any:
        return rpc(self.paths["socket"], timeout)

    def _act(self, verb: str, services: list[str], wait: bool, timeout: float, no_matter: str) -> Outcome:
        """``startProcess`` or ``stopProcess`` (``verb``) of each service, waiting for each when
        ``wait``; a fault naming ``no_matter`` (already started, not running) is no failure."""
        cmd = f"supervisorctl {verb} " + " ".join(program_name(s) for s in services)
        proxy = rpc(self.paths["socket"], timeout if wait else RPC_TIMEOUT)
        errors = []
        for service in services:
            try:
                getattr(proxy.supervisor, f"{verb}Process")(program_name(service), wait)
            except xmlrpc.client.Fault as fault:
                if no_matter not in fault.faultString:
                    errors.append(f"{program_name(service)}: {fault.faultString}")
            except OSError as exc:
                return {"cmd": cmd, "rc": 1, "stdout": "", "stderr": f"supervisord at {self.paths['socket']}: {exc}"}
        return {"cmd": cmd, "rc": 1 if errors else 0, "stdout": "", "stderr": "; ".join(errors)}

    # -- state ----------------------------------------------------------------------------------

    def show(self, services: list[str]) -> dict[str, dict[str, str]]:
        from .evidence import EvidenceError  # noqa: PLC0415

        try:
            infos = {i["name"]: i for i in self._rpc().supervisor.getAllProcessInfo()}
            changed = self._pending()
        except (OSError, xmlrpc.client.Fault) as exc:
            raise EvidenceError(
                "supervisord program state", ["supervisor.getAllProcessInfo", self.paths["socket"]], 1, "", str(exc)
            ) from None
        return {s: self._state(s, infos.get(program_name(s)), changed) for s in services}

    def _pending(self) -> set[str]:
        """Programs whose file changed since supervisord read it (``supervisorctl reread``)."""
        added, changed, removed = self._rpc().supervisor.reloadConfig()[0]
        return set(added) | set(changed) | set(removed)

    def _state(self, service: str, info: dict[str, Any] | None, pending: set[str]) -> dict[str, str]:
        program = program_name(service)
        group = self.service_dir(service)
        if info is None:
            return {
                "Id": service,
                "LoadState": "loaded" if program in pending else "not-found",
                "ActiveState": "inactive",
                "SubState": "dead",
                "Result": "success",
                "MainPID": "0",
                "InvocationID": "",
                "NRestarts": "0",
                "ControlGroup": group,
                "NeedDaemonReload": "yes" if program in pending else "no",
                "UnitFileState": "enabled",
            }
        name = info["statename"]
        active, sub = STATES.get(name, ("failed", "failed"))
        exitstatus = int(info.get("exitstatus") or 0)
        ledger = self._ledger(service)
        starts = sum(1 for line in ledger if is_start(line))
        result = "success"
        refused = bool(ledger) and ledger[-1].startswith(LEDGER_REFUSED)
        if name in ("FATAL", "BACKOFF") or (name == "EXITED" and exitstatus != 0):
            result = "start-limit-hit" if refused or exitstatus == START_LIMIT_EXIT else "exit-code"
            # An exit the program file does not expect (a crash) is restarted at once, as BACKOFF
            # is: systemd's auto-restart. An expected one that is not 0 leaves it failed.
            crashed = name == "BACKOFF" or (name == "EXITED" and exitstatus not in self.expected_exits(service))
            active, sub = ("activating", "auto-restart") if crashed else ("failed", "failed")
        pid = int(info.get("pid") or 0)
        return {
            "Id": service,
            "LoadState": "loaded",
            "ActiveState": active,
            "SubState": sub,
            "Result": result,
            "MainPID": str(pid),
            "InvocationID": f"{info.get('start', 0)}-{pid}" if pid else "",
            "ExecMainStatus": str(exitstatus),
            "NRestarts": str(max(0, starts - 1)),
            "ControlGroup": group,
            "NeedDaemonReload": "yes" if program in pending else "no",
            "UnitFileState": "enabled",
            "StatusText": str(info.get("spawnerr") or ""),
        }

    def expected_exits(self, service: str) -> set[int]:
        """The program's ``exitcodes=`` (supervisord's default: 0)."""
        try:
            with open(self.definition_path(service), encoding="utf-8") as handle:
                found = re.findall(r"^exitcodes\s*=\s*([0-9, ]+)$", handle.read(), flags=re.MULTILINE)
        except OSError:
            found = []
        return {int(code) for code in found[-1].split(",") if code.strip()} if found else {0}

    def service_dir(self, service: str) -> str:
        """The service's working directory: the key of its processes (see the module docstring)."""
        return service_directory(self.paths["services"], service)

    def group_of(self, pid: int) -> str:
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            return ""
        services = self.paths["services"] + "/"
        return cwd if cwd.startswith(services) else ""

    # -- the start ledger -------------------------------------------------------------------------

    def _ledger_path(self, service: str) -> str:
        return os.path.join(self.paths["starts"], program_name(service))

    def _ledger(self, service: str) -> list[str]:
        try:
            with open(self._ledger_path(service), encoding="utf-8") as handle:
                return [line for line in handle.read().splitlines() if line.strip()]
        except OSError:
            return []

    # -- actions --------------------------------------------------------------------------------

    def _apply_pending(self, services: list[str]) -> None:
        """Bring in the changed program files of the services that do not run (a running one keeps
        the definition it was started with until it stops, as a systemd unit does)."""
        proxy = self._rpc()
        added, changed, _removed = proxy.supervisor.reloadConfig()[0]
        wanted = {program_name(s) for s in services}
        states = {i["name"]: i["statename"] for i in proxy.supervisor.getAllProcessInfo()}
        for name in sorted(set(changed) & wanted):
            if states.get(name) in ("STOPPED", "EXITED", "FATAL"):
                proxy.supervisor.removeProcessGroup(name)
                proxy.supervisor.addProcessGroup(name)
        for name in sorted(set(added) & wanted):
            proxy.supervisor.addProcessGroup(name)

    def start(self, services: list[str], wait: bool, timeout: float = 60.0) -> Outcome:
        try:
            self._apply_pending(services)
        except (OSError, xmlrpc.client.Fault) as exc:
            return {"cmd": "supervisorctl update", "rc": 1, "stdout": "", "stderr": str(exc)}
        return self._act("start", services, wait, timeout, "ALREADY_STARTED")

    def stop(self, services: list[str], wait: bool, timeout: float = 60.0) -> Outcome:
        return self._act("stop", services, wait, timeout, "NOT_RUNNING")

    def kill_all(self, services: list[str]) -> Outcome:
        """SIGKILL every process in each service's working directory, by PID (start time checked)."""
        groups = [self.service_dir(s) for s in services]
        killed = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            pid = int(entry)
            group = self.group_of(pid)
            if not any(group == g or group.startswith(g + "/") for g in groups):
                continue
            stat = proc_stat(pid)
            if stat is None or stat["state"] == "Z":
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(str(pid))
            except ProcessLookupError:
                continue
        cmd = "kill -KILL (every process of " + " ".join(program_name(s) for s in services) + ")"
        return {"cmd": cmd, "rc": 0, "stdout": " ".join(killed), "stderr": ""}

    def reset_failed(self, services: list[str]) -> Outcome:
        for service in services:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ledger_path(service))
        return {
            "cmd": "clear the start ledger of " + " ".join(program_name(s) for s in services),
            "rc": 0,
            "stdout": "",
            "stderr": "",
        }

    def reload(self) -> Outcome:
        """New program files are added; changed ones take effect at their service's next start."""
        try:
            proxy = self._rpc()
            added, _changed, removed = proxy.supervisor.reloadConfig()[0]
            states = {i["name"]: i["statename"] for i in proxy.supervisor.getAllProcessInfo()}
            for name in added:
                proxy.supervisor.addProcessGroup(name)
            for name in removed:
                if states.get(name) in ("STOPPED", "EXITED", "FATAL"):
                    proxy.supervisor.removeProcessGroup(name)
        except (OSError, xmlrpc.client.Fault) as exc:
            return {"cmd": "supervisorctl reread", "rc": 1, "stdout": "", "stderr": str(exc)}
        return {"cmd": "supervisorctl reread", "rc": 0, "stdout": "", "stderr": ""}

    def is_enabled(self, service: str) -> bool:
        # A program with autostart=true starts with supervisord (the pod's start hook starts it).
        return True

    def enable(self, service: str) -> Outcome:
        return {"cmd": "true", "rc": 0, "stdout": "", "stderr": ""}

    # -- output ---------------------------------------------------------------------------------

    def log_files(self, service: str) -> list[str]:
        """The program's log files, oldest first (supervisord rotates to .1, .2, ...)."""
        base = os.path.join(self.paths["logs"], program_name(service) + ".log")
        rotated = []
        index = 1
        while os.path.exists(f"{base}.{index}"):
            rotated.append(f"{base}.{index}")
            index += 1
        return [*reversed(rotated), base]

    def launch_lines(self, invocation_id: str, service: str) -> list[str]:
        """What the service printed since the launch ``invocation_id`` began (its last launch when
        empty or not found): from the launch line on, across rotated files."""
        pid = invocation_id.rsplit("-", 1)[-1] if invocation_id else ""
        mark = f"{LAUNCH_MARK} pid={pid} " if pid else LAUNCH_MARK
        lines: list[str] = []
        reading = False
        for path in self.log_files(service):
            try:
                with open(path, encoding="utf-8", errors="replace") as handle:
                    for line in handle:
                        if line.startswith(LAUNCH_MARK):
                            # A launch begins: the one asked for (read from here), or another (stop).
                            reading = line.startswith(mark)
                            if reading:
                                lines = []
                        if reading:
                            lines.append(line.rstrip("\n"))
            except OSError:
                continue
        return lines

    def log_tail(self, invocation_id: str, service: str, lines: int, redactor: Redactor) -> list[str]:
        return [redactor.text(line) for line in self.launch_lines(invocation_id, service)[-lines:]]

    def startup_lines(
        self, invocation_id: str, service: str, pattern: str, redactor: Redactor
    ) -> tuple[list[str], str, str | None]:
        wanted = re.compile(pattern)
        found = [redactor.text(line) for line in self.launch_lines(invocation_id, service) if wanted.search(line)]
        return found[-LOG_MAX_LINES:], "supervisord log (this launch)", None

    def env_files(self, service: str) -> list[str]:
        """The environment files the program's start reads: named in its file by a comment line
        ``; environment-file: PATH`` (the start command reads them, supervisord does not)."""
        try:
            with open(self.definition_path(service), encoding="utf-8") as handle:
                text = handle.read()
        except OSError:
            return []
        return re.findall(r"^; environment-file: (\S+)$", text, flags=re.MULTILINE)

    # -- definitions ----------------------------------------------------------------------------

    def definition_path(self, service: str) -> str:
        return os.path.join(self.paths["programs"], program_name(service) + ".conf")

    def is_definition(self, path: str) -> bool:
        return path.startswith(self.paths["programs"] + "/") and path.endswith(".conf")

    def verify(self, name: str, content: str) -> str | None:
        """supervisord's own parser on the program file (inside a minimal configuration)."""
        python = os.path.join(self.paths["venv"], "bin", "python")
        if not os.path.exists(python):
            return None
        code = (
            "import sys, tempfile, os\n"
            "from supervisor.options import ServerOptions\n"
            "d = tempfile.mkdtemp()\n"
            "p = os.path.join(d, 'program.conf'); open(p, 'w').write(sys.stdin.read())\n"
            "m = os.path.join(d, 'supervisord.conf')\n"
            "open(m, 'w').write('[supervisord]\\n[include]\\nfiles = ' + p + '\\n')\n"
            "o = ServerOptions(); o.realize(['-c', m])\n"
            "o.process_config(do_usage=False)\n"
            "if not o.process_group_configs: sys.exit('no program in ' + sys.argv[1])\n"
        )
        rc, out, err = run_cmd([python, "-c", code, name], timeout=60, input_text=content)
        if rc != 0:
            return f"supervisord's parser on {name}: rc={rc}: " + " | ".join((out + err).strip().splitlines()[-3:])
        return None
