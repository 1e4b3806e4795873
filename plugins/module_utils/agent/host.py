# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The host as the operations see it: one object bundling its supervisor (systemd or supervisord:
``host.service``, see ``supervision``), /proc, nvidia-smi, HTTP, the files and records, and the
clock, with the request's tool paths, timeouts and secrets. The
operations act on the host only through it, so unit tests give them a fake host (a subclass that
answers from data) and check their decisions without systemd, GPUs or servers."""

from __future__ import annotations

import functools
import os
import pwd
import threading
import time
from typing import Any, Callable

from . import clients, http_client, nvidia, procfs, supervision, systemd
from .evidence import EvidenceError, Redactor, read_env_file
from .request import need
from .state import StateFiles, file_state, write_atomic
from .waiting import wait_until


class Host:
    def __init__(self, req: dict[str, Any]):
        self.request = req
        self.secrets_file = need(req, "secrets_file")
        self.load_secrets()
        self.managed_units = list(req.get("managed_units", []))
        # Acts through self.systemctl on a systemd host, so a test's fake systemctl sees each call.
        self.service = supervision.for_request(req, self.systemctl)
        self.client_socket_dir = req.get("client_socket_dir", clients.SOCKET_DIR)

    # What only some operations read is required when first read (an apply reads no nvidia-smi).

    @property
    def nvidia_smi(self) -> str:
        return str(need(self.request, "nvidia_smi"))

    @property
    def nvidia_smi_timeout(self) -> float:
        return float(need(self.request, "nvidia_smi_timeout"))

    @property
    def devices_dir(self) -> str:
        return str(need(self.request, "devices_dir"))

    @property
    def http_timeout(self) -> float:
        return float(need(self.request, "http_timeout"))

    @property
    def poll(self) -> float:
        return float(need(self.request, "poll_interval"))

    @functools.cached_property
    def state(self) -> StateFiles:
        return StateFiles(need(self.request, "state_dir"), need(self.request, "desired_dir"))

    def load_secrets(self) -> None:
        """The API key to talk to the servers, and every secret value to redact."""
        secrets = read_env_file(self.secrets_file)
        self.api_key = secrets.get("SGLANG_API_KEY", "")
        self.redactor = Redactor(secrets.values())

    # -- clock --------------------------------------------------------------------------------

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def wait(self, ready: Callable[[], bool], deadline: float) -> tuple[bool, float]:
        """:func:`waiting.wait_until` on this host's clock, polling every ``poll_interval``."""
        return wait_until(ready, deadline, self.poll, self.monotonic, self.sleep)

    # -- the services (instances and clients), through the host's supervisor -------------------

    def units(self, names: list[str]) -> dict[str, dict[str, str]]:
        """Each service's state, in systemd's words (see ``supervision``)."""
        return self.service.show(names)

    def systemctl(self, args: list[str], timeout: float = 60.0) -> dict[str, Any]:
        """systemctl itself: only the systemd supervision calls it."""
        return systemd.systemctl(args, timeout)

    def journal(self, invocation_id: str, unit: str, lines: int) -> list[str]:
        return self.service.log_tail(invocation_id, unit, lines, self.redactor)

    # -- processes ----------------------------------------------------------------------------

    def processes(self) -> dict[int, dict[str, Any]]:
        return procfs.process_table(self.devices_dir, self.service.group_of)

    def listening_ports(self) -> set[int]:
        return set(procfs.listening_sockets().values())

    def cmdline(self, pid: int) -> list[str]:
        return procfs.proc_cmdline(pid)

    def environ(self, pid: int) -> dict[str, str] | None:
        return procfs.proc_environ(pid)

    def cgroup(self, pid: int) -> str:
        """The process's group key: its cgroup on systemd, its service's marker on a pod."""
        return self.service.group_of(pid)

    def user(self, pid: int) -> str | None:
        uid = procfs.proc_uid(pid)
        if uid is None:
            return None
        try:
            return pwd.getpwuid(uid).pw_name
        except KeyError:
            return str(uid)

    def fds_readable(self, pid: int) -> bool:
        return os.access(f"/proc/{pid}/fd", os.R_OK | os.X_OK)

    def kill(self, targets: list[dict[str, Any]], grace: float) -> list[dict[str, Any]]:
        return procfs.kill_with_escalation(targets, grace, self.redactor, self.poll)

    # -- nvidia-smi ---------------------------------------------------------------------------

    def gpus(self) -> dict[int, dict[str, Any]]:
        return nvidia.query_gpus(self.nvidia_smi, self.nvidia_smi_timeout)

    def compute_apps(self, uuid_to_index: dict[str, int]) -> list[dict[str, Any]]:
        return nvidia.query_compute_apps(self.nvidia_smi, self.nvidia_smi_timeout, uuid_to_index)

    # -- HTTP to the instances ----------------------------------------------------------------

    def http(
        self, url: str, timeout: float, api_key: str = "", body: dict[str, Any] | None = None
    ) -> tuple[int | None, str]:
        return http_client.http_request(url, timeout, api_key, body)

    def load(self, url: str, body: dict[str, Any], concurrency: int, stream: bool = True) -> http_client.SteadyLoad:
        """``concurrency`` requests kept open to ``url`` until ``stop()``."""
        return http_client.SteadyLoad(url, body, concurrency, self.http_timeout, self.api_key, stream).start()

    # -- the generation clients' control sockets ------------------------------------------------

    def client_socket(self, unit: str) -> str:
        return clients.socket_path(unit, self.client_socket_dir)

    def client_call(self, unit: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One request on the unit's control socket; raises ``clients.ClientError``."""
        return clients.call(self.client_socket(unit), request, timeout)

    def client_env_files(self, unit: str) -> list[str]:
        """The environment files of a client's service, in the order its start reads them."""
        return self.service.env_files(unit)

    def is_local_host(self, host: str) -> bool:
        return clients.is_local_host(host)

    # -- files --------------------------------------------------------------------------------

    def file_state(self, path: str) -> dict[str, Any]:
        return file_state(path)

    def write_file(self, path: str, content: str, mode: int) -> None:
        write_atomic(path, content, mode)


def parallel(func: Callable[[dict[str, Any]], dict[str, Any]], items: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
