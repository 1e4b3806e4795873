"""The client against the SGLang simulator: real server processes, killed and relaunched for real."""

from __future__ import annotations

import json
from pathlib import Path

from fleetkit import (
    FAST_SIM,
    SimServer,
    Simulator,
    cli,
    generate_args,
    read_records,
    read_status,
    start_cli,
    stop_process,
    verify,
    wait_for,
    write_prompts,
)


def test_two_servers_reasoning_and_capacity_from_server_info(tmp_path: Path, shared_sim: list[SimServer]) -> None:
    p = write_prompts(tmp_path / "p.jsonl", 600)
    out = tmp_path / "out"
    r = cli(
        *generate_args(p, out, shared_sim[0].url, shared_sim[1].url),
        "--separate-reasoning",
        "--shard-records",
        "200",
        *FAST_SIM,
    )
    assert r.returncode == 0, r.stderr
    recs = read_records(out)
    assert len(recs) == 600
    assert all(x["output"] and x["reasoning_content"] and x["finish_reason"] in ("stop", "length") for x in recs)
    assert all(x["usage"]["completion_tokens"] <= 12 for x in recs)
    assert {x["endpoint"] for x in recs} == {s.url for s in shared_sim}
    st = read_status(out)
    assert [st["endpoints"][s.url]["server_capacity"] for s in shared_sim] == [48, 48]
    assert [st["endpoints"][s.url]["concurrency"] for s in shared_sim] == [48, 48]
    # Same prompt and seed, same completion: the output is the server's, unaltered.
    same = [x["output"] for x in recs if x["id"] in {f"q{i}" for i in range(600) if i % 7 == 3}]
    assert len(same) > 50
    verify(p, out)


def test_server_killed_and_relaunched_mid_run(tmp_path: Path, simulator: Simulator) -> None:
    server = simulator.launch(0, None, "--max-running-requests", "32")
    p = write_prompts(tmp_path / "p.jsonl", 1500)
    out = tmp_path / "out"
    client = start_cli(
        *generate_args(p, out, server.url),
        *FAST_SIM,
        "--concurrency-factor",
        "1.0",
        log=tmp_path / "client.log",
    )
    try:
        wait_for(lambda: read_status(out).get("done", 0) >= 300, 60, what="progress before the crash")
        server.kill()
        wait_for(lambda: read_status(out)["endpoints"][server.url]["state"] == "down", 30, what="client sees it")
        done_while_down = read_status(out)["done"]
        # A relaunch with another capacity, after the old one's memory is released.
        relaunched = simulator.launch(0, server.port, "--max-running-requests", "16", wait=False)
        wait_for(lambda: read_status(out)["endpoints"][server.url]["state"] == "up", 60, what="client sees it back")
        assert read_status(out)["endpoints"][server.url]["concurrency"] == 16
        assert client.wait(120) == 0
    finally:
        stop_process(client)
    log = (tmp_path / "client.log").read_text()
    assert "down (" in log and "back up after" in log
    st = read_status(out)
    assert st["done"] == 1500 and st["failed_total"] == 0 and st["done"] > done_while_down
    assert st["endpoints"][server.url]["outages"] == 1
    assert st["requeued_unavailable"] > 0  # requests in flight at the crash waited and went again
    assert not (out / "failures" / "failures-00000-of-00001.jsonl").exists()
    assert relaunched.healthy()
    r = cli("verify", "--prompts", str(p), "--output", str(out), "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 0 and rep["succeeded"] == 1500, r.stdout
    assert {x["id"] for x in read_records(out)} == {f"q{i}" for i in range(1500)}
