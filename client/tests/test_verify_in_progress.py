"""``verify --in-progress`` against a running job whose shards close every fraction of a second,
are uploaded to S3 (moto) and deleted locally: every report is exact, none fails, none crashes."""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

from fake_openai import Behaviour
from fleetkit import (
    FAST_FAKE,
    MotoServer,
    ThreadedFakeServer,
    generate_args,
    start_cli,
    stop_process,
    verify,
    wait_for,
    write_prompts,
)

from sglang_fleet.cli import main


def verify_in_progress(prompts: Path, out: Path) -> tuple[int, dict[str, object], str]:
    """One `verify --in-progress --json` in this process (a loop of processes would read the
    directory a few times a second only); its exit status, report and logged errors."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["verify", "--prompts", str(prompts), "--output", str(out), "--in-progress", "--json"])
    return rc, json.loads(stdout.getvalue() or "{}"), stderr.getvalue()


def test_verify_in_progress_is_exact_while_shards_close_upload_and_vanish(tmp_path: Path, moto: MotoServer) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", 2000)
    out = tmp_path / "out"
    uri = f"s3://{moto.new_bucket()}/job"
    # At least 5 s of generation (2000 prompts, 8 at a time, 20 ms each): many reads while it runs.
    with ThreadedFakeServer(Behaviour(capacity=8, delay=0.02)) as srv:
        proc = start_cli(
            *generate_args(prompts, out, srv.url),
            *FAST_FAKE,
            # A shard closes every few records (a few times a second), is uploaded at once and
            # deleted here once S3 holds it: renames and deletions race every read of verify.
            "--shard-records",
            "4",
            "--s3",
            uri,
            "--s3-endpoint-url",
            moto.url,
            "--s3-sync-interval",
            "0.05",
            "--s3-delete-local",
            log=tmp_path / "client.log",
        )
        try:
            wait_for((out / "shards").is_dir, 30, what="the client to start writing")
            reports = []
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:
                rc, report, errors = verify_in_progress(prompts, out)
                assert rc == 0, (report, errors)
                assert report["exact"] is True, report
                assert report["doubled_count"] == report["unexpected_count"] == 0 and report["damaged"] == []
                reports.append(report)
            assert proc.wait(60) == 0, (tmp_path / "client.log").read_text()[-3000:]
        finally:
            stop_process(proc)
    # The loop saw the job in progress, with shards closed, uploaded and deleted under it.
    assert len(reports) >= 3
    assert any(0 < int(str(r["records"])) < 2000 for r in reports)
    assert any("deleted here after upload" in " ".join(map(str, r["notes"])) for r in reports)
    assert "OK: every prompt id appears exactly once" in verify(prompts, out)
