"""A server that accepts requests and stops producing (the simulator's ``generation_hang``, /health
still 200) on one of three endpoints during a job: the client names the stall within the time it
derives from that endpoint's own completions, moves its work to the others (nothing lost or
doubled), keeps probing it, and takes it back once it completes again (relaunched)."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

from fleetkit import (
    FAST_SIM,
    Simulator,
    cli,
    free_port,
    generate_args,
    read_records,
    read_status,
    start_cli,
    stop_process,
    verify,
    wait_for,
    write_prompts,
)

from sglang_fleet.cli import main
from sglang_fleet.stall import check_interval

STALL_MIN_S = 0.5
HANG_AFTER = 40  # requests the server completes before it hangs


def events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def verify_in_progress(prompts: Path, out: Path) -> dict[str, Any]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(["verify", "--prompts", str(prompts), "--output", str(out), "--in-progress", "--json"])
    report: dict[str, Any] = json.loads(stdout.getvalue())
    assert rc == 0 and report["exact"], report
    return report


def test_a_stalled_server_is_named_routed_around_probed_and_taken_back(tmp_path: Path) -> None:
    hung_port = free_port()
    sim = Simulator(
        tmp_path / "sim",
        {
            "gpus": {"count": 3},
            "faults": [
                {"kind": "generation_hang", "match": {"port": hung_port}, "after_requests": HANG_AFTER},
            ],
        },
    )
    try:
        a = sim.launch(0, None, "--max-running-requests", "16", wait=False)
        b = sim.launch(1, None, "--max-running-requests", "16", wait=False)
        hung = sim.launch(2, hung_port, "--max-running-requests", "16", wait=False)
        for s in (a, b, hung):
            s.wait_healthy()
        prompts = write_prompts(tmp_path / "p.jsonl", 2500)
        out = tmp_path / "out"
        endpoint_log = tmp_path / "endpoints.jsonl"
        client = start_cli(
            *generate_args(prompts, out, a.url, b.url, hung.url),
            *FAST_SIM,
            "--stall-min-s",
            str(STALL_MIN_S),
            "--endpoint-log",
            str(endpoint_log),
            "--shard-records",
            "200",
            log=tmp_path / "client.log",
        )
        try:
            stalled = wait_for(
                lambda: [e for e in events(endpoint_log) if e.get("event") == "stalled"],
                60,
                what="the stall to be named in the endpoint log",
            )
            assert [e["url"] for e in stalled] == [hung.url]
            reason = stalled[0]["reason"]
            assert "no completion for" in reason and "while other endpoints completed" in reason
            threshold = float(re.search(r"threshold ([0-9.]+)s", reason).group(1))  # type: ignore[union-attr]
            # Named within the derived time: from its last completion, the threshold and one look.
            last_done = max(
                r["timings"]["finished"]
                for p in (out / "shards").glob("part-*")
                for r in map(json.loads, p.read_text().splitlines())
                if r["endpoint"] == hung.url
            )
            assert stalled[0]["t"] - last_done <= threshold + check_interval(STALL_MIN_S) + 1.0, (stalled, last_done)
            st = wait_for(lambda: (read_status(out).get("stalled") or {}).get(hung.url) and read_status(out), 10)
            assert st["endpoints"][hung.url]["state"] == "stalled" and st["endpoints"][hung.url]["stalls"] == 1
            done_at_stall = st["done"]
            # The others keep the job going, and a verify during the stall is exact.
            wait_for(lambda: read_status(out).get("done", 0) >= done_at_stall + 200, 60, what="the job to go on")
            # Paused (requests in flight finish, nothing new is sent) so that work is left for the
            # relaunched server; the stalled endpoint is still probed meanwhile.
            assert cli("control", "--output", str(out), "--pause").returncode == 0
            verify_in_progress(prompts, out)
            assert read_status(out)["endpoints"][hung.url]["state"] == "stalled"  # probed, not trusted
            # The server is relaunched without the fault (the retune heals it): taken back.
            hung.kill()
            (sim.tmp / "config.json").write_text(
                json.dumps({**json.loads((sim.tmp / "config.json").read_text()), "faults": []})
            )
            sim.launch(2, hung_port, "--max-running-requests", "16")
            wait_for(
                lambda: [e for e in events(endpoint_log) if e.get("url") == hung.url][-1]["event"] == "up",
                60,
                what="the relaunched server to be taken back",
            )
            assert read_status(out)["done"] < 2500  # work is left for it
            assert cli("control", "--output", str(out), "--resume").returncode == 0
            assert client.wait(120) == 0, (tmp_path / "client.log").read_text()[-3000:]
        finally:
            stop_process(client)
    finally:
        sim.cleanup()
    recs = read_records(out)
    assert len(recs) == 2500  # nothing lost, nothing doubled (verify below checks each id once)
    verify(prompts, out)
    by_endpoint = {url: sum(1 for r in recs if r["endpoint"] == url) for url in (a.url, b.url, hung.url)}
    assert by_endpoint[hung.url] >= HANG_AFTER - 16 and by_endpoint[a.url] + by_endpoint[b.url] > 2000
    log_events = [(e.get("url"), e["event"]) for e in events(endpoint_log) if e.get("url") == hung.url]
    assert (hung.url, "stalled") in log_events
    # Probed after the stall, and taken back once its relaunch completes a generation.
    assert log_events[log_events.index((hung.url, "stalled")) + 1 :][-1] == (hung.url, "up"), log_events
    assert any(r["endpoint"] == hung.url and r["timings"]["started"] > stalled[0]["t"] for r in recs)
    final = read_status(out)
    assert final["endpoints"][hung.url]["requeued_on_stall"] >= 1
