"""A small OpenAI-compatible server for tests and the benchmark (stdlib only, loopback only).

It covers behaviours that the simulator does not offer on demand: per-id HTTP errors, malformed
answers, chunked bodies, connection drops, a zero-latency mode for the benchmark, and a record of
the largest number of requests it was ever asked to run at once. Runs in-process
(``FakeServer.start`` inside an event loop) or as a process (``python fake_openai.py --port P``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import signal
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Behaviour:
    capacity: int = 8
    delay: float = 0.0
    startup_delay: float = 0.0
    api_key: str | None = None
    reasoning: bool = True
    fail_status: dict[str, int] = field(default_factory=dict)  # prompt text -> HTTP status
    fail_all: int | None = None  # every generation request gets this HTTP status
    flaky: dict[str, int] = field(default_factory=dict)  # prompt text -> failures (500) before success
    garbage: set[str] = field(default_factory=set)  # prompt texts answered with invalid JSON
    drop: set[str] = field(default_factory=set)  # prompt texts whose connection is closed unanswered
    chunked: bool = False
    # Close a connection, unanswered, when a second request arrives on it: what a client sees when
    # a server's keep-alive timeout expires just as it reuses the connection.
    drop_reused: bool = False
    close_after_response: bool = False
    zero: bool = False  # fixed answer, no parsing beyond headers: the benchmark's floor endpoint
    output_bytes: int = 0  # pad outputs to this size
    server_info: bool = True


def prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "\n".join(str(m.get("content")) for m in body["messages"])
    return str(body.get("prompt"))


def answer_for(text: str, seed: Any) -> str:
    return "A:" + hashlib.sha256(f"{text}|{seed}".encode()).hexdigest()[:16]


_ZERO_BODY = json.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "model": "fake",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()
_ZERO_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(_ZERO_BODY)).encode()
    + b"\r\n\r\n"
    + _ZERO_BODY
)


class FakeServer:
    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.b = behaviour or Behaviour()
        self.started_at = time.monotonic()
        self.requests = 0
        self.running = 0
        self.max_running = 0
        self.seen: list[str] = []
        self.auth_seen: set[str] = set()
        self._flaky_left = dict(self.b.flaky)
        self._server: asyncio.Server | None = None
        self.connections: set[_Proto] = set()
        self.port = 0

    async def start(self, port: int = 0) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Proto(self), "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for c in list(self.connections):
                if c.task is not None:
                    c.task.cancel()
                if c.transport is not None:
                    c.transport.close()
            await self._server.wait_closed()

    @property
    def ready(self) -> bool:
        return time.monotonic() - self.started_at >= self.b.startup_delay

    async def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes, bool]:
        """(status, body, drop_connection)"""
        # As SGLang's add_api_key_middleware: every path but /health* and /metrics* needs the key.
        if (
            self.b.api_key is not None
            and not path.startswith(("/health", "/metrics"))
            and headers.get("authorization") != f"Bearer {self.b.api_key}"
        ):
            return 401, b'{"error":"Unauthorized"}', False
        if path == "/health":
            return (200, b"{}", False) if self.ready else (503, b'{"message":"starting"}', False)
        if path in ("/server_info", "/get_server_info"):
            if not self.b.server_info:
                return 404, b"{}", False
            info = {"dp_size": 1, "internal_states": [{"effective_max_running_requests_per_dp": self.b.capacity}]}
            return 200, json.dumps(info).encode(), False
        if path == "/stats":
            return 200, json.dumps({"requests": self.requests, "max_running": self.max_running}).encode(), False
        if path not in ("/v1/chat/completions", "/v1/completions"):
            return 404, b'{"detail":"Not Found"}', False
        if not self.ready:
            return 503, b'{"message":"server is starting"}', False
        req = json.loads(body)
        text = prompt_text(req)
        self.requests += 1
        self.seen.append(text)
        if text in self.b.drop:
            return 0, b"", True
        if self.b.fail_all is not None:
            return self.b.fail_all, b'{"object":"error","message":"bad request setting"}', False
        if text in self.b.fail_status:
            return self.b.fail_status[text], json.dumps({"error": {"message": f"refused {text}"}}).encode(), False
        if self._flaky_left.get(text, 0) > 0:
            self._flaky_left[text] -= 1
            return 500, b'{"message":"internal error"}', False
        if text in self.b.garbage:
            return 200, b"{not json", False
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            if self.b.delay:
                await asyncio.sleep(self.b.delay)
        finally:
            self.running -= 1
        out = answer_for(text, req.get("seed"))
        if self.b.output_bytes:
            out = (out + " ") * (self.b.output_bytes // (len(out) + 1) + 1)
        msg: dict[str, Any] = {"role": "assistant", "content": out}
        if self.b.reasoning and req.get("separate_reasoning", True):
            msg["reasoning_content"] = "thinking about " + text[:40]
        if path == "/v1/completions":
            choice: dict[str, Any] = {"index": 0, "text": out, "finish_reason": "stop"}
        else:
            choice = {"index": 0, "message": msg, "finish_reason": "stop"}
        resp = {
            "id": f"cmpl-{self.requests}",
            "model": req.get("model"),
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(text.split()),
                "completion_tokens": 7,
                "total_tokens": 7 + len(text.split()),
            },
        }
        return 200, json.dumps(resp).encode(), False


class _Proto(asyncio.Protocol):
    def __init__(self, server: FakeServer) -> None:
        self.s = server
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.task: asyncio.Future[None] | None = None
        self.served = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.s.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next()

    def _next(self) -> None:
        if self.busy or self.transport is None:
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].decode("latin-1").split("\r\n")
        headers = {}
        for line in head[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        length = int(headers.get("content-length", "0"))
        if len(self.buf) < end + 4 + length:
            return
        body = self.buf[end + 4 : end + 4 + length]
        self.buf = self.buf[end + 4 + length :]
        method, path = head[0].split(" ")[:2]
        self.served += 1
        if self.s.b.drop_reused and self.served == 2:
            self.transport.close()
            return
        if self.s.b.zero and method == "POST":
            self.s.requests += 1
            self.transport.write(_ZERO_RESPONSE)
            self._next()
            return
        self.busy = True
        self.task = asyncio.ensure_future(self._respond(method, path, headers, body))

    async def _respond(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        status, payload, drop = await self.s.handle(method, path, headers, body)
        t = self.transport
        if t is None or t.is_closing():
            return
        if drop:
            t.close()
            return
        reason = {
            200: "OK",
            400: "Bad Request",
            401: "Unauthorized",
            404: "Not Found",
            500: "Internal Server Error",
            503: "Service Unavailable",
        }.get(status, "Status")
        hdrs = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json"]
        close = self.s.b.close_after_response
        if close:
            hdrs.append("Connection: close")
        if self.s.b.chunked:
            hdrs.append("Transfer-Encoding: chunked")
            mid = len(payload) // 2
            chunks = b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in (payload[:mid], payload[mid:]) if c)
            t.write(("\r\n".join(hdrs) + "\r\n\r\n").encode() + chunks + b"0\r\n\r\n")
        else:
            hdrs.append(f"Content-Length: {len(payload)}")
            t.write(("\r\n".join(hdrs) + "\r\n\r\n").encode() + payload)
        if close:
            t.close()
            return
        self.busy = False
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.s.connections.discard(self)


async def _serve(args: argparse.Namespace) -> None:
    b = Behaviour(
        capacity=args.capacity,
        delay=args.delay,
        startup_delay=args.startup_delay,
        api_key=args.api_key,
        zero=args.zero,
        output_bytes=args.output_bytes,
    )
    srv = FakeServer(b)
    port = await srv.start(args.port)
    print(f"listening {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await srv.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--capacity", type=int, default=8)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--startup-delay", type=float, default=0.0)
    p.add_argument("--api-key")
    p.add_argument("--zero", action="store_true")
    p.add_argument("--output-bytes", type=int, default=0)
    asyncio.run(_serve(p.parse_args()))


if __name__ == "__main__":
    main()
