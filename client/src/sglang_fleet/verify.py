"""``sglang-fleet verify``: does every prompt id appear exactly once across the shards and the
failures files, locally or in S3?

Memory stays near 9 bytes a prompt: the prompts' id digests in one sorted array and a saturating
count beside each. Ids are turned back into text only for the ones reported.
"""

from __future__ import annotations

import json
import logging
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from json.decoder import scanstring  # type: ignore[attr-defined]
from pathlib import Path
from typing import Any

from sglang_fleet.ids import ShardSpec, id_digest
from sglang_fleet.prompts import iter_prompts
from sglang_fleet.s3sync import Layout, parse_s3_uri

log = logging.getLogger(__name__)


class VerifyError(Exception):
    pass


@dataclass
class Source:
    """Where ids come from: a shard, a failures file, or an index of a shard whose data is gone.

    A source of a running job's output directory is found where it is when it is read
    (``locate``): between the listing and the read the client may close an open shard (a rename),
    upload it and delete it (``delete_local``); what ``locate`` returns is then the shard under its
    new name or its index, already opened, or None when nothing of it is left to count."""

    name: str
    kind: str  # "shard" | "failures" | "index"
    lines: Iterable[bytes] | None = None
    ids: Iterable[str] | None = None
    locate: Callable[[], Source | None] | None = None

    def current(self) -> Source | None:
        return self.locate() if self.locate is not None else self


@dataclass
class Report:
    expected: int = 0
    seen_records: int = 0
    succeeded: int = 0
    failed: int = 0
    missing: list[str] = field(default_factory=list)
    doubled: dict[str, list[str]] = field(default_factory=dict)
    unexpected: list[tuple[str, str]] = field(default_factory=list)
    unexpected_count: int = 0
    missing_count: int = 0
    doubled_count: int = 0
    damaged: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sources: int = 0
    # The job is still running: ids not done yet are pending, not missing.
    in_progress: bool = False

    @property
    def exact(self) -> bool:
        """Every prompt id exactly once (in progress: every id done so far exactly once)."""
        missing = self.missing_count and not self.in_progress
        return not (missing or self.doubled_count or self.unexpected_count or self.damaged)

    def to_json(self) -> dict[str, Any]:
        return {
            "exact": self.exact,
            "in_progress": self.in_progress,
            "expected": self.expected,
            "records": self.seen_records,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "missing_count": self.missing_count,
            "doubled_count": self.doubled_count,
            "unexpected_count": self.unexpected_count,
            "missing": self.missing,
            "doubled": self.doubled,
            "unexpected": [{"id": i, "where": w} for i, w in self.unexpected],
            "damaged": self.damaged,
            "notes": self.notes,
            "sources": self.sources,
        }


def fast_id(raw: bytes) -> str:
    """The ``id`` of one record line. Records written by the client start with ``{"id":"``, which
    lets the id be read without parsing a record that may be megabytes long."""
    if raw.startswith(b'{"id":"'):
        head = raw[7:1031].decode("utf-8", "ignore")
        try:
            value, _unused = scanstring(head, 0)
            return str(value)
        except ValueError:
            pass
    obj = json.loads(raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
        raise ValueError("record has no string id")
    return str(obj["id"])


def split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Lines with their newline kept (a last line without one is a torn record)."""
    rest = b""
    for chunk in chunks:
        data = rest + chunk
        lines = data.split(b"\n")
        rest = lines.pop()
        for line in lines:
            yield line + b"\n"
    if rest:
        yield rest


class Verifier:
    def __init__(
        self, prompts: Path, spec: ShardSpec | None = None, *, show: int = 20, in_progress: bool = False
    ) -> None:
        self.prompts = prompts
        self.spec = spec
        self.show = show
        digests = array("Q")
        for p in iter_prompts(prompts, spec):
            digests.append(id_digest(p.id))
        ordered = sorted(digests)
        self._exact: dict[str, int] | None = None
        if any(ordered[i] == ordered[i - 1] for i in range(1, len(ordered))):
            # A repeated id (or a digest collision): count by the ids themselves.
            self._exact = {}
            for p in iter_prompts(prompts, spec):
                if p.id in self._exact:
                    raise VerifyError(f"{prompts}:{p.line}: id {p.id!r} appears twice in the prompts file")
                self._exact[p.id] = 0
            self._digests = array("Q")
        else:
            self._digests = array("Q", ordered)
        del ordered
        self._counts = bytearray(len(digests))
        self.report = Report(expected=len(digests), in_progress=in_progress)
        self._being_written = 0

    def _bump(self, pid: str, where: str) -> None:
        self.report.seen_records += 1
        if self._exact is not None:
            if pid in self._exact:
                self._exact[pid] = min(255, self._exact[pid] + 1)
                return
        else:
            d = id_digest(pid)
            i = bisect_left(self._digests, d)
            if i < len(self._digests) and self._digests[i] == d:
                if self._counts[i] < 255:
                    self._counts[i] += 1
                return
        self.report.unexpected_count += 1
        if len(self.report.unexpected) < self.show:
            self.report.unexpected.append((pid, where))

    def add(self, listed: Source) -> None:
        self.report.sources += 1
        source = listed.current()
        if source is None:
            return
        n = 0
        if source.ids is not None:
            for pid in source.ids:
                n += 1
                self._bump(pid, source.name)
        else:
            assert source.lines is not None
            for line_no, raw in enumerate(source.lines, start=1):
                if not raw.strip():
                    continue
                where = f"{source.name}:{line_no}"
                if not raw.endswith(b"\n"):
                    if self.report.in_progress and source.name.endswith(".jsonl.open"):
                        # The running client's record being written as the shard was read.
                        self._being_written += 1
                        continue
                    self.report.damaged.append(f"{where}: torn last line ({len(raw)} bytes)")
                    continue
                try:
                    pid = fast_id(raw)
                except ValueError as e:
                    self.report.damaged.append(f"{where}: unreadable record ({e})")
                    continue
                n += 1
                self._bump(pid, where)
        if source.kind == "failures":
            self.report.failed += n
        else:
            self.report.succeeded += n

    def finish(self, sources: Iterable[Source] | None = None) -> Report:
        """Name the missing and doubled ids; ``sources`` (the same ones again) lets the report say
        where each doubled id is."""
        r = self.report
        if self._being_written:
            r.notes.append(f"{self._being_written} record(s) being written in an open shard not counted yet")
        bad: dict[str, int] = {}
        if self._exact is not None:
            bad = {i: c for i, c in self._exact.items() if c != 1}
        else:
            bad_digests = {self._digests[i]: c for i, c in enumerate(self._counts) if c != 1}
            if bad_digests:
                for p in iter_prompts(self.prompts, self.spec):
                    c = bad_digests.get(id_digest(p.id))
                    if c is not None:
                        bad[p.id] = c
        r.missing_count = sum(1 for c in bad.values() if c == 0)
        r.doubled_count = sum(1 for c in bad.values() if c > 1)
        r.missing = sorted((i for i, c in bad.items() if c == 0), key=_natural)[: self.show]
        doubled = sorted((i for i, c in bad.items() if c > 1), key=_natural)[: self.show]
        r.doubled = {i: [] for i in doubled}
        if doubled and sources is not None:
            wanted = set(doubled)
            for listed in sources:
                s = listed.current()
                if s is None:
                    continue
                if s.ids is not None:
                    for pid in s.ids:
                        if pid in wanted:
                            r.doubled[pid].append(s.name)
                elif s.lines is not None:
                    for line_no, raw in enumerate(s.lines, start=1):
                        try:
                            pid = fast_id(raw)
                        except ValueError:
                            continue
                        if pid in wanted:
                            r.doubled[pid].append(f"{s.name}:{line_no}")
        return r


def _natural(s: str) -> tuple[int, int | str]:
    return (0, int(s)) if s.isdigit() else (1, s)


# ---------------------------------------------------------------------- sources
def _opened_lines(f: Any) -> Iterator[bytes]:
    with f:
        yield from f


def _opened_ids(f: Any) -> Iterator[str]:
    with f:
        for raw in f:
            line = raw.rstrip("\n")
            if line:
                yield json.loads(line)


def _open_or_none(path: Path, *, text: bool = False) -> Any:
    """The file opened, or None if it is not there (any more): a running client renames and
    deletes files; an open handle reads the file whole whatever happens to its name after."""
    try:
        if text:
            return open(path, encoding="utf-8", errors="surrogatepass")
        return open(path, "rb")
    except FileNotFoundError:
        return None


def shard_locator(shards_dir: Path, index_dir: Path, name: str) -> Callable[[], Source | None]:
    """Where shard ``name`` is now: open, closed, or deleted after its upload (its ids from the
    index). The order follows the client's: the index is written before the open shard is renamed,
    and the upload is recorded before the local copy is deleted, so a shard is always in one of the
    three; None only when it is gone without an upload (an empty open shard the client removed)."""

    def locate() -> Source | None:
        for path in (shards_dir / f"{name}.jsonl.open", shards_dir / f"{name}.jsonl"):
            f = _open_or_none(path)
            if f is not None:
                return Source(str(path), "shard", lines=_opened_lines(f))
        ids = index_dir / f"{name}.ids"
        if (index_dir / f"{name}.uploaded").exists():
            f = _open_or_none(ids, text=True)
            if f is not None:
                return Source(str(ids), "index", ids=_opened_ids(f))
        return None

    return locate


def file_locator(path: Path, kind: str) -> Callable[[], Source | None]:
    def locate() -> Source | None:
        f = _open_or_none(path)
        return None if f is None else Source(str(path), kind, lines=_opened_lines(f))

    return locate


def _shard_name(file_name: str) -> str | None:
    for suffix in (".jsonl.open", ".jsonl"):
        if file_name.startswith("part-") and file_name.endswith(suffix):
            return file_name[: -len(suffix)]
    return None


def local_sources(root: Path, report_notes: list[str]) -> list[Source]:
    """One source per shard name (a shard renamed while the directory was listed is listed once),
    each located again when it is read (:func:`shard_locator`)."""
    if not root.is_dir():
        raise VerifyError(f"{root}: no such output directory")
    shards_dir = root / "shards"
    index_dir = root / ".state" / "index"
    listing = sorted(p.name for p in shards_dir.glob("part-*.jsonl*"))
    opened = {n for n in (_shard_name(f) for f in listing if f.endswith(".jsonl.open")) if n}
    present = {n for n in (_shard_name(f) for f in listing) if n}
    gone = set()
    for meta in index_dir.glob("*.meta.json"):
        name = meta.name[: -len(".meta.json")]
        if name not in present and (index_dir / f"{name}.uploaded").exists():
            gone.add(name)
    sources = [
        Source(
            str(shards_dir / (f"{name}.jsonl.open" if name in opened else f"{name}.jsonl")),
            "shard",
            locate=shard_locator(shards_dir, index_dir, name),
        )
        for name in sorted(present | gone)
    ]
    if opened:
        report_notes.append(
            f"{len(opened)} open shard(s) counted: a client is running, or was killed and not restarted"
        )
    if gone:
        report_notes.append(
            f"{len(gone)} shard(s) were deleted here after upload; their ids come from the index "
            "(verify --s3 reads the data itself)"
        )
    for p in sorted((root / "failures").glob("failures-*.jsonl")):
        sources.append(Source(str(p), "failures", locate=file_locator(p, "failures")))
    return sources


class _S3Lines:
    def __init__(self, client: Any, bucket: str, key: str) -> None:
        self.client, self.bucket, self.key = client, bucket, key

    def __iter__(self) -> Iterator[bytes]:
        body = self.client.get_object(Bucket=self.bucket, Key=self.key)["Body"]
        return split_lines(body.iter_chunks(1 << 20))


class _S3Ids:
    def __init__(self, client: Any, bucket: str, key: str) -> None:
        self.client, self.bucket, self.key = client, bucket, key

    def __iter__(self) -> Iterator[str]:
        body = self.client.get_object(Bucket=self.bucket, Key=self.key)["Body"].read()
        for line in body.decode("utf-8", "surrogatepass").splitlines():
            if line:
                yield json.loads(line)


def s3_sources(client: Any, uri: str, notes: list[str], *, index_only: bool = False) -> list[Source]:
    bucket, prefix = parse_s3_uri(uri)
    layout = Layout(bucket, prefix)
    paginator = client.get_paginator("list_objects_v2")

    def listing(rel: str) -> dict[str, dict[str, Any]]:
        out = {}
        for page in paginator.paginate(Bucket=bucket, Prefix=layout.dir_prefix(rel)):
            for obj in page.get("Contents", []) or []:
                out[obj["Key"]] = obj
        return out

    shards = {k: v for k, v in listing("shards").items() if k.endswith(".jsonl")}
    failures = {k: v for k, v in listing("failures").items() if k.endswith(".jsonl")}
    manifests = {k: v for k, v in listing("manifests").items() if k.endswith(".json")}
    if not shards and not failures:
        notes.append(f"no shards under {uri}")
    listed: set[str] = set()
    for key in sorted(manifests):
        try:
            m = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        except ValueError:
            notes.append(f"{key}: manifest is not valid JSON")
            continue
        for s in m.get("shards", []):
            listed.add(s["key"])
            obj = shards.get(s["key"])
            if obj is None:
                notes.append(f"{key}: lists {s['key']}, which is not in the bucket")
            elif int(obj["Size"]) != int(s["bytes"]):
                notes.append(f"{key}: {s['key']} is {obj['Size']} bytes in the bucket, {s['bytes']} in the manifest")
    unlisted = sorted(set(shards) - listed)
    if unlisted:
        notes.append(f"{len(unlisted)} shard(s) not yet in a manifest (uploaded after its last update): {unlisted[:3]}")
    sources: list[Source] = []
    for key in sorted(shards):
        name = key.rsplit("/", 1)[-1][: -len(".jsonl")]
        if index_only:
            sources.append(
                Source(
                    f"s3://{bucket}/{layout.ids_key(name)}", "index", ids=_S3Ids(client, bucket, layout.ids_key(name))
                )
            )
        else:
            sources.append(Source(f"s3://{bucket}/{key}", "shard", lines=_S3Lines(client, bucket, key)))
    for key in sorted(failures):
        sources.append(Source(f"s3://{bucket}/{key}", "failures", lines=_S3Lines(client, bucket, key)))
    return sources


def run_verify(
    prompts: Path, sources: list[Source], spec: ShardSpec | None, show: int, *, in_progress: bool = False
) -> Report:
    v = Verifier(prompts, spec, show=show, in_progress=in_progress)
    for s in sources:
        v.add(s)
    return v.finish(sources)


def format_report(r: Report) -> str:
    lines = [
        f"prompts: {r.expected}   records: {r.seen_records} ({r.succeeded} completed, {r.failed} failed) "
        f"in {r.sources} file(s)",
    ]
    if r.exact and r.in_progress:
        lines.append(
            f"OK so far: every prompt id done appears exactly once; {r.missing_count} not done yet (job in progress)"
        )
    elif r.exact:
        lines.append("OK: every prompt id appears exactly once")
    else:
        if r.missing_count and r.in_progress:
            lines.append(f"not done yet: {r.missing_count} id(s) (job in progress)")
        elif r.missing_count:
            lines.append(
                f"MISSING: {r.missing_count} id(s) in no shard and no failures file: "
                + ", ".join(r.missing)
                + (" ..." if r.missing_count > len(r.missing) else "")
            )
        if r.doubled_count:
            lines.append(f"DOUBLED: {r.doubled_count} id(s) appear more than once:")
            for i, where in r.doubled.items():
                lines.append(f"  {i}: " + (", ".join(where) if where else "(locations not listed)"))
            if r.doubled_count > len(r.doubled):
                lines.append("  ...")
        if r.unexpected_count:
            lines.append(
                f"UNEXPECTED: {r.unexpected_count} record(s) with ids not in the prompts file: "
                + ", ".join(f"{i} ({w})" for i, w in r.unexpected)
            )
        for d in r.damaged[:20]:
            lines.append(f"DAMAGED: {d}")
    for n in r.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)
