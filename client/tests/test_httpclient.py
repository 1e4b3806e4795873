from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fake_openai import Behaviour, FakeServer
from fleetkit import free_port

from sglang_fleet.httpclient import ConnectError, ConnectionLost, HTTPPool, split_base_url


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def chat(text: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}]}).encode()


async def _with_server(b: Behaviour, fn: Any) -> Any:
    srv = FakeServer(b)
    port = await srv.start()
    pool = HTTPPool(f"http://127.0.0.1:{port}")
    try:
        return await fn(srv, pool)
    finally:
        await pool.close()
        await srv.stop()


@pytest.mark.parametrize("chunked", [False, True])
def test_keep_alive_and_bodies(chunked: bool) -> None:
    async def body(srv: FakeServer, pool: HTTPPool) -> None:
        for i in range(5):
            r = await pool.request("POST", "/v1/chat/completions", body=chat(f"t{i}"))
            assert r.status == 200
            assert r.json()["choices"][0]["message"]["content"].startswith("A:")
        assert len(srv.connections) == 1  # one connection, reused

    run(_with_server(Behaviour(chunked=chunked), body))


def test_connection_close_answers_are_read_and_not_reused() -> None:
    async def body(srv: FakeServer, pool: HTTPPool) -> None:
        for i in range(3):
            r = await pool.request("POST", "/v1/chat/completions", body=chat(f"t{i}"))
            assert r.status == 200
        assert pool._idle == []

    run(_with_server(Behaviour(close_after_response=True), body))


def test_server_closing_an_idle_connection_is_retried_on_a_new_one() -> None:
    async def body(srv: FakeServer, pool: HTTPPool) -> None:
        assert (await pool.request("GET", "/health")).status == 200
        r = await pool.request("POST", "/v1/chat/completions", body=chat("again"))
        assert r.status == 200
        assert srv.requests == 1  # the dropped request never reached the handler; the retry did

    run(_with_server(Behaviour(drop_reused=True), body))


def test_connection_dropped_mid_request_on_a_fresh_connection() -> None:
    async def body(srv: FakeServer, pool: HTTPPool) -> None:
        with pytest.raises(ConnectionLost):
            await pool.request("POST", "/v1/chat/completions", body=chat("boom"))

    run(_with_server(Behaviour(drop={"boom"}), body))


def test_refused_connection() -> None:
    async def body() -> None:
        pool = HTTPPool(f"http://127.0.0.1:{free_port()}")
        with pytest.raises(ConnectError, match="refused"):
            await pool.request("GET", "/health")

    run(body())


def test_timeout_is_the_callers_and_closes_the_connection() -> None:
    async def body(srv: FakeServer, pool: HTTPPool) -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await pool.request("POST", "/v1/chat/completions", body=chat("slow"))
        assert pool._idle == []

    run(_with_server(Behaviour(delay=1.0), body))


def test_urls() -> None:
    assert split_base_url("http://h:30000") == ("http", "h", 30000, "")
    assert split_base_url("https://h/base/") == ("https", "h", 443, "/base")
    assert split_base_url("http://[::1]:8") == ("http", "::1", 8, "")
    with pytest.raises(ValueError, match="credentials"):
        split_base_url("http://user:secret@h:1")
    with pytest.raises(ValueError):
        split_base_url("ftp://h")
