from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sglang_fleet.ids import ShardSpec
from sglang_fleet.store import OutputStore, StoreError, scan_records

SPEC = ShardSpec(0, 1)


def rec(i: int | str) -> bytes:
    return json.dumps({"id": f"r{i}", "output": "x" * 50}, separators=(",", ":")).encode() + b"\n"


def open_store(root: Path, **kw: object) -> OutputStore:
    s = OutputStore(root, SPEC, **kw)  # type: ignore[arg-type]
    s.open()
    return s


def done_ids(s: OutputStore) -> list[str]:
    return sorted(s.iter_done_ids())


def test_rotation_closes_shards_with_sidecars(tmp_path: Path) -> None:
    s = open_store(tmp_path, shard_records=3)
    for i in range(7):
        s.append_record(f"r{i}", rec(i))
        if s.rotation_due():
            meta = s.finalize(s.detach_open_shard())  # type: ignore[arg-type]
            assert meta is not None and meta.records == 3
    s.close()
    names = sorted(p.name for p in (tmp_path / "shards").iterdir())
    assert names == [f"part-00000-of-00001-00000{i}.jsonl" for i in range(3)]
    assert [m.records for m in s.closed_shards()] == [3, 3, 1]
    s2 = open_store(tmp_path)
    assert done_ids(s2) == sorted(f"r{i}" for i in range(7))
    # New shards never reuse a name.
    s2.append_record("r99", rec(99))
    assert s2._open is not None and s2._open.name.endswith("000003")
    s2.close()


@pytest.mark.parametrize(
    "tail",
    [
        b'{"id":"r3","out',  # torn mid-record
        b'{"id":"r3"',  # torn, no newline
        b"\x00\x00\x00\x00\n",  # zero-filled pages after a power loss
        b'{"id":"r3","output":"x"}\n{"id":"r4"',  # one whole record, then a torn one
        b"not json at all\n" + rec(5),  # garbage before a whole record: everything after is dropped
    ],
)
def test_recovery_cuts_torn_tails(tmp_path: Path, tail: bytes) -> None:
    s = open_store(tmp_path)
    for i in range(3):
        s.append_record(f"r{i}", rec(i))
    path = s._open.file.path  # type: ignore[union-attr]
    with open(path, "ab") as f:
        f.write(tail)
    # The process "dies" here: nothing is closed or renamed; only its lock goes away with it.
    os.close(s._lock_fd)  # type: ignore[arg-type]
    s2 = OutputStore(tmp_path, SPEC)
    report = s2.open()
    assert report.recovered_shards == ["part-00000-of-00001-000000"]
    assert report.truncated_bytes > 0
    ids = done_ids(s2)
    whole = ["r0", "r1", "r2"] + (["r3"] if tail.startswith(b'{"id":"r3","output"') else [])
    assert ids == whole
    closed = tmp_path / "shards" / "part-00000-of-00001-000000.jsonl"
    assert not path.exists() and closed.exists()
    got, good, size = scan_records(closed)
    assert got == whole and good == size  # the closed shard holds whole records only
    s2.close()


def test_empty_open_shard_is_dropped(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir(parents=True)
    (tmp_path / "shards" / "part-00000-of-00001-000004.jsonl.open").write_bytes(b'{"id":')
    s = OutputStore(tmp_path, SPEC)
    report = s.open()
    assert report.dropped_empty == 1
    assert list((tmp_path / "shards").iterdir()) == []
    s.close()


def test_crash_between_sidecars_and_rename(tmp_path: Path) -> None:
    """The sidecars were written but the rename did not happen: the file's content wins."""
    s = open_store(tmp_path)
    for i in range(4):
        s.append_record(f"r{i}", rec(i))
    shard = s.detach_open_shard()
    assert shard is not None
    shard.file.close(sync=True)
    s._write_sidecars(shard.file.path, shard.name, ["r0", "r1"], None)  # stale: written before 2 more records
    os.close(s._lock_fd)  # type: ignore[arg-type]
    s2 = OutputStore(tmp_path, SPEC)
    s2.open()
    assert done_ids(s2) == ["r0", "r1", "r2", "r3"]
    assert [m.records for m in s2.closed_shards()] == [4]
    s2.close()


def test_failures_count_as_done_and_can_be_retired(tmp_path: Path) -> None:
    s = open_store(tmp_path)
    s.append_record("r0", rec(0))
    s.append_failure("r1", b'{"id":"r1","error":"HTTP 400"}\n')
    s.close()
    with open(tmp_path / "failures" / "failures-00000-of-00001.jsonl", "ab") as f:
        f.write(b'{"id":"r2","err')  # torn
    s = open_store(tmp_path)
    assert done_ids(s) == ["r0", "r1"]
    retired = s.retire_failures()
    assert retired is not None and retired.exists()
    assert done_ids(s) == ["r0"]
    s.close()


def test_shard_data_lost_and_never_uploaded_is_not_done(tmp_path: Path) -> None:
    s = open_store(tmp_path)
    s.append_record("r0", rec(0))
    s.close()
    (tmp_path / "shards" / "part-00000-of-00001-000000.jsonl").unlink()
    s = OutputStore(tmp_path, SPEC)
    report = s.open()
    assert report.stale_index == ["part-00000-of-00001-000000"]
    assert done_ids(s) == []
    s.close()


def test_uploaded_shard_deleted_locally_stays_done(tmp_path: Path) -> None:
    s = open_store(tmp_path)
    s.append_record("r0", rec(0))
    s.close()
    s = open_store(tmp_path)
    s.mark_uploaded("part-00000-of-00001-000000", {"etag": "x"})
    s.shard_path("part-00000-of-00001-000000").unlink()
    s.close()
    s = open_store(tmp_path)
    assert done_ids(s) == ["r0"]
    s.close()


def test_one_writer_at_a_time(tmp_path: Path) -> None:
    s = open_store(tmp_path)
    with pytest.raises(StoreError, match=f"in use by another sglang-fleet process \\(pid {os.getpid()}\\)"):
        open_store(tmp_path)
    s.close()
    open_store(tmp_path).close()


def test_directory_belongs_to_one_host_shard(tmp_path: Path) -> None:
    open_store(tmp_path).close()
    with pytest.raises(StoreError, match="belongs to host shard 0/1, not 1/2"):
        OutputStore(tmp_path, ShardSpec(1, 2)).open()


def test_load_done_exact_and_digest_agree(tmp_path: Path) -> None:
    s = open_store(tmp_path)
    for i in range(50):
        s.append_record(f"r{i}", rec(i))
    s.close()
    s = open_store(tmp_path)
    a, n = s.load_done(exact=False)
    b, m = s.load_done(exact=True)
    assert n == m == len(a) == len(b) == 50
    assert all(f"r{i}" in a and f"r{i}" in b for i in range(50))
    assert "r50" not in a and "r50" not in b
    s.close()


def test_ids_with_odd_characters_round_trip(tmp_path: Path) -> None:
    odd = ['quote"d', "back\\slash", "new\nline", "ünïcode", "tab\t"]
    s = open_store(tmp_path)
    for i in odd:
        s.append_record(i, json.dumps({"id": i}, ensure_ascii=False).encode() + b"\n")
    s.close()
    s = open_store(tmp_path)
    assert sorted(s.iter_done_ids()) == sorted(odd)
    s.close()
