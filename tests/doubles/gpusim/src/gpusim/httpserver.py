"""A small asyncio HTTP/1.1 server (keep-alive, chunked request bodies, SSE responses).

It answers the way uvicorn does where clients can tell: lower-case ``server: uvicorn``
and ``date`` headers, a 5 s keep-alive timeout and one access-log line per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from gpusim.logutil import UvicornLogger

KEEP_ALIVE_S = 5.0
MAX_HEADER_BYTES = 64 * 1024


@dataclass
class Request:
    method: str
    target: str
    path: str
    query: dict[str, list[str]]
    version: str
    headers: dict[str, str]
    body: bytes
    client: str

    def json(self) -> Any:
        return json.loads(self.body.decode("utf-8") or "null")


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str | None = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)
    stream: AsyncIterator[bytes] | None = None

    @classmethod
    def json(cls, obj: Any, status: int = 200) -> Response:
        return cls(status, json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode())

    @classmethod
    def empty(cls, status: int) -> Response:
        return cls(status, b"", None)

    @classmethod
    def text(cls, text: str, status: int = 200, content_type: str = "text/plain; charset=utf-8") -> Response:
        return cls(status, text.encode(), content_type)


Handler = Callable[[Request], Awaitable[Response]]


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


class HTTPServer:
    def __init__(self, handler: Handler, access_log: UvicornLogger | None):
        self.handler = handler
        self.access_log = access_log
        self.server: asyncio.base_events.Server | None = None
        self.connections: set[asyncio.StreamWriter] = set()

    async def bind(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(
            self._serve, host=host, port=port, backlog=2048, reuse_address=True, limit=MAX_HEADER_BYTES
        )

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for w in list(self.connections):
            with contextlib.suppress(Exception):
                w.close()

    async def _read_request(self, reader: asyncio.StreamReader, client: str) -> Request | None:
        try:
            line = await asyncio.wait_for(reader.readline(), KEEP_ALIVE_S)
        except (TimeoutError, asyncio.LimitOverrunError, ValueError, ConnectionError):
            return None
        if not line:
            return None
        try:
            method, target, version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
        except ValueError:
            return None
        headers: dict[str, str] = {}
        while True:
            h = await reader.readline()
            if not h or h in (b"\r\n", b"\n"):
                break
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        body = b""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size_line = await reader.readline()
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(await reader.readexactly(size))
                await reader.readline()
            body = b"".join(chunks)
        elif "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        parts = urlsplit(target)
        return Request(
            method=method.upper(),
            target=target,
            path=parts.path or "/",
            query=parse_qs(parts.query),
            version=version.replace("HTTP/", ""),
            headers=headers,
            body=body,
            client=client,
        )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "unknown"
        self.connections.add(writer)
        try:
            while True:
                req = await self._read_request(reader, client)
                if req is None:
                    break
                try:
                    resp = await self.handler(req)
                except Exception:
                    resp = Response.text("Internal Server Error", 500)
                keep = req.version == "1.1" and req.headers.get("connection", "").lower() != "close"
                if req.version == "1.0" and req.headers.get("connection", "").lower() == "keep-alive":
                    keep = True
                if self.access_log:
                    self.access_log.access(
                        client, req.method, req.target, req.version, resp.status, _phrase(resp.status)
                    )
                ok = await self._write(writer, req, resp, keep)
                if not ok or not keep:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.connections.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def _write(self, writer: asyncio.StreamWriter, req: Request, resp: Response, keep: bool) -> bool:
        head = [f"HTTP/1.1 {resp.status} {_phrase(resp.status)}", f"date: {formatdate(usegmt=True)}", "server: uvicorn"]
        if resp.stream is None:
            head.append(f"content-length: {len(resp.body)}")
        else:
            head.append("transfer-encoding: chunked")
        if resp.content_type:
            head.append(f"content-type: {resp.content_type}")
        for k, v in resp.headers:
            head.append(f"{k}: {v}")
        if not keep:
            head.append("connection: close")
        try:
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
            if resp.stream is None:
                if req.method != "HEAD":
                    writer.write(resp.body)
                await writer.drain()
                return True
            async for chunk in resp.stream:
                if chunk:
                    writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        except (ConnectionError, RuntimeError):
            if resp.stream is not None:
                with contextlib.suppress(Exception):
                    await resp.stream.aclose()  # type: ignore[attr-defined]
            return False
