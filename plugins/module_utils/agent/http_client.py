# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""HTTP to an instance's own port: requests, and what its /server_info says about capacity."""

from __future__ import annotations

import http.client
import json
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
