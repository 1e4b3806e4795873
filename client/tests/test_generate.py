"""The client as a real process against the in-test fake server (behaviours on demand: per-prompt
errors, malformed answers, API keys, exact concurrency accounting)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from fake_openai import Behaviour, answer_for
from fleetkit import (
    FAST_FAKE,
    ThreadedFakeServer,
    cli,
    client_env,
    free_port,
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


def test_every_prompt_once_with_reasoning_and_resume_is_a_no_op(tmp_path: Path, fake: ThreadedFakeServer) -> None:
    p = write_prompts(tmp_path / "p.jsonl", 200)
    out = tmp_path / "out"
    r = gen(p, out, fake.url, extra=("--shard-records", "50", "--temperature", "0.7", "--seed", "5"))
    assert r.returncode == 0, r.stderr
    recs = read_records(out)
    assert len(recs) == 200 and len({x["id"] for x in recs}) == 200
    by_id = {x["id"]: x for x in recs}
    # Repeated prompt texts are distinct prompts, each with its own completion.
    same = [i for i in range(200) if i % 7 == 3]
    assert all(f"q{i}" in by_id for i in same)
    rec = by_id["q0"]
    assert rec["output"] == answer_for("chat prompt 0", 5)
    assert rec["reasoning_content"] == "thinking about chat prompt 0"
    assert rec["finish_reason"] == "stop" and rec["usage"]["completion_tokens"] == 7
    assert rec["endpoint"] == fake.url and rec["attempts"] == 1
    assert set(rec["timings"]) == {"started", "finished", "latency_s", "queued_s"}
    assert len(list((out / "shards").glob("*.jsonl"))) == 4
    assert "OK" in verify(p, out)
    st = read_status(out)
    assert (st["state"], st["done"], st["total"], st["remaining"]) == ("done", 200, 200, 0)
    seen = fake.server.requests  # type: ignore[union-attr]
    r = gen(p, out, fake.url)
    assert r.returncode == 0
    assert fake.server.requests == seen  # type: ignore[union-attr]
    assert "200 of 200 prompts already done" in r.stderr


def test_retries_failures_and_retry_failed(tmp_path: Path) -> None:
    b = Behaviour(flaky={"plain prompt 1": 2}, fail_status={"plain prompt 5": 400}, garbage={"plain prompt 9"})
    with ThreadedFakeServer(b) as srv:
        p = write_prompts(tmp_path / "p.jsonl", 20)
        out = tmp_path / "out"
        r = gen(p, out, srv.url, extra=("--max-attempts", "3"))
        assert r.returncode == 0, r.stderr
        by_id = {x["id"]: x for x in read_records(out)}
        assert by_id["q1"]["attempts"] == 3  # two 500s, then an answer
        fails = [json.loads(x) for x in (out / "failures" / "failures-00000-of-00001.jsonl").read_text().splitlines()]
        assert {f["id"]: f["kind"] for f in fails} == {"q5": "permanent", "q9": "retry"}
        f5 = next(f for f in fails if f["id"] == "q5")
        assert f5["status"] == 400 and "refused plain prompt 5" in f5["error"] and f5["attempts"] == 1
        assert next(f for f in fails if f["id"] == "q9")["attempts"] == 3
        assert "OK" in verify(p, out)
        tries = srv.server.seen.count("plain prompt 5")  # type: ignore[union-attr]
        # A restart does not try failed prompts again...
        assert gen(p, out, srv.url).returncode == 0
        assert srv.server.seen.count("plain prompt 5") == tries  # type: ignore[union-attr]
        # ...unless asked to; the earlier failures are moved aside, so verify still sees each id once.
        srv.behaviour.fail_status.clear()
        srv.behaviour.garbage.clear()
        r = gen(p, out, srv.url, extra=("--retry-failed",))
        assert r.returncode == 0, r.stderr
        assert srv.server.seen.count("plain prompt 5") == tries + 1  # type: ignore[union-attr]
        assert (out / "failures" / "failures-00000-of-00001.jsonl").read_text() == ""
        assert "20 completed, 0 failed" in verify(p, out)


def test_api_key_is_sent_and_never_shown(tmp_path: Path) -> None:
    secret = "sk-very-secret-4242"
    with ThreadedFakeServer(Behaviour(api_key=secret)) as srv:
        p = write_prompts(tmp_path / "p.jsonl", 30)
        out = tmp_path / "out"
        r = gen(p, out, srv.url, extra=("--log-level", "DEBUG"), env=client_env(SGLANG_API_KEY=secret))
        assert r.returncode == 0, r.stderr
        assert len(read_records(out)) == 30
        everything = r.stdout + r.stderr + "".join(f.read_text(errors="replace") for f in out.rglob("*") if f.is_file())
        assert secret not in everything
        # A wrong key takes the endpoint out of service at start (its /server_info, like SGLang's,
        # needs the key while /health does not); no prompt is marked failed for it.
        out2 = tmp_path / "out2"
        r = gen(p, out2, srv.url, env=client_env(SGLANG_API_KEY="wrong"))
        assert r.returncode == 3
        assert "no endpoint accepts the API key" in r.stderr and "HTTP 401 (API key rejected)" in r.stderr
        assert "wrong" not in r.stderr.replace("wrong key", "")
        assert not (out2 / "failures" / "failures-00000-of-00001.jsonl").exists()


def test_unreachable_endpoint_at_start(tmp_path: Path) -> None:
    p = write_prompts(tmp_path / "p.jsonl", 5)
    url = f"http://127.0.0.1:{free_port()}"
    r = gen(p, tmp_path / "out", url, extra=("--startup-timeout", "1"))
    assert r.returncode == 3
    assert f"no endpoint reachable after 1s: {url}: connect to 127.0.0.1" in r.stderr
    assert "Connection refused" in r.stderr


def test_malformed_prompts_file_names_the_line(tmp_path: Path, fake: ThreadedFakeServer) -> None:
    p = write_prompts(tmp_path / "p.jsonl", 5)
    with open(p, "a") as f:
        f.write('{"id": "bad", "messages": [{"role": "user", "content": "x"}\n')
    r = gen(p, tmp_path / "out", fake.url)
    assert r.returncode == 2
    assert f"{p}:6: not valid JSON" in r.stderr
    assert fake.server.requests == 0  # type: ignore[union-attr]  # nothing was sent


def test_a_dead_endpoint_does_not_hold_up_the_others(tmp_path: Path, fake: ThreadedFakeServer) -> None:
    p = write_prompts(tmp_path / "p.jsonl", 60)
    dead = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "out"
    r = gen(p, out, dead, fake.url)
    assert r.returncode == 0, r.stderr
    assert "OK" in verify(p, out)
    st = read_status(out)
    assert st["endpoints"][dead]["state"] == "down"
    assert st["endpoints"][fake.url]["completed"] == 60


def test_concurrency_from_server_info_control_file_and_pause(tmp_path: Path) -> None:
    with ThreadedFakeServer(Behaviour(capacity=3, delay=0.03)) as srv:
        s = srv.server
        assert s is not None
        p = write_prompts(tmp_path / "p.jsonl", 400)
        out = tmp_path / "out"
        proc = start_cli(*generate_args(p, out, srv.url), *FAST_FAKE, log=tmp_path / "log")
        try:
            wait_for(
                lambda: read_status(out).get("endpoints", {}).get(srv.url, {}).get("concurrency") == 3,
                what="auto concurrency 3",
            )
            wait_for(lambda: s.requests > 20, what="progress")
            assert s.max_running <= 3
            r = cli("control", "--output", str(out), "--concurrency", "1")
            assert r.returncode == 0 and "signalled pid" in r.stdout
            wait_for(lambda: read_status(out)["endpoints"][srv.url]["concurrency"] == 1, what="concurrency 1")
            wait_for(lambda: s.running <= 1, what="excess requests to drain")
            s.max_running = s.running
            base = s.requests
            wait_for(lambda: s.requests > base + 15, what="more progress")
            assert s.max_running <= 1
            assert cli("control", "--output", str(out), "--pause").returncode == 0
            wait_for(lambda: read_status(out).get("paused") and read_status(out)["in_flight"] == 0, what="pause")
            frozen = s.requests
            wait_for(lambda: read_status(out)["updated_at"] > read_status(out)["started_at"] + 0.5, what="time")
            assert s.requests == frozen
            assert cli("control", "--output", str(out), "--resume", "--concurrency", "auto").returncode == 0
            assert proc.wait(120) == 0
        finally:
            stop_process(proc)
        assert "OK" in verify(p, out)


def test_control_never_signals_the_stale_pid_a_killed_client_left(tmp_path: Path, fake: ThreadedFakeServer) -> None:
    """A SIGKILLed client leaves its pid in the lock file; that number may since belong to an
    unrelated program, which `control` must leave alone (SIGHUP would end it)."""
    p = write_prompts(tmp_path / "p.jsonl", 5)
    out = tmp_path / "out"
    assert gen(p, out, fake.url).returncode == 0
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        (out / ".state" / "lock").write_text(f"{bystander.pid}\n")
        r = cli("control", "--output", str(out), "--pause")
        assert r.returncode == 0, r.stderr
        assert "no client running" in r.stdout and "signalled" not in r.stdout
        assert bystander.poll() is None, "the bystander was signalled"
        assert json.loads((out / "control.json").read_text())["paused"] is True
    finally:
        bystander.kill()
        bystander.wait()


def test_sigterm_finishes_requests_in_flight_then_exits_zero(tmp_path: Path) -> None:
    with ThreadedFakeServer(Behaviour(capacity=8, delay=0.4)) as srv:
        s = srv.server
        assert s is not None
        p = write_prompts(tmp_path / "p.jsonl", 100)
        out = tmp_path / "out"
        proc = start_cli(
            *generate_args(p, out, srv.url),
            *FAST_FAKE,
            "--drain-timeout",
            "30",
            log=tmp_path / "log",
        )
        wait_for(lambda: s.requests >= 12 and s.running == 8, what="requests in flight")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        log = (tmp_path / "log").read_text()
        assert "stopping (SIGTERM)" in log
        # Every request the server accepted was answered during the drain and written.
        assert len(read_records(out)) == s.requests
        assert not list((out / "shards").glob("*.open"))
        assert read_status(out)["state"] == "stopped"
        # A drain deadline shorter than the requests: they are abandoned and sent again next time.
        srv.behaviour.delay = 5.0
        proc = start_cli(
            *generate_args(p, out, srv.url),
            *FAST_FAKE,
            "--drain-timeout",
            "0.3",
            log=tmp_path / "log2",
        )
        before = s.requests
        wait_for(lambda: s.requests >= before + 8, what="slow requests in flight")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "abandoning 8 request(s)" in (tmp_path / "log2").read_text()
        srv.behaviour.delay = 0.0
        assert gen(p, out, srv.url).returncode == 0
    assert "100 completed" in verify(p, out)


def test_host_shards_split_one_prompt_set(tmp_path: Path, fake: ThreadedFakeServer) -> None:
    p = write_prompts(tmp_path / "p.jsonl", 150)
    outs = [tmp_path / f"out{i}" for i in range(3)]
    for i, out in enumerate(outs):
        r = gen(p, out, fake.url, extra=("--shard", f"{i}/3"))
        assert r.returncode == 0, r.stderr
        assert all(f"-0000{i}-of-00003-" in f.name for f in (out / "shards").iterdir())
        assert cli("verify", "--prompts", str(p), "--output", str(out), "--shard", f"{i}/3").returncode == 0
    sizes = [len(read_records(o)) for o in outs]
    assert sum(sizes) == 150 and min(sizes) > 0
    assert "150 completed" in verify(p, *outs)
    # One host shard alone is not the whole job.
    r = cli("verify", "--prompts", str(p), "--output", str(outs[0]))
    assert r.returncode == 1 and "MISSING" in r.stdout


def test_completions_api(tmp_path: Path, fake: ThreadedFakeServer) -> None:
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"text {i}"}) + "\n" for i in range(10)))
    out = tmp_path / "out"
    r = gen(p, out, fake.url, extra=("--api", "completions"))
    assert r.returncode == 0, r.stderr
    assert {x["output"] for x in read_records(out)} == {answer_for(f"text {i}", None) for i in range(10)}
    chat = write_prompts(tmp_path / "chat.jsonl", 4)
    r = gen(chat, tmp_path / "out2", fake.url, extra=("--api", "completions"))
    assert r.returncode == 2 and "'messages' needs api: chat" in r.stderr


def test_stops_when_every_prompt_fails(tmp_path: Path) -> None:
    with ThreadedFakeServer(Behaviour(fail_all=400)) as srv:
        p = write_prompts(tmp_path / "p.jsonl", 50)
        out = tmp_path / "out"
        r = gen(p, out, srv.url, extra=("--max-consecutive-failures", "5", "--concurrency", "1"))
        assert r.returncode == 4
        assert "5 prompts failed in a row (last: HTTP 400: bad request setting)" in r.stderr
        assert len((out / "failures" / "failures-00000-of-00001.jsonl").read_text().splitlines()) == 5
