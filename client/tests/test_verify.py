from __future__ import annotations

import json
from pathlib import Path

from fleetkit import cli, write_prompts

from sglang_fleet.verify import fast_id, split_lines


def _shard(out: Path, name: str, ids: list[str], *, suffix: str = ".jsonl", tail: bytes = b"") -> None:
    d = out / "shards"
    d.mkdir(parents=True, exist_ok=True)
    data = b"".join(json.dumps({"id": i, "output": "o"}, separators=(",", ":")).encode() + b"\n" for i in ids)
    (d / f"{name}{suffix}").write_bytes(data + tail)


def _failures(out: Path, ids: list[str]) -> None:
    d = out / "failures"
    d.mkdir(parents=True, exist_ok=True)
    (d / "failures-00000-of-00001.jsonl").write_text("".join(json.dumps({"id": i, "error": "x"}) + "\n" for i in ids))


def test_exact(tmp_path: Path) -> None:
    p = write_prompts(tmp_path / "p.jsonl", 10)
    out = tmp_path / "out"
    _shard(out, "part-00000-of-00001-000000", [f"q{i}" for i in range(6)])
    _shard(out, "part-00000-of-00001-000001", [f"q{i}" for i in range(6, 9)])
    _failures(out, ["q9"])
    r = cli("verify", "--prompts", str(p), "--output", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: every prompt id appears exactly once" in r.stdout
    assert "9 completed, 1 failed" in r.stdout


def test_missing_doubled_unexpected_and_torn(tmp_path: Path) -> None:
    p = write_prompts(tmp_path / "p.jsonl", 10)
    out = tmp_path / "out"
    _shard(out, "part-00000-of-00001-000000", ["q0", "q1", "q2", "q3"])
    _shard(out, "part-00000-of-00001-000001", ["q3", "q4", "zz"], tail=b'{"id":"q5","outp')
    _failures(out, ["q4", "q6", "q7", "q8"])
    r = cli("verify", "--prompts", str(p), "--output", str(out), "--json")
    assert r.returncode == 1
    rep = json.loads(r.stdout)
    assert rep["exact"] is False
    assert rep["missing"] == ["q5", "q9"]
    assert set(rep["doubled"]) == {"q3", "q4"}
    assert len(rep["doubled"]["q3"]) == 2 and any("failures" in w for w in rep["doubled"]["q4"])
    assert rep["unexpected"][0]["id"] == "zz"
    assert rep["damaged"] and "torn last line" in rep["damaged"][0]
    text = cli("verify", "--prompts", str(p), "--output", str(out)).stdout
    assert "MISSING: 2 id(s)" in text and "q5, q9" in text
    assert "DOUBLED: 2 id(s)" in text
    assert "part-00000-of-00001-000000.jsonl:4" in text  # where q3 is, by file and line


def test_in_progress_pending_ids_pass_but_doubles_still_fail(tmp_path: Path) -> None:
    """A running job: ids not done yet and the open shard's record being written are fine; a doubled
    id is not. Without --in-progress the same output is not exact."""
    p = write_prompts(tmp_path / "p.jsonl", 10)
    out = tmp_path / "out"
    _shard(out, "part-00000-of-00001-000000", ["q0", "q1", "q2"])
    _shard(out, "part-00000-of-00001-000001", ["q3", "q4"], suffix=".jsonl.open", tail=b'{"id":"q5","outp')
    r = cli("verify", "--prompts", str(p), "--output", str(out), "--in-progress")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK so far: every prompt id done appears exactly once; 5 not done yet" in r.stdout
    assert "1 record(s) being written in an open shard not counted yet" in r.stdout
    rep = json.loads(cli("verify", "--prompts", str(p), "--output", str(out), "--in-progress", "--json").stdout)
    assert rep["exact"] is True and rep["in_progress"] is True and rep["missing_count"] == 5
    assert cli("verify", "--prompts", str(p), "--output", str(out)).returncode == 1
    # A torn line in a closed shard is damage, in progress or not.
    _shard(out, "part-00000-of-00001-000002", ["q6"], tail=b'{"id":"q7"')
    assert cli("verify", "--prompts", str(p), "--output", str(out), "--in-progress").returncode == 1
    (out / "shards" / "part-00000-of-00001-000002.jsonl").unlink()
    _shard(out, "part-00000-of-00001-000003", ["q1"])
    r = cli("verify", "--prompts", str(p), "--output", str(out), "--in-progress")
    assert r.returncode == 1 and "DOUBLED: 1 id(s)" in r.stdout and "not done yet: 5 id(s)" in r.stdout


def test_missing_output_directory(tmp_path: Path) -> None:
    p = write_prompts(tmp_path / "p.jsonl", 30)
    r = cli("verify", "--prompts", str(p), "--output", str(tmp_path / "nope"))
    assert r.returncode == 2 and "no such output directory" in r.stderr


def test_fast_id_agrees_with_json() -> None:
    for pid in ["plain", 'q"uote', "back\\slash", "ünï", "x" * 3000]:
        line = json.dumps({"id": pid, "output": "y"}, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
        assert fast_id(line) == pid
    assert fast_id(b'{"output": "y", "id": "late"}\n') == "late"


def test_split_lines_keeps_newlines_and_torn_tail() -> None:
    assert list(split_lines([b"a\nb", b"c\n", b"d"])) == [b"a\n", b"bc\n", b"d"]
