# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The one interface between the operations and whatever supervises a host's services.

An instance (and a generation client) is a *service*: a unit of systemd on a systemd host, a
program of supervisord on a pod (a container whose PID 1 is not systemd). The operations never
name either: they act through a :class:`Supervision`, chosen per host by the request's
``supervisor`` (the server role's ``sglang_server_supervisor``). A third supervisor is one more
module implementing this class, and one more entry in :data:`KINDS`.

Service names are the units' names (``sglang-gpu0.service``) whatever the supervisor: each
implementation maps them to its own.

The state of a service is told in systemd's words, the operations' one vocabulary
(``systemctl show``'s properties): ``ActiveState`` (active, activating, deactivating, inactive,
failed), ``SubState`` (``auto-restart`` while a crashed service waits to be restarted),
``Result``, ``MainPID``, ``InvocationID`` (which launch this is: new at every start),
``NRestarts``, ``ExecMainStatus``, ``ControlGroup`` (the service's *process group key*, below),
``NeedDaemonReload`` (its definition changed and is not yet in effect), ``LoadState`` and
``UnitFileState``.

Process group key: every process of a service, detached ones included, answers
:meth:`Supervision.group_of` with the service's ``ControlGroup`` or a path below it. On systemd
it is the unit's cgroup; where there are no cgroups per service, a marker in the environment
that the service's launcher sets and every child inherits. The kill proof finds an instance's
processes by it (and by its GPUs and port), never by a name pattern.
"""

from __future__ import annotations

from typing import Any

from .evidence import Redactor

# The result of an action, as the operations report it: what ran (a command line, or the call
# made to the supervisor), its exit status (0: done), and what it printed.
Outcome = dict[str, Any]


class Supervision:
    """What the operations ask of a host's supervisor. Every method acts on the services named,
    in one call where the supervisor allows it."""

    kind = ""
    # Where the definitions of the services live (unit files, program files).
    definitions_dir = ""
    # What :meth:`reload` runs, as reported (in check mode too).
    reload_action = ""
    # Whether a start that waits (``start(wait=True)``) ends only once the server answers /health
    # (a systemd unit's ExecStartPost does); else the caller waits for /health itself.
    start_waits_for_health = False

    def show(self, services: list[str]) -> dict[str, dict[str, str]]:
        """The state of each service, in systemd's words (see the module's docstring)."""
        raise NotImplementedError

    def start(self, services: list[str], wait: bool, timeout: float = 60.0) -> Outcome:
        """Start the services (with their current definitions). ``wait``: return once each start
        has ended (serving, or failed); else once it is under way."""
        raise NotImplementedError

    def stop(self, services: list[str], wait: bool, timeout: float = 60.0) -> Outcome:
        """Stop the services the supervisor's way: SIGTERM to each main process only (SGLang
        drains, then stops its children), SIGKILL to every process of the service at its stop
        timeout."""
        raise NotImplementedError

    def kill_all(self, services: list[str]) -> Outcome:
        """SIGKILL every process of each service now, detached ones included."""
        raise NotImplementedError

    def reset_failed(self, services: list[str]) -> Outcome:
        """Forget the failed state and the start-rate count, so that a start asked for now runs."""
        raise NotImplementedError

    def reload(self) -> Outcome:
        """Make changed definitions known (those of running services take effect at their next start)."""
        raise NotImplementedError

    def is_enabled(self, service: str) -> bool:
        """Whether the service starts when the host (or the supervisor) starts."""
        raise NotImplementedError

    def enable(self, service: str) -> Outcome:
        raise NotImplementedError

    def log_tail(self, invocation_id: str, service: str, lines: int, redactor: Redactor) -> list[str]:
        """The last lines the service printed in the launch ``invocation_id`` (its latest launch
        when empty), secrets masked."""
        raise NotImplementedError

    def startup_lines(
        self, invocation_id: str, service: str, pattern: str, redactor: Redactor
    ) -> tuple[list[str], str, str | None]:
        """The lines of the launch ``invocation_id`` matching ``pattern`` (a regular expression):
        the lines, where they were read (said in the report), and an error (None when read)."""
        raise NotImplementedError

    def env_files(self, service: str) -> list[str]:
        """The environment files the service's start reads, in order."""
        raise NotImplementedError

    def group_of(self, pid: int) -> str:
        """The process group key of a process (see the module's docstring); empty: none."""
        raise NotImplementedError

    def verify(self, name: str, content: str) -> str | None:
        """Check a service definition before it is installed: None when fine, else why not."""
        raise NotImplementedError

    def is_definition(self, path: str) -> bool:
        """Whether installing ``path`` changes a service definition (then :meth:`reload`)."""
        raise NotImplementedError

    def definition_path(self, service: str) -> str:
        raise NotImplementedError


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


def ended(state: dict[str, str]) -> str | None:
    """How a service whose main process ended with status 0 and is not restarted stands (a
    generation client whose job is done: systemd's active (exited) or inactive, supervisord's
    EXITED 0), or None if it runs, restarts or failed."""
    active, sub = state.get("ActiveState", ""), state.get("SubState", "")
    if not (sub == "exited" or stopped(state)):
        return None
    if state.get("Result") != "success" or str(state.get("ExecMainStatus") or "0") != "0":
        return None
    return f"{active} ({sub}), exit status 0"


KINDS = ("systemd", "supervisord")


def for_request(req: dict[str, Any], systemctl: Any) -> Supervision:
    """The supervisor the request names (systemd unless it says otherwise); ``systemctl`` runs
    systemctl (the host's, or a test's fake)."""
    kind = str(req.get("supervisor") or "systemd")
    if kind == "systemd":
        from .systemd import Systemd  # noqa: PLC0415 (each supervisor loads only on its hosts)

        return Systemd(systemctl)
    if kind == "supervisord":
        from .supervisord import Supervisord  # noqa: PLC0415

        return Supervisord(str(req.get("supervisor_root") or ""))
    raise ValueError(f"unknown supervisor {kind!r}: one of {', '.join(KINDS)}")
