"""Streaming reader and validator for the prompts JSONL file.

One JSON object a line::

    {"id": "q-17", "messages": [{"role": "user", "content": "..."}]}
    {"id": 18, "prompt": "plain text"}
    {"messages": [...], "params": {"max_tokens": 256}}      # id = line number ("3")

Nothing here holds more than one line at a time, except the scan's 8-byte digests of the ids.
"""

from __future__ import annotations

import json
import os
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_fleet.ids import IdContainer, ShardSpec, duplicate_digests, id_digest, normalise_id


class PromptFileError(Exception):
    """A prompts file that cannot be used as it is; the message names the file and the line."""


@dataclass(slots=True)
class Prompt:
    id: str
    line: int
    data: dict[str, Any]

    @property
    def messages(self) -> list[dict[str, Any]] | None:
        return self.data.get("messages")

    @property
    def text(self) -> str | None:
        return self.data.get("prompt")

    @property
    def params(self) -> dict[str, Any]:
        return self.data.get("params") or {}


def parse_line(raw: bytes, line_no: int, path: Path) -> Prompt | None:
    """Parse and validate one line; ``None`` for a blank line."""
    if not raw.strip():
        return None
    where = f"{path}:{line_no}"
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise PromptFileError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(data).__name__}")
    messages = data.get("messages")
    text = data.get("prompt")
    if messages is None and text is None:
        raise PromptFileError(f"{where}: needs a 'messages' list or a 'prompt' string")
    if messages is not None and text is not None:
        raise PromptFileError(f"{where}: has both 'messages' and 'prompt'; keep one")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise PromptFileError(f"{where}: 'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise PromptFileError(f"{where}: messages[{i}] needs a 'role' string and a 'content'")
    elif not isinstance(text, str):
        raise PromptFileError(f"{where}: 'prompt' must be a string")
    params = data.get("params")
    if params is not None and not isinstance(params, dict):
        raise PromptFileError(f"{where}: 'params' must be an object")
    if "id" in data:
        try:
            pid = normalise_id(data["id"])
        except ValueError as e:
            raise PromptFileError(f"{where}: {e}") from None
    else:
        pid = str(line_no)
    return Prompt(pid, line_no, data)


_QUICK_ID = re.compile(rb'\{\s*"id"\s*:\s*(?:"((?:[^"\\\n]|\\.)*)"|(-?[0-9]+)\s*[,}])')


def quick_id(raw: bytes) -> str | None:
    """The id of a line whose object starts with ``"id"``, without parsing the rest of it (a prompt can
    be megabytes); ``None`` when that is not certain. Used to skip prompts already done on a restart,
    after the scan has validated every line."""
    m = _QUICK_ID.match(raw)
    if m is None or raw.count(b'"id"') != 1:
        return None
    if m.group(2) is not None:
        return str(int(m.group(2)))
    text = m.group(1)
    if b"\\" in text:
        try:
            return str(json.loads(b'"' + text + b'"'))
        except ValueError:
            return None
    try:
        return text.decode("utf-8") or None
    except UnicodeDecodeError:
        return None


def iter_pending(path: Path, spec: ShardSpec | None, done: IdContainer) -> Iterator[Prompt | None]:
    """Prompts of ``spec``'s shard that are not in ``done``, in file order. Yields ``None`` now and then
    for lines it skipped, so that a caller in an event loop can let other tasks run."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if line_no % 512 == 0:
                yield None
            pid = quick_id(raw)
            if pid is not None and (pid in done or (spec is not None and not spec.owns(pid))):
                continue
            p = parse_line(raw, line_no, path)
            if p is not None and (spec is None or spec.owns(p.id)) and p.id not in done:
                yield p


def iter_prompts(path: Path, spec: ShardSpec | None = None) -> Iterator[Prompt]:
    """Every valid prompt of ``spec``'s shard, in file order. Raises ``PromptFileError`` at the
    first bad line (the scan normally found it before any request was sent)."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            p = parse_line(raw, line_no, path)
            if p is not None and (spec is None or spec.owns(p.id)):
                yield p


@dataclass
class ScanResult:
    total: int  # prompts in this shard
    lines: int  # physical lines in the file
    exact_ids: bool  # digests of distinct ids collide: done sets must hold the ids themselves


def file_identity(path: Path) -> dict[str, Any]:
    st = os.stat(path)
    return {
        "path": str(path.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ino": st.st_ino,
    }


def scan_prompts(path: Path, spec: ShardSpec | None = None) -> ScanResult:
    """Validate the whole file and count this shard's prompts before any request is sent, so that a
    bad line or a repeated id stops the job at once instead of hours in."""
    if not path.is_file():
        raise PromptFileError(f"{path}: no such prompts file")
    digests = array("Q")
    lines = 0
    for p in _iter_all(path):
        lines = p.line
        if spec is None or spec.owns(p.id):
            digests.append(id_digest(p.id))
    dups = duplicate_digests(digests)
    exact = False
    if dups:
        seen: dict[str, int] = {}
        for p in _iter_all(path):
            if (spec is None or spec.owns(p.id)) and id_digest(p.id) in dups:
                if p.id in seen:
                    raise PromptFileError(
                        f"{path}:{p.line}: id {p.id!r} already used on line {seen[p.id]}; "
                        "ids must be unique (a repeated prompt needs its own id)"
                    )
                seen[p.id] = p.line
        exact = True  # distinct ids with equal digests
    return ScanResult(total=len(digests), lines=lines, exact_ids=exact)


def _iter_all(path: Path) -> Iterator[Prompt]:
    return iter_prompts(path, None)
