"""Expected conditions end a command with a message and its documented exit status, never a
traceback: stdout's reader gone (``... | head``), a file that vanished, a server that closed the
connection."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest
from fleetkit import client_env, write_prompts

from sglang_fleet import cli

HERE = Path(__file__).resolve().parent


def shard(out: Path, name: str, ids: list[str]) -> None:
    (out / "shards").mkdir(parents=True, exist_ok=True)
    (out / "shards" / f"{name}.jsonl").write_text("".join(json.dumps({"id": i, "output": "x"}) + "\n" for i in ids))


def run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """The command with a stdout whose reader has already gone: its first write fails."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "sglang_fleet", *args],
            env=client_env(),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)


@pytest.fixture
def job(tmp_path: Path) -> tuple[Path, Path]:
    prompts = write_prompts(tmp_path / "p.jsonl", 3)
    out = tmp_path / "out"
    shard(out, "part-00000-of-00001-000000", ["q0", "q1", "q2"])
    (out / "status.json").write_text(
        json.dumps(
            {
                "state": "running",
                "done": 3,
                "total": 3,
                "failed_total": 0,
                "requests_per_s": 1.0,
                "completion_tokens_per_s": 2.0,
                "eta_s": None,
                "in_flight": 0,
                "endpoints": {},
            }
        )
    )
    return prompts, out


@pytest.mark.parametrize(
    ("words", "status"),
    [
        (("verify", "--prompts", "{p}", "--output", "{o}"), 0),
        (("verify", "--prompts", "{p}", "--output", "{o}", "--json"), 0),
        (("status", "--output", "{o}"), 0),
        (("control", "--output", "{o}"), 0),
    ],
)
def test_a_reader_that_goes_away_drops_the_output_not_the_exit_status(
    job: tuple[Path, Path], words: tuple[str, ...], status: int
) -> None:
    prompts, out = job
    r = run_into_closed_pipe(*(w.format(p=prompts, o=out) for w in words))
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    assert "stdout was closed by its reader; the rest of the output is dropped" in r.stderr
    assert r.returncode == status


def test_verify_whose_verdict_is_not_exact_keeps_status_1_into_a_closed_pipe(job: tuple[Path, Path]) -> None:
    prompts, out = job
    shard(out, "part-00000-of-00001-000001", ["q1"])
    r = run_into_closed_pipe("verify", "--prompts", str(prompts), "--output", str(out))
    assert r.returncode == 1 and "Traceback" not in r.stderr


class _ClosingBody:
    def iter_chunks(self, size: int) -> Any:
        yield b'{"id":"q0","output":"x"}\n'
        raise botocore.exceptions.ResponseStreamingError(error="Connection broken: connection closed by peer")


class _ClosingS3:
    """An S3 that lists one shard and closes the connection while it is read."""

    def get_paginator(self, _name: str) -> Any:
        class Pages:
            def paginate(self, Bucket: str, Prefix: str) -> Any:
                if "shards" in Prefix:
                    return [{"Contents": [{"Key": f"{Prefix}part-00000-of-00001-000000.jsonl", "Size": 10}]}]
                return [{"Contents": []}]

        return Pages()

    def get_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        return {"Body": _ClosingBody()}


def test_verify_s3_whose_server_closes_the_connection_says_so_and_exits_2(
    job: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts, _ = job
    monkeypatch.setattr(cli, "_s3_client", lambda _a: _ClosingS3())
    code = cli.main(["verify", "--prompts", str(prompts), "--s3", "s3://bucket/job"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert "cannot read s3://bucket/job" in err and "connection closed by peer" in err


def test_verify_of_prompts_that_cannot_be_read_exits_2(
    job: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prompts, out = job
    prompts.chmod(0)
    try:
        if os.access(prompts, os.R_OK):
            pytest.skip("running as root: permissions do not stop a read")
        assert cli.main(["verify", "--prompts", str(prompts), "--output", str(out)]) == 2
    finally:
        prompts.chmod(0o644)
    assert "Permission denied" in capsys.readouterr().err


def test_control_whose_control_file_vanishes_reads_it_as_empty(job: tuple[Path, Path]) -> None:
    _, out = job
    out_text = io.StringIO()
    with contextlib.redirect_stdout(out_text):
        assert cli.main(["control", "--output", str(out)]) == 0
    assert json.loads(out_text.getvalue()) == {}
