"""A small HTTP/1.1 client on asyncio streams, with a keep-alive pool per endpoint.

The model servers answer JSON requests with JSON bodies; this covers what they send (Content-Length
or chunked bodies, keep-alive or close) and nothing more: no redirects, no proxies, no cookies, no
HTTP/2. TLS works through the standard ``ssl`` module for ``https://`` endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

_MAX_HEADER_BYTES = 1 << 16
_STREAM_LIMIT = 1 << 20


class HTTPError(Exception):
    """Base for transport failures (no usable HTTP response)."""


class ConnectError(HTTPError):
    """Could not open a connection: refused, unreachable, unresolvable, TLS handshake failed."""


class ConnectionLost(HTTPError):
    """The connection broke before a whole response arrived."""


class ProtocolError(HTTPError):
    """The peer did not speak HTTP/1.x as expected."""


@dataclass(slots=True)
class Response:
    status: int
    reason: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def text(self, limit: int = 300) -> str:
        return self.body[:limit].decode("utf-8", "replace")


class _Conn:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class _Stale(Exception):
    """A reused connection was closed by the server before it answered (keep-alive race)."""


def split_base_url(url: str) -> tuple[str, str, int, str]:
    """``(scheme, host, port, path_prefix)`` of an endpoint URL; credentials in the URL are refused
    so that they can never reach a log line."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"endpoint must be an http:// or https:// URL, got {url!r}")
    if parts.username or parts.password:
        raise ValueError("endpoint URLs must not carry credentials; use the API key environment variable")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, parts.hostname, port, parts.path.rstrip("/")


class HTTPPool:
    """Connections to one ``scheme://host:port``. Safe for many concurrent requests."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float = 10.0,
        idle_timeout: float = 4.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        scheme, self.host, self.port, self.prefix = split_base_url(base_url)
        self._ssl: ssl.SSLContext | None = None
        if scheme == "https":
            self._ssl = ssl_context or ssl.create_default_context()
        default_port = 443 if scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._host_header = host if self.port == default_port else f"{host}:{self.port}"
        self._connect_timeout = connect_timeout
        # Servers (uvicorn: 5 s) drop idle keep-alive connections; dropping ours first avoids most
        # of the races where a request is written into a connection the server is closing.
        self._idle_timeout = idle_timeout
        self._idle: list[_Conn] = []
        self._closed = False
        self._heads: dict[tuple[str, str, tuple[tuple[str, str], ...]], str] = {}

    async def _connect(self) -> _Conn:
        try:
            async with asyncio.timeout(self._connect_timeout):
                reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self._ssl, limit=_STREAM_LIMIT)
        except TimeoutError:
            raise ConnectError(f"connect to {self.host}:{self.port} timed out") from None
        except OSError as e:
            # asyncio words a refusal "Connect call failed"; the errno says what happened.
            reason = os.strerror(e.errno) if e.errno else str(e)
            raise ConnectError(f"connect to {self.host}:{self.port}: {reason}") from None
        return _Conn(reader, writer)

    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < self._idle_timeout and not conn.reader.at_eof():
                return conn
            conn.close()
        return None

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        """One request. Callers bound it with ``asyncio.timeout``; a cancelled request closes its
        connection instead of returning it to the pool."""
        # The request line and fixed headers are the same for every prompt; only the length differs.
        key = (method, path, tuple(headers.items()) if headers else ())
        prefix = self._heads.get(key)
        if prefix is None:
            lines = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self._host_header}"]
            if headers:
                lines.extend(f"{k}: {v}" for k, v in headers.items())
            prefix = self._heads[key] = "\r\n".join(lines) + "\r\n"
        if body is not None:
            data = f"{prefix}Content-Length: {len(body)}\r\n\r\n".encode("latin-1") + body
        else:
            data = f"{prefix}\r\n".encode("latin-1")
        for _unused in range(2):
            conn = self._take_idle()
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            try:
                resp, keep = await self._roundtrip(conn, data, method, reused)
            except _Stale:
                conn.close()
                continue
            except BaseException:
                conn.close()
                raise
            if keep and not self._closed:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            else:
                conn.close()
            return resp
        raise ConnectionLost(f"{self.host}:{self.port} closed the connection before answering")

    async def _roundtrip(self, conn: _Conn, data: bytes, method: str, reused: bool) -> tuple[Response, bool]:
        reader = conn.reader
        try:
            conn.writer.write(data)
            await conn.writer.drain()
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError as e:
                    if reused and not e.partial:
                        raise _Stale from None
                    raise ConnectionLost(f"{self.host}:{self.port} closed the connection mid-response") from None
                status, reason, version, headers = _parse_head(head)
                if 100 <= status < 200:
                    continue  # 100 Continue and friends precede the real answer
                break
        except (ConnectionResetError, BrokenPipeError) as e:
            if reused:
                raise _Stale from None
            raise ConnectionLost(f"{self.host}:{self.port}: {e.strerror or e}") from None
        except asyncio.LimitOverrunError:
            raise ProtocolError("response headers too large") from None
        conn_hdr = headers.get("connection", "").lower()
        keep = ("close" not in conn_hdr) if version == "HTTP/1.1" else ("keep-alive" in conn_hdr)
        try:
            if method == "HEAD" or status in (204, 304):
                body = b""
            elif "chunked" in headers.get("transfer-encoding", "").lower():
                body = await _read_chunked(reader)
            elif "content-length" in headers:
                try:
                    length = int(headers["content-length"])
                except ValueError:
                    raise ProtocolError("bad Content-Length") from None
                body = await reader.readexactly(length)
            else:
                body = await reader.read()
                keep = False
        except asyncio.IncompleteReadError:
            raise ConnectionLost(f"{self.host}:{self.port} closed the connection mid-body") from None
        except (ConnectionResetError, BrokenPipeError) as e:
            raise ConnectionLost(f"{self.host}:{self.port}: {e.strerror or e}") from None
        return Response(status, reason, headers, body), keep

    def drop_idle(self) -> None:
        """Close the idle connections (the server behind them was relaunched)."""
        while self._idle:
            self._idle.pop().close()

    async def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()


def _parse_head(head: bytes) -> tuple[int, str, str, dict[str, str]]:
    if len(head) > _MAX_HEADER_BYTES:
        raise ProtocolError("response headers too large")
    lines = head.decode("latin-1").split("\r\n")
    status_line = lines[0].split(" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith("HTTP/1."):
        raise ProtocolError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
    try:
        status = int(status_line[1])
    except ValueError:
        raise ProtocolError(f"bad status line: {lines[0][:80]!r}") from None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        k, sep, v = line.partition(":")
        if sep:
            key = k.strip().lower()
            v = v.strip()
            headers[key] = f"{headers[key]}, {v}" if key in headers else v
    return status, status_line[2] if len(status_line) > 2 else "", status_line[0], headers


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        line = await reader.readuntil(b"\r\n")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise ProtocolError("bad chunk size") from None
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass  # trailers
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise ProtocolError("chunk not followed by CRLF")
