"""SIGKILL at random moments, many times in one job, then exactly-once output locally and in S3.

The seed is printed; ``CRASH_SEED=n pytest client/tests/test_crash.py`` replays a run.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from pathlib import Path

from fleetkit import MotoServer, SimServer, cli, generate_args, read_records, start_cli, wait_for, write_prompts

PROMPTS = 5000
KILLS = 16


def written_bytes(out: Path) -> int:
    total = 0
    for f in (out / "shards").glob("part-*"):
        with contextlib.suppress(FileNotFoundError):  # renamed or deleted since the listing
            total += f.stat().st_size
    return total


def test_sigkill_at_random_moments_loses_and_doubles_nothing(
    tmp_path: Path, moto: MotoServer, shared_sim: list[SimServer]
) -> None:
    seed = int(os.environ.get("CRASH_SEED", random.randrange(1 << 30)))
    print(f"CRASH_SEED={seed}")
    rng = random.Random(seed)
    bucket = moto.new_bucket()
    uri = f"s3://{bucket}/crash"
    p = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "out"
    args = [
        *generate_args(p, out, shared_sim[0].url, shared_sim[1].url),
        "--max-tokens",
        "12",
        "--shard-records",
        "150",
        "--shard-seconds",
        "0.7",
        "--fsync",
        "interval",
        "--fsync-interval",
        "0.05",
        "--s3",
        uri,
        "--s3-endpoint-url",
        moto.url,
        "--s3-sync-interval",
        "0.1",
        "--progress",
        "log",
        "--status-interval",
        "0.2",
        "--drain-timeout",
        "5",
    ]
    log = tmp_path / "client.log"
    kills = 0
    rounds = 0
    stops = 0
    progressed = 0
    torn = 0
    while kills < KILLS:
        before = written_bytes(out) if out.exists() else 0
        proc = start_cli(*args, log=log)
        mode = rounds % 4
        rounds += 1
        if mode == 0:
            time.sleep(rng.uniform(0.0, 0.6))  # during start-up: recovery, S3 adoption, probing
        else:
            wait_for(
                lambda b=before, pr=proc: written_bytes(out) > b or pr.poll() is not None,
                60,
                0.01,
                what="records to be written",
            )
            time.sleep(rng.uniform(0.0, 0.25))  # in the middle of writing, closing and uploading
        if mode == 3:
            proc.send_signal(signal.SIGTERM)  # killed again in the middle of its drain
            time.sleep(rng.uniform(0.0, 0.15))
            if proc.poll() is not None and json.loads((out / "status.json").read_text())["state"] == "stopped":
                # Drain and shutdown were over before the kill came: a clean stop, then the next round.
                assert proc.returncode == 0
                stops += 1
                continue
        if proc.poll() is not None:
            break  # the job ended before this kill; counted below
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
        kills += 1
        if written_bytes(out) > before:
            progressed += 1
        opened = sorted((out / "shards").glob("*.jsonl.open"))
        if mode == 2 and opened:
            # What a power loss can leave: the head of a record that never fully reached the disk.
            with open(opened[-1], "ab") as f:
                f.write(b'{"id":"q1","output":"half a rec')
            torn += 1
    assert kills == KILLS, f"the job finished after {kills} kills and {stops} clean stops; make it longer (seed {seed})"
    assert progressed >= KILLS // 2, "most kills must land while records are being written"
    final = cli(*args, timeout=300)
    assert final.returncode == 0, final.stderr
    assert f"all {PROMPTS} prompts done" in final.stderr or "prompts already done" in final.stderr

    local = cli("verify", "--prompts", str(p), "--output", str(out), "--json")
    rep = json.loads(local.stdout)
    assert local.returncode == 0 and rep["exact"], f"seed {seed}: {local.stdout}"
    assert rep["succeeded"] == PROMPTS and rep["failed"] == 0
    remote = cli("verify", "--prompts", str(p), "--s3", uri, "--s3-endpoint-url", moto.url, "--json")
    rrep = json.loads(remote.stdout)
    assert remote.returncode == 0 and rrep["exact"], f"seed {seed}: {remote.stdout}"
    assert rrep["succeeded"] == PROMPTS
    ids = [x["id"] for x in read_records(out)]
    assert len(ids) == len(set(ids)) == PROMPTS
    text = log.read_text()
    assert text.count("recovered") >= 1
    if torn:
        assert "torn tail" in text
