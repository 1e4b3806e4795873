# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""HTTP to an instance's own port: requests, and what its /server_info says about capacity."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any


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
