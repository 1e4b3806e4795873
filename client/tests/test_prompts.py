from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_fleet.ids import ShardSpec
from sglang_fleet.prompts import PromptFileError, iter_pending, iter_prompts, parse_line, quick_id, scan_prompts


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "x"', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"id": "a"}', "needs a 'messages' list or a 'prompt' string"),
        ('{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}', "has both"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"content": "y"}]}', "messages[0] needs a 'role'"),
        ('{"prompt": 5}', "'prompt' must be a string"),
        ('{"prompt": "x", "id": 1.5}', "id must be a string or an integer"),
        ('{"prompt": "x", "params": [1]}', "'params' must be an object"),
        (b"\xff\xfe".decode("latin-1"), "not valid JSON"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    p = _write(tmp_path / "p.jsonl", ['{"prompt": "fine"}', line])
    with pytest.raises(PromptFileError) as e:
        scan_prompts(p)
    assert f"{p}:2:" in str(e.value)
    assert message in str(e.value)


def test_ids_default_to_line_numbers_and_blank_lines_count(tmp_path: Path) -> None:
    p = _write(tmp_path / "p.jsonl", ['{"prompt": "a"}', "", '{"id": 9, "prompt": "b"}', '{"prompt": "c"}'])
    assert [(x.id, x.line) for x in iter_prompts(p)] == [("1", 1), ("9", 3), ("4", 4)]
    assert scan_prompts(p).total == 3


def test_repeated_ids_are_refused_but_repeated_text_is_not(tmp_path: Path) -> None:
    same = [json.dumps({"id": f"r{i}", "prompt": "identical"}) for i in range(5)]
    p = _write(tmp_path / "ok.jsonl", same)
    assert scan_prompts(p).total == 5
    p = _write(tmp_path / "dup.jsonl", [*same, json.dumps({"id": "r2", "prompt": "other"})])
    with pytest.raises(PromptFileError, match=r"dup.jsonl:6: id 'r2' already used on line 3"):
        scan_prompts(p)


def test_int_and_string_ids_collide(tmp_path: Path) -> None:
    p = _write(tmp_path / "p.jsonl", ['{"id": 7, "prompt": "a"}', '{"id": "7", "prompt": "b"}'])
    with pytest.raises(PromptFileError, match="already used on line 1"):
        scan_prompts(p)


def test_shard_scan_counts_only_its_share(tmp_path: Path) -> None:
    p = _write(tmp_path / "p.jsonl", [json.dumps({"id": f"x{i}", "prompt": "t"}) for i in range(300)])
    totals = [scan_prompts(p, ShardSpec(i, 3)).total for i in range(3)]
    assert sum(totals) == 300
    seen = [x.id for i in range(3) for x in iter_prompts(p, ShardSpec(i, 3))]
    assert sorted(seen) == sorted(f"x{i}" for i in range(300))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PromptFileError, match="no such prompts file"):
        scan_prompts(tmp_path / "nope.jsonl")


def test_parse_line_keeps_params(tmp_path: Path) -> None:
    p = parse_line(b'{"messages": [{"role": "user", "content": "hi"}], "params": {"max_tokens": 3}}', 4, tmp_path)
    assert p is not None
    assert p.id == "4"
    assert p.params == {"max_tokens": 3}
    assert p.messages == [{"role": "user", "content": "hi"}]
    assert parse_line(b"  \n", 5, tmp_path) is None


def test_quick_id_agrees_with_the_parser_or_abstains(tmp_path: Path) -> None:
    lines = [
        '{"id":"abc","prompt":"x"}',
        '{"id": 17, "prompt": "x"}',
        '{ "id" : "q\\"x", "prompt": "y"}',
        '{"prompt": "x", "id": "late"}',
        '{"id": "a", "params": {"id": "nested"}, "prompt": "x"}',
        '{"id": -5, "prompt": "x"}',
        '{"id": "\\u00e9t\\u00e9", "prompt": "x"}',
        '{"id": "é", "prompt": "x"}',
        '{"prompt": "no id"}',
    ]
    for n, line in enumerate(lines, start=1):
        raw = line.encode() + b"\n"
        q = quick_id(raw)
        p = parse_line(raw, n, tmp_path)
        assert p is not None
        assert q is None or q == p.id, line
    assert quick_id(b'{"id":"abc","prompt":"x"}\n') == "abc"
    assert quick_id(b'{"prompt":"x","id":"a"}') is None


def test_iter_pending_is_the_filtered_file(tmp_path: Path) -> None:
    rows = []
    for i in range(400):
        if i % 5 == 0:
            rows.append(json.dumps({"prompt": f"p{i}"}))  # id = line number
        elif i % 5 == 1:
            rows.append(json.dumps({"messages": [{"role": "user", "content": "x"}], "id": f"late{i}"}))
        elif i % 5 == 2:
            rows.append(json.dumps({"id": i, "prompt": "int id"}))
        else:
            rows.append(json.dumps({"id": f"s{i}", "prompt": "x"}))
    p = _write(tmp_path / "p.jsonl", rows)
    every = [x.id for x in iter_prompts(p)]
    done = set(every[::3])
    for spec in (None, ShardSpec(0, 2), ShardSpec(1, 2)):
        want = [x.id for x in iter_prompts(p, spec) if x.id not in done]
        got = [x.id for x in iter_pending(p, spec, done) if x is not None]
        assert got == want
