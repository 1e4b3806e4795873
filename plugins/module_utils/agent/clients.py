# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The generation clients' control sockets, and which of a client's endpoints are this host's.

A running client of systemd unit U listens on ``/run/sglang-fleet/clients/U/control.sock``: one
request per connection, one JSON line each way, every request carrying ``"v": 1``; an answer
without ``"ok": true`` is a refusal (``{"ok": false, "error": "..."}``). Operations: ``hello``
(its endpoints and their state), ``drain`` (stop sending to some endpoints, wait for their
requests in flight, requeue the rest elsewhere; lapses by itself after a lease) and ``resume``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import time
import urllib.parse
from typing import Any

SOCKET_DIR = "/run/sglang-fleet/clients"
PROTOCOL = 1
# hello answers from memory; a resume re-reads each server's /server_info (up to ~30 s); a drain
# answers once done, so its call may take the drain timeout plus this margin.
HELLO_TIMEOUT = 10.0
RESUME_TIMEOUT = 45.0
DRAIN_CALL_MARGIN = 15.0
MAX_ANSWER_BYTES = 1 << 20
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


class ClientError(Exception):
    """The client did not answer usably: no socket, refused, timed out, not JSON, or refused the
    request (its own error)."""


def socket_path(unit: str, base: str = SOCKET_DIR) -> str:
    return os.path.join(base, unit, "control.sock")


def call(path: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One request on a control socket; the whole exchange within ``timeout`` seconds. Returns
    the answer (``ok`` true) or raises :class:`ClientError` saying why in a few words."""
    payload = json.dumps({"v": PROTOCOL, **request}).encode("utf-8") + b"\n"
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    buf = b""
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except FileNotFoundError:
            raise ClientError("no such socket") from None
        except ConnectionRefusedError:
            raise ClientError("connection refused") from None
        try:
            sock.sendall(payload)
            while b"\n" not in buf:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise socket.timeout()
                sock.settimeout(remaining)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                if len(buf) > MAX_ANSWER_BYTES:
                    raise ClientError(f"answer longer than {MAX_ANSWER_BYTES} bytes")
        except (socket.timeout, TimeoutError):
            raise ClientError(f"no answer within {timeout:g}s") from None
    except (socket.timeout, TimeoutError):  # the connect itself
        raise ClientError(f"no answer within {timeout:g}s") from None
    except OSError as exc:
        raise ClientError(f"{type(exc).__name__}: {exc.strerror or exc}") from None
    finally:
        sock.close()
    line = buf.split(b"\n", 1)[0].strip()
    if not line:
        raise ClientError("closed the connection without an answer")
    try:
        answer = json.loads(line.decode("utf-8", "replace"))
    except ValueError:
        raise ClientError(f"answered something that is not JSON: {line[:200]!r}") from None
    if not isinstance(answer, dict):
        raise ClientError(f"answered something that is not a JSON object: {line[:200]!r}")
    if answer.get("ok") is not True:
        raise ClientError(f"refused: {answer.get('error') or line[:200].decode('utf-8', 'replace')}")
    return answer


# --------------------------------------------------------------------------------------------
# Which endpoints are this host's instances
# --------------------------------------------------------------------------------------------


def endpoint_address(url: str) -> tuple[str, int] | None:
    """(host, port) of an endpoint URL; None if it has neither."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return parts.hostname, port


def bindable(address: str) -> bool:
    """An address of this host (or its network namespace): one a socket can be bound to."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError:
        return False
    return True


def is_local_host(host: str, hostname: str | None = None) -> bool:
    """Does ``host`` (from a URL) name this host: a loopback name or address, this host's name,
    or an address that can be bound here? Names are not looked up (no DNS on this path)."""
    name = host.strip("[]").lower().rstrip(".")
    if not name:
        return False
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    own = (hostname if hostname is not None else socket.gethostname()).lower()
    if name in (own, own.split(".", 1)[0]):
        return True
    try:
        address = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    if address.is_loopback or address.is_unspecified:
        return True
    return bindable(str(address))


def sends_to(
    endpoints: list[dict[str, Any]], instances: list[dict[str, Any]], is_local: Any = is_local_host
) -> dict[str, list[str]]:
    """The instances (by name) a client sends to, with the endpoint URLs that reach each: same
    port, and a host that is this one."""
    out: dict[str, list[str]] = {}
    for endpoint in endpoints:
        url = str(endpoint.get("url") or "")
        address = endpoint_address(url)
        if address is None or not is_local(address[0]):
            continue
        for inst in instances:
            if inst.get("port") == address[1]:
                out.setdefault(inst["name"], []).append(url)
    return out
