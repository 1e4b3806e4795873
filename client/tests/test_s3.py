"""S3 sync against a real S3 API (moto's server, its own process on loopback) through boto3."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from fake_openai import Behaviour
from fleetkit import (
    AWS_ENV,
    FAST_SIM,
    MotoServer,
    SimServer,
    TCPProxy,
    ThreadedFakeServer,
    cli,
    client_env,
    generate_args,
    read_records,
    read_status,
    start_cli,
    stop_process,
    verify,
    wait_for,
    write_prompts,
)

from sglang_fleet.config import S3Config
from sglang_fleet.ids import ShardSpec
from sglang_fleet.s3sync import S3Sync, S3SyncError, expected_etag, part_plan
from sglang_fleet.store import OutputStore

FAST = [*FAST_SIM, "--s3-sync-interval", "0.2"]


def s3_args(moto_url: str, uri: str) -> list[str]:
    return ["--s3", uri, "--s3-endpoint-url", moto_url]


def keys(c: Any, bucket: str, prefix: str = "") -> dict[str, dict[str, Any]]:
    out = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = o
    return out


def verify_s3(p: Path, moto: MotoServer, uri: str, *extra: str) -> dict[str, Any]:
    r = cli("verify", "--prompts", str(p), "--s3", uri, "--s3-endpoint-url", moto.url, "--json", *extra)
    rep: dict[str, Any] = json.loads(r.stdout) if r.stdout else {}
    assert r.returncode == 0, r.stdout + r.stderr
    return rep


def test_upload_manifest_idempotence_and_verify(tmp_path: Path, moto: MotoServer, shared_sim: list[SimServer]) -> None:
    bucket = moto.new_bucket()
    uri = f"s3://{bucket}/jobs/run1"
    p = write_prompts(tmp_path / "p.jsonl", 400)
    out = tmp_path / "out"
    r = cli(
        *generate_args(p, out, shared_sim[0].url),
        "--shard-records",
        "100",
        *FAST,
        *s3_args(moto.url, uri),
    )
    assert r.returncode == 0, r.stderr
    assert AWS_ENV["AWS_SECRET_ACCESS_KEY"] not in r.stderr
    c = moto.client()
    objs = keys(c, bucket)
    shard_keys = sorted(k for k in objs if k.startswith("jobs/run1/shards/"))
    assert len(shard_keys) == 4
    assert all(f"jobs/run1/index/{k.rsplit('/', 1)[1][:-6]}.ids" in objs for k in shard_keys)
    # Objects are byte-identical to the local shards.
    for k in shard_keys:
        local = out / "shards" / k.rsplit("/", 1)[1]
        assert c.get_object(Bucket=bucket, Key=k)["Body"].read() == local.read_bytes()
    m = json.loads(c.get_object(Bucket=bucket, Key="jobs/run1/manifests/manifest-00000-of-00001.json")["Body"].read())
    assert m["format"] == "sglang-fleet-manifest/1" and m["records"] == 400 and m["total_prompts"] == 400
    assert [s["key"] for s in m["shards"]] == shard_keys
    s0 = m["shards"][0]
    assert s0["sha256"] == hashlib.sha256((out / "shards" / (s0["name"] + ".jsonl")).read_bytes()).hexdigest()
    rep = verify_s3(p, moto, uri)
    assert rep["succeeded"] == 400 and rep["exact"]
    assert verify_s3(p, moto, uri, "--index-only")["exact"]
    assert read_status(out)["s3"]["pending"] == 0
    # Nothing is sent again: not by a restart, not after the upload markers are lost.
    for f in (out / ".state" / "index").glob("*.uploaded"):
        f.unlink()
    r = cli(
        *generate_args(p, out, shared_sim[0].url),
        *FAST,
        *s3_args(moto.url, uri),
    )
    assert r.returncode == 0, r.stderr
    assert "already uploaded" in r.stderr
    after = keys(c, bucket)
    assert all(after[k]["LastModified"] == objs[k]["LastModified"] for k in shard_keys)
    assert len(list((out / ".state" / "index").glob("*.uploaded"))) == 4


def _store_with_shard(root: Path, size: int) -> OutputStore:
    s = OutputStore(root, ShardSpec(0, 1))
    s.open()
    pad = "x" * 1000
    i = 0
    while s.open_records * 1030 < size:
        s.append_record(f"r{i}", json.dumps({"id": f"r{i}", "output": pad}).encode() + b"\n")
        i += 1
    shard = s.detach_open_shard()
    assert shard is not None
    s.finalize(shard)
    return s


def test_multipart_upload_is_verified_and_foreign_objects_are_not_overwritten(tmp_path: Path, moto: MotoServer) -> None:
    os.environ.update(AWS_ENV)
    bucket = moto.new_bucket()
    store = _store_with_shard(tmp_path / "out", 12 * 1024 * 1024)
    meta = store.closed_shards()[0]
    cfg = S3Config(uri=f"s3://{bucket}/mp", endpoint_url=moto.url, multipart_threshold_mb=5, part_size_mb=5)
    sync = S3Sync(cfg, store)
    plan = part_plan(meta.bytes, 5 << 20, 5 << 20)
    assert len(plan) == 3
    etag, _ = expected_etag(store.shard_path(meta.name), plan)
    assert etag.endswith("-3")
    c = moto.client()
    key = f"mp/shards/{meta.name}.jsonl"
    # Another writer's object under this name (two clients given the same host shard) is left alone.
    c.put_object(Bucket=bucket, Key=key, Body=b"someone else's shard")
    with pytest.raises(S3SyncError, match="already exists with other content"):
        sync.sync_once()
    assert c.get_object(Bucket=bucket, Key=key)["Body"].read() == b"someone else's shard"
    assert not store.is_uploaded(meta.name)
    c.delete_object(Bucket=bucket, Key=key)
    assert sync.sync_once() == 1
    head = c.head_object(Bucket=bucket, Key=key)
    assert head["ETag"].strip('"') == etag and head["ContentLength"] == meta.bytes
    assert head["Metadata"]["sha256"] == meta.sha256
    assert c.get_object(Bucket=bucket, Key=key)["Body"].read() == store.shard_path(meta.name).read_bytes()
    assert c.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert sync.sync_once() == 0  # idempotent
    store.close()


def test_s3_down_at_the_end_of_the_job(tmp_path: Path, moto: MotoServer, fake: ThreadedFakeServer) -> None:
    """The job ends while S3 is down: the client keeps trying, a SIGTERM ends it at once (exit 0),
    the shards wait on disk, and the next start uploads them."""
    bucket = moto.new_bucket()
    uri = f"s3://{bucket}/late"
    proxy = TCPProxy(moto.port)
    proxy.start()
    p = write_prompts(tmp_path / "p.jsonl", 100)
    out = tmp_path / "out"
    args = [
        *generate_args(p, out, fake.url),
        "--shard-records",
        "40",
        *FAST,
        *s3_args(proxy.url, uri),
    ]
    write_prompts(tmp_path / "first.jsonl", 1)
    r = cli(*[a if a != str(p) else str(tmp_path / "first.jsonl") for a in args])
    assert r.returncode == 0, r.stderr  # the directory has now read S3 once
    proxy.kill()
    proc = start_cli(*args, log=tmp_path / "client.log")
    try:
        wait_for(
            lambda: read_status(out).get("remaining") == 0 and "upload failed" in (tmp_path / "client.log").read_text(),
            60,
            what="the end of the job, S3 failing",
        )
        assert proc.poll() is None  # still trying to upload
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        stop_process(proc)
    assert len(list((out / "shards").glob("*.jsonl"))) == 4
    assert set(keys(moto.client(), bucket, "late/shards/")) == {"late/shards/part-00000-of-00001-000000.jsonl"}
    proxy.start()
    try:
        r = cli(*args)
        assert r.returncode == 0, r.stderr
    finally:
        proxy.kill()
    assert verify_s3(p, moto, uri)["succeeded"] == 100


def test_delete_local_after_verified_upload(tmp_path: Path, moto: MotoServer, shared_sim: list[SimServer]) -> None:
    bucket = moto.new_bucket()
    uri = f"s3://{bucket}/del"
    p = write_prompts(tmp_path / "p.jsonl", 300)
    out = tmp_path / "out"
    args = [
        *generate_args(p, out, shared_sim[1].url),
        "--shard-records",
        "100",
        "--s3-delete-local",
        *FAST,
        *s3_args(moto.url, uri),
    ]
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert list((out / "shards").glob("*.jsonl")) == []
    assert len(list((out / ".state" / "index").glob("*.ids"))) == 3
    r = cli(*args)  # the ids of deleted shards still count as done
    assert r.returncode == 0 and "300 of 300 prompts already done" in r.stderr
    assert "deleted here after upload" in verify(p, out)
    assert verify_s3(p, moto, uri)["succeeded"] == 300


def test_s3_outage_mid_run_delays_uploads_but_not_generation(
    tmp_path: Path, moto: MotoServer, shared_sim: list[SimServer]
) -> None:
    bucket = moto.new_bucket()
    uri = f"s3://{bucket}/outage"
    proxy = TCPProxy(moto.port)
    proxy.start()
    p = write_prompts(tmp_path / "p.jsonl", 2000)
    out = tmp_path / "out"
    proc = start_cli(
        *generate_args(p, out, shared_sim[0].url, shared_sim[1].url),
        "--shard-records",
        "50",
        *FAST,
        *s3_args(proxy.url, uri),
        "--concurrency",
        "8",
        log=tmp_path / "client.log",
    )
    try:
        wait_for(lambda: (read_status(out).get("s3") or {}).get("uploaded", 0) >= 2, 60, what="first uploads")
        proxy.kill()  # S3 is gone: connections are refused
        wait_for(lambda: (read_status(out).get("s3") or {}).get("last_error"), 60, what="client to notice")
        done_at_outage = read_status(out)["done"]
        wait_for(lambda: read_status(out)["done"] >= done_at_outage + 200, 60, what="generation during the outage")
        pending = len(
            [
                m
                for m in (out / ".state" / "index").glob("*.meta.json")
                if not m.with_name(m.name.replace(".meta.json", ".uploaded")).exists()
            ]
        )
        assert pending >= 2  # closed shards waiting for S3, kept on disk
        proxy.start()
        assert proc.wait(120) == 0
    finally:
        stop_process(proc)
        proxy.kill()
    st = read_status(out)
    assert st["state"] == "done" and st["s3"]["pending"] == 0
    assert "sync failed" in (tmp_path / "client.log").read_text()
    rep = verify_s3(p, moto, uri)
    assert rep["succeeded"] == 2000
    assert len(keys(moto.client(), bucket, "outage/shards/")) == len(list((out / "shards").glob("*.jsonl")))


def test_a_new_host_adopts_what_s3_holds(tmp_path: Path, moto: MotoServer) -> None:
    """A host is lost after uploading; its replacement starts with an empty disk and the same S3 URI.
    This test uses the fake server for a prompt that always fails (the simulator has no such mode)."""
    bucket = moto.new_bucket()
    uri = f"s3://{bucket}/adopt"
    with ThreadedFakeServer(Behaviour(fail_status={"plain prompt 21": 400})) as srv:  # q21 is in shard 1/2
        s = srv.server
        assert s is not None
        p = write_prompts(tmp_path / "p.jsonl", 200)

        def host_shard(out: Path) -> str:
            """Host shard 1/2 of the job, on a host whose output directory is ``out``; its log."""
            r = cli(
                *generate_args(p, out, srv.url),
                "--shard-records",
                "60",
                "--shard",
                "1/2",
                *FAST,
                *s3_args(moto.url, uri),
            )
            assert r.returncode == 0, r.stderr
            return r.stderr

        first = tmp_path / "host-a"
        host_shard(first)
        sent = s.requests
        write_prompts(p, 300)  # the job grows: 100 more prompts
        second = tmp_path / "host-b"
        log = host_shard(second)
        assert "adopted part-00001-of-00002-000000" in log
        assert "merged 1 failure records" in log
        new = {x["id"] for x in read_records(second)}
        assert new and not new & {x["id"] for x in read_records(first)}
        assert s.requests - sent == len(new)  # nothing done by host A was generated again
        local_names = sorted(f.name for f in (second / "shards").glob("*.jsonl"))
        first_names = sorted(f.name for f in (first / "shards").glob("*.jsonl"))
        assert local_names[0] > first_names[-1]  # names continue; nothing in S3 is overwritten
        rep = verify_s3(p, moto, uri, "--shard", "1/2")
        assert rep["failed"] == 1 and rep["exact"]


def test_verify_s3_finds_a_doubled_shard(tmp_path: Path, moto: MotoServer, fake: ThreadedFakeServer) -> None:
    bucket = moto.new_bucket()
    uri = f"s3://{bucket}/dup"
    p = write_prompts(tmp_path / "p.jsonl", 50)
    r = cli(
        *generate_args(p, tmp_path / "out", fake.url),
        *FAST,
        *s3_args(moto.url, uri),
    )
    assert r.returncode == 0, r.stderr
    c = moto.client()
    src = next(iter(keys(c, bucket, "dup/shards/")))
    c.copy_object(
        Bucket=bucket, Key="dup/shards/part-00000-of-00001-000777.jsonl", CopySource={"Bucket": bucket, "Key": src}
    )
    r = cli("verify", "--prompts", str(p), "--s3", uri, "--s3-endpoint-url", moto.url, env=client_env())
    assert r.returncode == 1
    assert "DOUBLED: 50 id(s)" in r.stdout and "000777.jsonl" in r.stdout
    assert "not yet in a manifest" in r.stdout
