# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""HTTP to an instance's own port: requests, and what its /server_info says about capacity."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import urllib.parse
from typing import Any


def http_request(
    url: str, timeout: float, api_key: str = "", body: dict[str, Any] | None = None
) -> tuple[int | None, str]:
    """(status, body); status None when the connection failed (body says why).

    ``http.client`` directly: the agent runs outside Ansible (from its bundle, in LXC containers
    and in the start guard) and speaks plain HTTP to an instance on its own host, never through
    a proxy, so neither urllib's handlers nor ansible-core's ``open_url`` add anything."""
    if not url.startswith("http://"):
        raise ValueError(f"refusing to fetch {url!r}: only http:// to the instance's own port")
    parts = urllib.parse.urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout)
    try:
        conn.request("POST" if body is not None else "GET", path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


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


def numbered(body: dict[str, Any], count: int) -> dict[str, Any]:
    """The request ``count`` of a load: its prompt made its own (the server's prefix cache would
    otherwise serve it from the first one's)."""
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids:
        return {**body, "input_ids": [100 + count % 50000, *ids[1:]]}
    if isinstance(body.get("text"), str):
        return {**body, "text": f"{count}: {body['text']}"}
    return body


class SteadyLoad:
    """``concurrency`` ``POST`` requests kept open to one URL: when one ends, its thread sends the
    next at once, so the server runs that many (the advisor's stepped measurement). Streaming by
    default: ``stop()`` closes every connection, and SGLang aborts a streaming request whose
    client went away (``tokenizer_manager`` checks for the disconnect), so nothing of the load
    outlives it."""

    def __init__(
        self, url: str, body: dict[str, Any], concurrency: int, timeout: float, api_key: str = "", stream: bool = True
    ):
        parts = urllib.parse.urlsplit(url)
        self.host, self.port, self.path = parts.hostname or "127.0.0.1", parts.port or 80, parts.path or "/"
        self.body = {**body, "stream": stream}
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.conns: set[http.client.HTTPConnection] = set()
        self.errors: list[str] = []
        self.sent = 0
        self.threads = [threading.Thread(target=self._worker, daemon=True) for _index in range(max(0, concurrency))]

    def start(self) -> SteadyLoad:
        for thread in self.threads:
            thread.start()
        return self

    def _worker(self) -> None:
        while not self.stopping.is_set():
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            with self.lock:
                self.conns.add(conn)
                self.sent += 1
                data = json.dumps(numbered(self.body, self.sent)).encode()
            try:
                conn.request("POST", self.path, body=data, headers=self.headers)
                resp = conn.getresponse()
                if resp.status != 200:
                    raise http.client.HTTPException(f"{self.path} answered {resp.status}")
                while resp.read(4096) and not self.stopping.is_set():
                    pass
            except (OSError, http.client.HTTPException, ValueError) as exc:
                if not self.stopping.is_set():
                    with self.lock:
                        if len(self.errors) < 3:
                            self.errors.append(f"{type(exc).__name__}: {exc}")
                    self.stopping.wait(0.5)
            finally:
                with self.lock:
                    self.conns.discard(conn)
                conn.close()

    def stop(self, join_timeout: float = 10.0) -> None:
        self.stopping.set()
        with self.lock:
            conns = list(self.conns)
        for conn in conns:
            if conn.sock is not None:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
        for thread in self.threads:
            if thread.is_alive():
                thread.join(join_timeout)
