from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fake_openai import Behaviour, FakeServer
from fleetkit import ThreadedFakeServer, cli, free_port, generate_args, read_status, write_prompts

from sglang_fleet.backoff import Backoff
from sglang_fleet.endpoints import AdjustableLimiter, Endpoint, capacity_from_server_info


def test_limiter_follows_limit_changes() -> None:
    async def body() -> None:
        lim = AdjustableLimiter(2)
        await lim.acquire()
        await lim.acquire()
        waiter = asyncio.create_task(lim.acquire())
        await asyncio.sleep(0)
        assert not waiter.done()
        lim.set_limit(3)  # raising it lets a waiter in at once
        await asyncio.sleep(0)
        assert waiter.done() and lim.used == 3
        lim.set_limit(1)  # lowering it lets the excess drain: nobody new gets in until used < 1
        lim.release()
        lim.release()
        w2 = asyncio.create_task(lim.acquire())
        await asyncio.sleep(0)
        assert not w2.done()
        lim.release()
        await asyncio.sleep(0)
        assert w2.done() and lim.used == 1

    asyncio.run(body())


def test_limiter_cancelled_waiter_does_not_leak_a_slot() -> None:
    async def body() -> None:
        lim = AdjustableLimiter(1)
        await lim.acquire()
        w = asyncio.create_task(lim.acquire())
        await asyncio.sleep(0)
        w.cancel()
        lim.release()
        with pytest.raises(asyncio.CancelledError):
            await w
        assert lim.used == 0
        await asyncio.wait_for(lim.acquire(), 1)

    asyncio.run(body())


@pytest.mark.parametrize(
    ("info", "cap"),
    [
        ({"internal_states": [{"effective_max_running_requests_per_dp": 48}]}, 48),
        ({"dp_size": 2, "internal_states": [{"effective_max_running_requests_per_dp": 48}]}, 96),
        ({"internal_states": [{"max_running_requests": 10}]}, 10),
        ({"max_running_requests": 7}, 7),
        ({"internal_states": [{}]}, None),
        ({"internal_states": [{"effective_max_running_requests_per_dp": 0}]}, None),
        ([], None),
    ],
)
def test_capacity_from_server_info(info: object, cap: int | None) -> None:
    assert capacity_from_server_info(info) == cap


def _endpoint(url: str, override: int | str = "auto") -> Endpoint:
    return Endpoint(
        url,
        headers={},
        override=override,
        factor=1.5,
        default_concurrency=5,
        connect_timeout=2,
        backoff=Backoff(0.05, 0.2),
    )


def test_auto_concurrency_override_and_recovery() -> None:
    async def body() -> None:
        srv = FakeServer(Behaviour(capacity=10))
        port = await srv.start()
        ep = _endpoint(f"http://127.0.0.1:{port}")
        assert ep.limiter.limit == 5  # default until the server says
        assert await ep.probe() == (True, "ok")
        await ep.refresh_capacity()
        assert ep.limiter.limit == 15  # 10 x factor 1.5
        assert ep.follows_server is True
        ep.set_override(3)
        assert ep.limiter.limit == 3 and ep.follows_server is False
        ep.set_override("auto")
        assert ep.limiter.limit == 15 and ep.follows_server is True
        ep.mark_up()
        # The server goes away and comes back with another capacity: the endpoint notices both.
        await srv.stop()
        ep.mark_down("connection refused")
        assert not ep.is_up
        await asyncio.sleep(0.1)
        srv2 = FakeServer(Behaviour(capacity=4))
        await srv2.start(port)
        await asyncio.wait_for(ep.wait_up(), 10)
        assert ep.limiter.limit == 6 and ep.relaunches_seen == 1
        await ep.close()
        await srv2.stop()

    asyncio.run(body())


def test_probe_reports_starting_and_missing_servers() -> None:
    async def body() -> None:
        srv = FakeServer(Behaviour(startup_delay=60))
        port = await srv.start()
        ok, reason = await _endpoint(f"http://127.0.0.1:{port}").probe()
        assert not ok and "503" in reason
        await srv.stop()
        ok, reason = await _endpoint(f"http://127.0.0.1:{free_port()}").probe()
        assert not ok and "refused" in reason

    asyncio.run(body())


def test_default_factor_keeps_a_few_requests_waiting_at_each_server(tmp_path: Path) -> None:
    """With the defaults, auto concurrency is the capacity x 1.25, rounded up: 16 -> 20 in flight, so
    a slot a finished request frees is refilled at the server's next step (the server keeps a short
    queue); with --concurrency-factor 1.0 it is the capacity itself."""
    with ThreadedFakeServer(Behaviour(capacity=16, delay=0.05)) as srv:
        assert srv.server is not None
        prompts = write_prompts(tmp_path / "p.jsonl", 400)
        r = cli("generate", "--prompts", str(prompts), "--output", str(tmp_path / "out"), "--endpoint", srv.url)
        assert r.returncode == 0, r.stderr
        assert srv.server.max_running == 20
        assert read_status(tmp_path / "out")["endpoints"][srv.url]["concurrency"] == 20
    with ThreadedFakeServer(Behaviour(capacity=16, delay=0.05)) as srv:
        assert srv.server is not None
        r = cli(*generate_args(prompts, tmp_path / "out1", srv.url))
        assert r.returncode == 0, r.stderr
        assert srv.server.max_running == 16


def test_a_stalled_endpoint_is_probed_until_a_generation_completes_or_it_goes_away() -> None:
    async def body() -> None:
        srv = FakeServer(Behaviour(capacity=4))
        port = await srv.start()
        ep = _endpoint(f"http://127.0.0.1:{port}")
        events: list[str] = []
        ep.on_event = lambda _ep, event: events.append(event)
        ep.mark_up()
        answers = [(False, "a one-token generation did not finish within 1.0s"), (True, "ok")]

        async def probe() -> tuple[bool | None, str]:
            return answers.pop(0)

        assert ep.stall("no completion for 9.0s", probe) is True
        assert (ep.state, ep.usable, ep.stalls) == ("stalled", False, 1)
        assert ep.stall("again", probe) is False  # only an endpoint in use stalls
        await asyncio.wait_for(ep.wait_up(), 10)  # the second probe completed: taken back
        assert ep.state == "up" and answers == [] and events == ["up", "stalled", "capacity", "up"]
        assert ep.snapshot()["intervals"][-1]["why"] == "stalled"

        # A probe refused (the server relaunched): an endpoint down, probed for health as usual.
        async def refused() -> tuple[bool | None, str]:
            return None, "connection refused"

        events.clear()
        ep.stall("no completion for 9.0s", refused)
        await asyncio.wait_for(ep.wait_up(), 10)  # the fake server answers /health
        assert events[:2] == ["stalled", "down"] and events[-1] == "up"
        assert ep.snapshot()["intervals"][-1]["why"] == "down"
        await ep.close()
        await srv.stop()

    asyncio.run(body())
