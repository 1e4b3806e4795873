"""The control socket (a retune drains and resumes endpoints of a running client) and the
per-endpoint capacity ledger: the client as a real process against fake servers, and the endpoint
alone where timing must be controlled."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from fake_openai import Behaviour, FakeServer
from fleetkit import (
    FAST_FAKE,
    ThreadedFakeServer,
    gen,
    generate_args,
    read_records,
    read_status,
    start_cli,
    stop_process,
    verify,
    wait_for,
    write_prompts,
)

from sglang_fleet.backoff import Backoff
from sglang_fleet.control_socket import unit_name
from sglang_fleet.endpoints import Endpoint


def ask(path: Path, request: Any, *, raw: bytes | None = None, timeout: float = 30) -> dict[str, Any]:
    """One request over the control socket, as the retune sends it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(raw if raw is not None else json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    assert data.count(b"\n") == 1, data
    reply: dict[str, Any] = json.loads(data)
    return reply


def start(tmp: Path, prompts: Path, *urls: str, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], Path]:
    sock = tmp / "run" / "clients" / "ctl.sock"
    proc = start_cli(
        *generate_args(prompts, tmp / "out", *urls),
        *FAST_FAKE,
        "--control-socket",
        str(sock),
        "--endpoint-log",
        str(tmp / "out" / "endpoints.jsonl"),
        *extra,
        log=tmp / "log",
    )
    wait_for(lambda: sock.exists() or proc.poll() is not None, what="control socket")
    assert proc.poll() is None, (tmp / "log").read_text()
    return proc, sock


def endpoint(reply: dict[str, Any], url: str) -> dict[str, Any]:
    return next(e for e in reply["endpoints"] if e["url"] == url)


def exactly_once(prompts: Path, out: Path, n: int) -> list[dict[str, Any]]:
    recs = read_records(out)
    assert len(recs) == n and len({r["id"] for r in recs}) == n
    verify(prompts, out)
    return recs


def drain(sock: Path, *urls: str, timeout: float = 10, lease: float = 60, by: str = "test") -> dict[str, Any]:
    return ask(sock, {"v": 1, "op": "drain", "endpoints": list(urls), "timeout": timeout, "lease": lease, "by": by})


# ---------------------------------------------------------------------- the client as a process
def test_hello_bad_requests_permissions_and_removal_at_exit(tmp_path: Path) -> None:
    with ThreadedFakeServer(Behaviour(capacity=3, delay=0.05)) as srv:
        p = write_prompts(tmp_path / "p.jsonl", 2000)
        proc, sock = start(tmp_path, p, srv.url + "/v1/", extra=("--shard", "0/1"))
        try:
            assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600 and stat.S_ISSOCK(os.stat(sock).st_mode)
            assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o750
            wait_for(lambda: ask(sock, {"v": 1, "op": "hello"})["state"] == "running", what="running")
            h = ask(sock, {"v": 1, "op": "hello"})
            assert h["ok"] is True and h["v"] == 1 and h["pid"] == proc.pid and h["shard"] == "0/1"
            assert "unit" in h
            (ep,) = h["endpoints"]
            assert ep["url"] == srv.url and ep["state"] == "up" and ep["drained"] is False
            assert ep["capacity"] == 3 and ep["server_capacity"] == 3 and isinstance(ep["in_flight"], int)
            # Auto concurrency (the server's capacity x 1.0, generate_args): it follows a relaunch.
            assert ep["follows_server"] is True and ep["factor"] == 1.0
            bad = [
                (None, b"{not json\n", "not valid JSON"),
                ([1], None, "one JSON object"),
                ({"op": "hello"}, None, "protocol version"),
                ({"v": 2, "op": "hello"}, None, "protocol version"),
                ({"v": True, "op": "hello"}, None, "protocol version"),
                ({"v": 1, "op": "reboot"}, None, "unknown op 'reboot'"),
                ({"v": 1, "op": "drain", "endpoints": srv.url, "timeout": 1, "lease": 5}, None, "list of URLs"),
                ({"v": 1, "op": "drain", "endpoints": [srv.url], "lease": 5}, None, "timeout"),
                ({"v": 1, "op": "drain", "endpoints": [srv.url], "timeout": 1}, None, "lease"),
                ({"v": 1, "op": "drain", "endpoints": [srv.url], "timeout": 9, "lease": 5}, None, "longer than"),
                ({"v": 1, "op": "resume", "endpoints": [srv.url], "by": 7}, None, "by must be"),
                ({"v": 1, "op": "resume", "endpoints": [srv.url], "api_key": 7}, None, "api_key must be"),
                ({"v": 1, "op": "resume", "endpoints": [srv.url], "confirm": -1}, None, "confirm must be"),
            ]
            for req, raw, words in bad:
                reply = ask(sock, req, raw=raw)
                assert reply["ok"] is False and words in reply["error"], (req, reply)
            # None of that drained anything.
            assert endpoint(ask(sock, {"v": 1, "op": "hello"}), srv.url)["drained"] is False
        finally:
            assert stop_process(proc) == 0
        assert not sock.exists()
        assert "control socket" in (tmp_path / "log").read_text()


def test_stale_socket_is_replaced_and_a_live_one_refused(tmp_path: Path, fake: ThreadedFakeServer) -> None:
    p = write_prompts(tmp_path / "p.jsonl", 20)
    sock = tmp_path / "ctl.sock"
    # A live socket: another process (here, the test) listens on the path. The client refuses it.
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(sock))
    live.listen()
    try:
        r = gen(p, tmp_path / "out", fake.url, extra=("--control-socket", str(sock)))
        assert r.returncode == 2, r.stderr
        assert f"control socket {sock}: another process is listening on it" in r.stderr
        assert sock.exists()  # left alone
    finally:
        live.close()
    # Now stale (nobody listens, the file stays, as after a SIGKILL): replaced; the job runs.
    assert sock.exists()
    r = gen(p, tmp_path / "out", fake.url, extra=("--control-socket", str(sock)))
    assert r.returncode == 0, r.stderr
    assert not sock.exists()
    assert len(read_records(tmp_path / "out")) == 20
    # Something that is not a socket is never replaced.
    sock.write_text("keep me")
    r = gen(p, tmp_path / "out2", fake.url, extra=("--control-socket", str(sock)))
    assert r.returncode == 2 and "not a socket" in r.stderr
    assert sock.read_text() == "keep me"


def test_drain_waits_for_requests_in_flight_then_resume_reads_the_new_capacity(tmp_path: Path) -> None:
    """A wave: endpoint A is drained (its requests in flight finish), its server is relaunched with
    another capacity, and A is resumed; B generates throughout. Every prompt exactly once."""
    with (
        ThreadedFakeServer(Behaviour(capacity=4, delay=0.3)) as a,
        ThreadedFakeServer(Behaviour(capacity=4, delay=0.05)) as b,
    ):
        assert a.server is not None and b.server is not None
        p = write_prompts(tmp_path / "p.jsonl", 300)
        out = tmp_path / "out"
        proc, sock = start(tmp_path, p, a.url, b.url)
        try:
            wait_for(lambda: a.server.running == 4, what="requests in flight at A")  # type: ignore[union-attr]
            reply = drain(sock, a.url, "http://127.0.0.1:1", timeout=10, lease=60, by="retune wave 1")
            assert reply["ok"] is True and reply["drained"] == [a.url] and reply["abandoned"] == 0
            assert reply["unknown"] == ["http://127.0.0.1:1"]
            assert 0.0 < reply["waited_s"] < 5
            # The requests in flight at A were answered (not abandoned); nothing new reaches A.
            assert a.server.running == 0
            h = ask(sock, {"v": 1, "op": "hello"})
            assert endpoint(h, a.url)["drained"] is True and endpoint(h, a.url)["in_flight"] == 0
            assert endpoint(h, b.url)["drained"] is False
            seen_a, seen_b = a.server.requests, b.server.requests
            # The retune relaunches A's server (same port, another capacity) while B keeps going.
            port = a.server.port
            a.stop()
            wait_for(lambda: b.server.requests > seen_b + 30, what="B generating")  # type: ignore[union-attr]
            # The status file is rewritten about once a second.
            wait_for(lambda: read_status(out)["endpoints"][a.url]["drained"], what="status: A drained")
            st = read_status(out)["endpoints"]
            assert st[a.url]["state"] == "up"  # its server is gone, but a drained endpoint is not probed
            assert st[a.url]["outages"] == 0 and st[a.url]["drains"] == 1
            with ThreadedFakeServer(Behaviour(capacity=6, delay=0.02), port=port) as a2:
                assert a2.server is not None
                reply = ask(sock, {"v": 1, "op": "resume", "endpoints": [a.url + "/"], "by": "retune wave 1"})
                service = reply.pop("service")
                assert reply == {"ok": True, "resumed": [a.url], "capacity": {a.url: 6}, "unknown": []}
                # Not asked to confirm: its word at once (no completion yet, nothing failed).
                assert service[a.url]["in_service"] is True and service[a.url]["state"] == "up"
                wait_for(lambda: a2.server.requests > 10, what="A used again")  # type: ignore[union-attr]
                assert proc.wait(60) == 0
            assert a.server.requests == seen_a
        finally:
            stop_process(proc)
        exactly_once(p, out, 300)
        st = read_status(out)["endpoints"]
        ea, eb = st[a.url], st[b.url]
        assert ea["drains"] == 1 and ea["drained"] is False and ea["capacity"] == 6
        assert ea["drained_s"] > 0.1 and ea["not_serving_s"] >= ea["drained_s"] and ea["serving_s"] > 0
        (interval,) = ea["intervals"]
        assert interval["why"] == "drained" and interval["to"] > interval["from"]
        assert eb["drains"] == 0 and eb["drained_s"] == 0 and eb["not_serving_s"] == 0 and eb["intervals"] == []
        assert eb["serving_s"] > 0 and eb["peak_in_flight"] <= 4
        log = (tmp_path / "log").read_text()
        assert "asked by retune wave 1" in log
        events = [json.loads(x) for x in (out / "endpoints.jsonl").read_text().splitlines()]
        # The client's own start and stop bracket the endpoint events (nothing is served outside).
        assert [e["event"] for e in (events[0], events[-1])] == ["client_start", "client_stop"]
        assert events[0]["pid"] == events[-1]["pid"] == proc.pid
        assert set(events[1]) == {"t", "url", "event", "capacity"}
        mine = [(e["event"], e["capacity"]) for e in events if e.get("url") == a.url]
        # The new capacity is read while still drained, then the drain is lifted.
        assert mine[-3:] == [("drained", 4), ("capacity", 6), ("resumed", 6)]
        assert ("up", 4) in mine
        assert [e["event"] for e in events if e.get("url") == b.url] == ["capacity", "up"]


def test_a_server_relaunched_with_a_key_is_confirmed_lost_then_back_with_the_key(tmp_path: Path) -> None:
    """A wave whose server comes back requiring an API key the client lacks: /health answers (SGLang
    exempts it), so only the client's word after the resume tells that the endpoint is out of
    service, and why. The key handed over with a second resume brings it back, on that endpoint
    alone; nothing is lost or doubled."""
    secret = "sk-rotated-7731"
    with (
        ThreadedFakeServer(Behaviour(capacity=4, delay=0.05)) as a,
        ThreadedFakeServer(Behaviour(capacity=4, delay=0.05)) as b,
    ):
        assert a.server is not None and b.server is not None
        p = write_prompts(tmp_path / "p.jsonl", 600)
        out = tmp_path / "out"
        proc, sock = start(tmp_path, p, a.url, b.url)
        try:
            wait_for(lambda: a.server.requests > 5, what="A generating")  # type: ignore[union-attr]
            assert drain(sock, a.url)["ok"] is True
            port = a.server.port
            a.stop()
            with ThreadedFakeServer(Behaviour(capacity=4, delay=0.05, api_key=secret), port=port) as a2:
                assert a2.server is not None
                reply = ask(sock, {"v": 1, "op": "resume", "endpoints": [a.url], "by": "wave 1", "confirm": 5})
                word = reply["service"][a.url]
                assert reply["capacity"] == {a.url: None}
                assert word["in_service"] is False and word["state"] == "disabled", word
                assert "taken out of service: HTTP 401 (API key rejected)" in word["why"]
                assert word["waited_s"] < 5  # decided at once, not at the bound
                # status.json names it for the operator (sglang-fleet-ops status: OUT OF SERVICE).
                wait_for(lambda: a.url in read_status(out).get("disabled", {}), what="status: A out of service")
                assert read_status(out)["disabled"][a.url] == "HTTP 401 (API key rejected)"
                seen_b = b.server.requests
                wait_for(lambda: b.server.requests > seen_b + 20, what="B generating")  # type: ignore[union-attr]
                # The retune hands the new key over with the resume: A is back, B untouched.
                assert drain(sock, a.url)["ok"] is True
                reply = ask(
                    sock,
                    {"v": 1, "op": "resume", "endpoints": [a.url], "by": "wave 1", "confirm": 10, "api_key": secret},
                )
                word = reply["service"][a.url]
                assert word["in_service"] is True and word["completed"] > 0, word
                assert word["why"].startswith("completed") and reply["capacity"] == {a.url: 4}
                assert proc.wait(60) == 0
                assert a2.server.requests > 0
        finally:
            stop_process(proc)
        exactly_once(p, out, 600)
        log = (tmp_path / "log").read_text()
        assert secret not in log and "NOT back in service" in log and "a new API key was handed over" in log
        failures = out / "failures" / "failures-00000-of-00001.jsonl"
        assert not failures.exists() or not failures.read_text().strip()


def test_confirm_waits_for_a_completion_and_names_failures(tmp_path: Path) -> None:
    """The word after a resume, per endpoint: back once it completed a request; an endpoint whose
    requests only fail since is named with the client's own reason of the last failure."""
    with (
        ThreadedFakeServer(Behaviour(capacity=4, delay=0.2)) as a,
        ThreadedFakeServer(Behaviour(capacity=4, delay=0.05)) as b,
    ):
        assert a.server is not None and b.server is not None
        p = write_prompts(tmp_path / "p.jsonl", 800)
        proc, sock = start(tmp_path, p, a.url, b.url)
        try:
            wait_for(lambda: a.server.requests > 5, what="A generating")  # type: ignore[union-attr]
            assert drain(sock, a.url)["ok"] is True
            reply = ask(sock, {"v": 1, "op": "resume", "endpoints": [a.url], "by": "wave 1", "confirm": 10})
            word = reply["service"][a.url]
            assert word["in_service"] is True and word["completed"] >= 1 and 0.15 < word["waited_s"] < 10, word
            # B now answers every generation with HTTP 429 (requeued): no completion, only failures.
            assert drain(sock, b.url)["ok"] is True
            b.behaviour.fail_all = 429
            reply = ask(sock, {"v": 1, "op": "resume", "endpoints": [b.url], "by": "wave 2", "confirm": 1.5})
            word = reply["service"][b.url]
            assert word["in_service"] is False and word["completed"] == 0 and word["failed"] > 0, word
            assert "failed since, none completed: HTTP 429" in word["why"]
            b.behaviour.fail_all = None
        finally:
            stop_process(proc)


def test_a_client_that_stops_on_the_resumed_endpoints_failures_says_so_before_it_exits(tmp_path: Path) -> None:
    """The resumed server refuses every prompt (HTTP 400): the run ends on too many failures in a
    row while the resume waits for its word, and the answer names that, not silence."""
    with ThreadedFakeServer(Behaviour(capacity=4, delay=0.05)) as a:
        assert a.server is not None
        p = write_prompts(tmp_path / "p.jsonl", 3000)
        proc, sock = start(tmp_path, p, a.url)
        try:
            wait_for(lambda: a.server.requests > 5, what="A generating")  # type: ignore[union-attr]
            assert drain(sock, a.url)["ok"] is True
            port = a.server.port
            a.stop()
            with ThreadedFakeServer(Behaviour(capacity=4, fail_all=400), port=port):
                reply = ask(sock, {"v": 1, "op": "resume", "endpoints": [a.url], "by": "wave 1", "confirm": 30})
                word = reply["service"][a.url]
                assert word["in_service"] is False and word["waited_s"] < 30, word
                assert word["why"].startswith("the client stops: 50 prompts failed in a row (last: HTTP 400")
                assert proc.wait(30) == 4
        finally:
            stop_process(proc)


def test_drain_deadline_abandons_a_slow_request_which_completes_elsewhere_once(tmp_path: Path) -> None:
    with (
        ThreadedFakeServer(Behaviour(capacity=3, delay=4.0)) as slow,
        ThreadedFakeServer(Behaviour(capacity=4, delay=0.01)) as fast,
    ):
        assert slow.server is not None
        p = write_prompts(tmp_path / "p.jsonl", 60, repeat_text=False)
        out = tmp_path / "out"
        # max_attempts 1: an abandoned attempt must not count as one.
        proc, sock = start(tmp_path, p, slow.url, fast.url, extra=("--max-attempts", "1"))
        try:
            wait_for(lambda: slow.server.running == 3, what="slow requests in flight")  # type: ignore[union-attr]
            stuck = set(slow.server.seen)
            reply = drain(sock, slow.url, timeout=0.3, lease=60, by="retune")
            assert reply["ok"] is True and reply["abandoned"] == 3 and reply["drained"] == [slow.url]
            assert 0.3 <= reply["waited_s"] < 3
            assert endpoint(ask(sock, {"v": 1, "op": "hello"}), slow.url)["in_flight"] == 0
            assert proc.wait(30) == 0
        finally:
            stop_process(proc)
        recs = exactly_once(p, out, 60)
        assert all(r["endpoint"] == fast.url for r in recs)
        stuck_ids = {f"q{text.split()[-1]}" for text in stuck}
        moved = [r for r in recs if r["id"] in stuck_ids]
        assert len(moved) == 3 and all(r["attempts"] == 2 for r in moved)  # one abandoned, one written
        failures = out / "failures" / "failures-00000-of-00001.jsonl"
        assert not failures.exists() or failures.read_text() == ""
        assert "3 request(s) abandoned" in (tmp_path / "log").read_text()


def test_drains_and_resumes_in_a_row_lose_and_double_nothing(tmp_path: Path) -> None:
    """Waves back to back, each abandoning what is in flight: every prompt is written exactly once."""
    with (
        ThreadedFakeServer(Behaviour(capacity=4, delay=0.15)) as a,
        ThreadedFakeServer(Behaviour(capacity=4, delay=0.15)) as b,
    ):
        p = write_prompts(tmp_path / "p.jsonl", 150, repeat_text=False)
        out = tmp_path / "out"
        proc, sock = start(tmp_path, p, a.url, b.url, extra=("--max-attempts", "1"))
        abandoned = 0
        try:
            wait_for(lambda: ask(sock, {"v": 1, "op": "hello"})["state"] == "running", what="running")
            for _ in range(3):
                for url in (a.url, b.url):
                    reply = drain(sock, url, timeout=0.05, lease=30)
                    abandoned += reply["abandoned"]
                    resumed = ask(sock, {"v": 1, "op": "resume", "endpoints": [url]})
                    assert resumed["capacity"] == {url: 4}
            assert proc.wait(60) == 0
        finally:
            stop_process(proc)
        assert abandoned > 0
        exactly_once(p, out, 150)
        st = read_status(out)["endpoints"]
        assert st[a.url]["drains"] == 3 and st[b.url]["drains"] == 3
        assert len(st[a.url]["intervals"]) == 3 and all(i["to"] for i in st[a.url]["intervals"])


def test_a_drain_lapses_after_its_lease(tmp_path: Path) -> None:
    with ThreadedFakeServer(Behaviour(capacity=2, delay=0.05)) as a, ThreadedFakeServer(Behaviour(delay=0.05)) as b:
        assert a.server is not None
        p = write_prompts(tmp_path / "p.jsonl", 3000)
        proc, sock = start(tmp_path, p, a.url, b.url)
        try:
            wait_for(lambda: a.server.requests > 0, what="A in use")  # type: ignore[union-attr]
            assert drain(sock, a.url, timeout=0.2, lease=1.0, by="a retune that died")["abandoned"] == 0
            assert endpoint(ask(sock, {"v": 1, "op": "hello"}), a.url)["drained"] is True
            frozen = a.server.requests
            wait_for(
                lambda: not endpoint(ask(sock, {"v": 1, "op": "hello"}), a.url)["drained"],
                what="the lease to lapse",
            )
            wait_for(lambda: a.server.requests > frozen + 5, what="A used again")  # type: ignore[union-attr]
        finally:
            assert stop_process(proc) == 0
        assert "the drain asked by a retune that died lapsed after 1s" in (tmp_path / "log").read_text()


def test_a_drained_endpoint_whose_server_dies_is_not_counted_down(tmp_path: Path) -> None:
    """The retune kills the server while requests are still in flight: their errors use no attempt
    and do not mark the endpoint down; its prompts go to the other endpoint."""
    with (
        ThreadedFakeServer(Behaviour(capacity=3, delay=3.0)) as a,
        ThreadedFakeServer(Behaviour(capacity=4, delay=0.01)) as b,
    ):
        assert a.server is not None
        p = write_prompts(tmp_path / "p.jsonl", 40)
        out = tmp_path / "out"
        proc, sock = start(tmp_path, p, a.url, b.url, extra=("--max-attempts", "1", "--max-consecutive-failures", "1"))
        try:
            wait_for(lambda: a.server.running == 3, what="requests in flight at A")  # type: ignore[union-attr]
            result: dict[str, Any] = {}
            t = threading.Thread(target=lambda: result.update(drain(sock, a.url, timeout=20, lease=60)))
            t.start()
            wait_for(lambda: endpoint(ask(sock, {"v": 1, "op": "hello"}), a.url)["drained"], what="drained")
            a.stop()  # connections reset mid-request
            t.join(10)
            assert result["ok"] is True and result["abandoned"] == 0 and result["waited_s"] < 3
            assert proc.wait(30) == 0
        finally:
            stop_process(proc)
        recs = exactly_once(p, out, 40)
        assert all(r["endpoint"] == b.url for r in recs)
        st = read_status(out)["endpoints"][a.url]
        assert st["state"] == "up" and st["outages"] == 0 and st["errors"].get("unavailable") == 3


# ---------------------------------------------------------------------- the endpoint alone
def _endpoint(url: str) -> Endpoint:
    return Endpoint(
        url,
        headers={},
        override="auto",
        factor=1.5,
        default_concurrency=5,
        connect_timeout=2,
        backoff=Backoff(0.05, 0.2),
    )


def test_ledger_counts_drained_time_only_for_the_drained_endpoint() -> None:
    async def body() -> None:
        srv = FakeServer(Behaviour(capacity=4))
        port = await srv.start()
        drained, untouched = _endpoint(f"http://127.0.0.1:{port}"), _endpoint(f"http://127.0.0.1:{port}")
        events: list[tuple[str, int]] = []
        drained.on_event = lambda ep, ev: events.append((ev, ep.limiter.limit))
        before = drained.snapshot()
        assert before["serving_s"] == 0 and before["not_serving_s"] == 0  # not up yet: nothing counted
        for ep in (drained, untouched):
            await ep.refresh_capacity()
            ep.mark_up()
        await asyncio.sleep(0.1)
        drained.drain(lease=60, by="t")
        assert not drained.usable and drained.is_up
        await asyncio.sleep(0.25)
        s = drained.snapshot()
        assert s["drained"] is True and s["drains"] == 1 and s["drained_by"] == "t"
        assert 0.25 <= s["drained_s"] == s["not_serving_s"] < 1 and 0.1 <= s["serving_s"] < 0.25
        assert s["intervals"] == [{"from": s["intervals"][0]["from"], "to": None, "why": "drained"}]
        srv.b.capacity = 8
        assert await drained.resume() == 12  # 8 x factor 1.5, read from /server_info
        assert drained.usable
        s = drained.snapshot()
        assert s["intervals"][0]["to"] is not None and s["capacity"] == 12
        assert events == [("capacity", 6), ("up", 6), ("drained", 6), ("capacity", 12), ("resumed", 12)]
        u = untouched.snapshot()
        assert u["not_serving_s"] == 0 and u["drained_s"] == 0 and u["intervals"] == [] and u["serving_s"] >= 0.35
        for ep in (drained, untouched):
            await ep.close()
        await srv.stop()

    asyncio.run(body())


def test_resume_of_a_server_not_back_goes_down_and_is_probed() -> None:
    async def body() -> None:
        srv = FakeServer(Behaviour(capacity=4))
        port = await srv.start()
        ep = _endpoint(f"http://127.0.0.1:{port}")
        await ep.refresh_capacity()
        ep.mark_up()
        ep.drain(lease=60, by="t")
        await srv.stop()
        assert await ep.resume(timeout=0.3) is None
        assert ep.state == "down" and not ep.drained and ep.relaunches_seen == 1
        assert [i["why"] for i in ep.snapshot()["intervals"]] == ["drained", "down"]
        srv2 = FakeServer(Behaviour(capacity=2))
        await srv2.start(port)
        await asyncio.wait_for(ep.wait_up(), 10)  # the usual probe found it
        assert ep.usable and ep.limiter.limit == 3
        # A lease that lapses resumes by itself, through the same check.
        ep.drain(lease=0.1, by="t")
        assert not ep.usable
        await asyncio.wait_for(ep.wait_up(), 5)
        assert ep.usable and ep.drains == 2
        await ep.close()
        await srv2.stop()

    asyncio.run(body())


@pytest.mark.parametrize(
    ("cgroup", "unit"),
    [
        ("0::/system.slice/sglang-fleet-generate.service\n", "sglang-fleet-generate.service"),
        ("12:pids:/user.slice\n1:name=systemd:/system.slice/x.service\n0::/system.slice/y.service/sub\n", "y.service"),
        ("0::/user.slice/user-0.slice/session-3.scope\n", None),
    ],
)
def test_unit_name_from_the_cgroup(tmp_path: Path, cgroup: str, unit: str | None) -> None:
    f = tmp_path / "cgroup"
    f.write_text(cgroup)
    assert unit_name(str(f)) == unit
    assert unit_name(str(tmp_path / "missing")) is None
