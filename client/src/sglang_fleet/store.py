"""The output directory: append-only shards, the failures file, and the index that says which ids
are done. Everything here is built so that a SIGKILL (or a power loss, with fsync on) at any instant
leaves a directory that the next start turns back into a consistent state without losing a written
record or keeping one twice.

Layout (``<tag>`` is the host shard, e.g. ``00000-of-00001``)::

    shards/part-<tag>-<seq>.jsonl.open   the open shard: records are appended, one write() each
    shards/part-<tag>-<seq>.jsonl        closed shards, immutable
    failures/failures-<tag>.jsonl        prompts that failed for good, append-only
    .state/index/<name>.ids              ids of a closed shard, one JSON string a line
    .state/index/<name>.meta.json        records, bytes, sha256 of a closed shard
    .state/index/<name>.uploaded         present once S3 holds a verified copy
    .state/job.json                      host shard and prompts file of this directory
    .state/lock                          flock held by the running client; holds its pid

Closing a shard: fsync it, write its ``.ids`` then ``.meta.json`` (each via a temporary file and a
rename), rename ``.jsonl.open`` to ``.jsonl``, fsync the directory. A start finds any ``.open`` file,
cuts a torn or garbled tail back to the last whole record, and closes it the same way, rewriting the
sidecars from what the file really holds. The done set is the union of the ``.ids`` files and the
failures file: ids only, never records.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sglang_fleet.fsutil import atomic_write_bytes, atomic_write_json, fsync_dir, write_all
from sglang_fleet.ids import DigestSet, IdContainer, ShardSpec

log = logging.getLogger(__name__)

FSYNC_POLICIES = ("always", "interval", "never")
LOCK_RETRY_S = 1.0  # how long a start waits out a lock probe before calling the directory busy
_NAME_RE = re.compile(r"^part-(?P<tag>\d{5}-of-\d{5})-(?P<seq>\d{6,})$")


class StoreError(Exception):
    pass


@dataclass
class ShardMeta:
    name: str
    records: int
    bytes: int
    sha256: str
    closed_at: float
    first_record_at: float | None = None

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> ShardMeta:
        return cls(
            name=obj["name"],
            records=int(obj["records"]),
            bytes=int(obj["bytes"]),
            sha256=obj["sha256"],
            closed_at=float(obj.get("closed_at", 0.0)),
            first_record_at=obj.get("first_record_at"),
        )


@dataclass
class RecoveryReport:
    recovered_shards: list[str] = field(default_factory=list)
    truncated_bytes: int = 0
    dropped_empty: int = 0
    stale_index: list[str] = field(default_factory=list)


@dataclass
class _OpenFile:
    """An append-only file and the lock that keeps an fsync thread off a closed descriptor."""

    path: Path
    fd: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    dirty: bool = False
    closed: bool = False

    def fsync(self) -> None:
        with self.lock:
            if not self.closed and self.dirty:
                self.dirty = False
                os.fsync(self.fd)

    def close(self, *, sync: bool) -> None:
        with self.lock:
            if not self.closed:
                if sync:
                    os.fsync(self.fd)
                os.close(self.fd)
                self.closed = True


@dataclass
class _OpenShard:
    name: str
    file: _OpenFile
    ids: list[str] = field(default_factory=list)
    first_record_at: float = 0.0


def shard_seq(name: str) -> int | None:
    m = _NAME_RE.match(name)
    return int(m.group("seq")) if m else None


def iter_ids_file(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="surrogatepass") as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not line:
                continue
            # Ids without escapes (nearly all) skip the JSON parser; that halves the start-up time.
            if "\\" not in line and line.startswith('"') and line.endswith('"'):
                yield line[1:-1]
            else:
                yield json.loads(line)


def encode_ids(ids: list[str]) -> bytes:
    return "".join(json.dumps(i, ensure_ascii=False) + "\n" for i in ids).encode("utf-8", "surrogatepass")


def scan_records(path: Path) -> tuple[list[str], int, int]:
    """Ids of the whole records at the head of a JSONL file, the byte length of that head, and the
    length of the file. A record is whole when its line ends in a newline and parses as an object with
    a string ``id``; everything from the first line that is not is a torn or garbled tail."""
    ids: list[str] = []
    good = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                obj = json.loads(raw)
            except ValueError:
                break
            if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
                break
            ids.append(obj["id"])
            good += len(raw)
        f.seek(0, os.SEEK_END)
        size = f.tell()
    return ids, good, size


class OutputStore:
    def __init__(
        self,
        root: Path,
        spec: ShardSpec,
        *,
        shard_records: int = 10_000,
        shard_seconds: float = 600.0,
        fsync: str = "interval",
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}")
        self.root = root
        self.spec = spec
        self.shard_records = shard_records
        self.shard_seconds = shard_seconds
        self.fsync_policy = fsync
        self.shards_dir = root / "shards"
        self.failures_dir = root / "failures"
        self.state_dir = root / ".state"
        self.index_dir = self.state_dir / "index"
        self.failures_path = self.failures_dir / f"failures-{spec.tag}.jsonl"
        self._lock_fd: int | None = None
        self._open: _OpenShard | None = None
        self._failures: _OpenFile | None = None
        self._next_seq = 0
        self._finalize_lock = threading.Lock()
        self.records_written = 0
        self.failures_written = 0

    # ----------------------------------------------------------------- opening and recovery
    def open(self, *, prompts: Path | None = None) -> RecoveryReport:
        for d in (self.root, self.shards_dir, self.failures_dir, self.state_dir, self.index_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._acquire_lock()
        self._check_job(prompts)
        report = self.recover()
        self._next_seq = self._max_seq() + 1
        return report

    def _acquire_lock(self) -> None:
        path = self.state_dir / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        # `sglang-fleet control` probes the lock with a shared lock held for microseconds; a
        # start that meets such a probe tries again rather than reporting the directory busy.
        deadline = time.monotonic() + LOCK_RETRY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EACCES) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    holder = read_lock_pid(self.root)
                    raise StoreError(
                        f"{self.root} is in use by another sglang-fleet process (pid {holder}); "
                        "two writers would duplicate work"
                    ) from None
                raise
        os.ftruncate(fd, 0)
        write_all(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _check_job(self, prompts: Path | None) -> None:
        path = self.state_dir / "job.json"
        job: dict[str, Any] = {}
        if path.exists():
            job = json.loads(path.read_text())
            if job.get("shard") != str(self.spec):
                raise StoreError(
                    f"{self.root} belongs to host shard {job.get('shard')}, not {self.spec}: "
                    "use a separate output directory for each shard"
                )
        else:
            stray = [p.name for p in self.shards_dir.iterdir() if p.name.startswith("part-")]
            if stray and any(f"-{self.spec.tag}-" not in n for n in stray):
                raise StoreError(f"{self.shards_dir} holds shards of another host shard: {stray[:3]}")
            job = {"version": 1, "shard": str(self.spec), "created_at": time.time()}
        if prompts is not None:
            job["prompts"] = str(prompts.resolve())
        atomic_write_json(path, job)

    def job_state(self) -> dict[str, Any]:
        job: dict[str, Any] = json.loads((self.state_dir / "job.json").read_text())
        return job

    def update_job_state(self, **values: Any) -> None:
        job = self.job_state()
        job.update(values)
        atomic_write_json(self.state_dir / "job.json", job)

    def recover(self) -> RecoveryReport:
        report = RecoveryReport()
        for path in sorted(self.shards_dir.glob("part-*.jsonl.open")):
            name = path.name[: -len(".jsonl.open")]
            ids, good, size = scan_records(path)
            if good < size:
                log.warning("%s: cut %d bytes of torn tail after %d whole records", path, size - good, len(ids))
                with open(path, "r+b") as f:
                    f.truncate(good)
                    os.fsync(f.fileno())
                report.truncated_bytes += size - good
            if not ids:
                path.unlink()
                for suffix in (".ids", ".meta.json"):
                    (self.index_dir / f"{name}{suffix}").unlink(missing_ok=True)
                report.dropped_empty += 1
                continue
            self._finalize_file(path, name, ids, first_record_at=None)
            report.recovered_shards.append(name)
        # Closed shards without sidecars (copied in by hand, or written by an older layout).
        for path in sorted(self.shards_dir.glob("part-*.jsonl")):
            name = path.stem
            if not (self.index_dir / f"{name}.meta.json").exists():
                ids, good, size = scan_records(path)
                if good < size:
                    raise StoreError(f"{path}: closed shard is damaged at byte {good}; move it aside")
                self._write_sidecars(path, name, ids, first_record_at=None)
        # An index entry whose data is neither here nor in S3 does not make its ids done.
        for meta in self.index_dir.glob("*.meta.json"):
            name = meta.name[: -len(".meta.json")]
            if not (self.shards_dir / f"{name}.jsonl").exists() and not self.is_uploaded(name):
                log.error("%s: shard data is gone and was never uploaded; its prompts will be redone", name)
                for suffix in (".ids", ".meta.json"):
                    (self.index_dir / f"{name}{suffix}").unlink(missing_ok=True)
                report.stale_index.append(name)
        if self.failures_path.exists():
            ids, good, size = scan_records(self.failures_path)
            if good < size:
                log.warning("%s: cut %d bytes of torn tail", self.failures_path, size - good)
                with open(self.failures_path, "r+b") as f:
                    f.truncate(good)
                    os.fsync(f.fileno())
                report.truncated_bytes += size - good
        fsync_dir(self.shards_dir)
        return report

    def _max_seq(self) -> int:
        seqs = [-1]
        for p in self.shards_dir.glob("part-*"):
            s = shard_seq(p.name.split(".", 1)[0])
            if s is not None:
                seqs.append(s)
        for p in self.index_dir.glob("part-*.meta.json"):
            s = shard_seq(p.name[: -len(".meta.json")])
            if s is not None:
                seqs.append(s)
        return max(seqs)

    def reserve_seq(self, seq: int) -> None:
        """Names seen elsewhere (S3) are never reused here."""
        self._next_seq = max(self._next_seq, seq + 1)

    # ----------------------------------------------------------------- the done set
    def iter_done_ids(self) -> Iterator[str]:
        for p in sorted(self.index_dir.glob("*.ids")):
            name = p.name[: -len(".ids")]
            if (self.index_dir / f"{name}.meta.json").exists():
                yield from iter_ids_file(p)
        yield from self.iter_failed_ids()

    def iter_failed_ids(self) -> Iterator[str]:
        if self.failures_path.exists():
            yield from scan_records(self.failures_path)[0]

    def load_done(self, *, exact: bool = False) -> tuple[IdContainer, int]:
        """The done set, and how many ids it was built from (more than its size means an id was
        recorded twice, which ``verify`` will name)."""
        count = 0

        def counted() -> Iterator[str]:
            nonlocal count
            for i in self.iter_done_ids():
                count += 1
                yield i

        done: IdContainer = set(counted()) if exact else DigestSet.from_ids(counted())
        if count != len(done):
            log.error(
                "%d ids are recorded more than once in %s; run `sglang-fleet verify`", count - len(done), self.root
            )
        return done, count

    def retire_failures(self) -> Path | None:
        """Move the failures file aside so its prompts are tried again (``--retry-failed``)."""
        if not self.failures_path.exists() or self.failures_path.stat().st_size == 0:
            return None
        dest = self.failures_dir / f"retried-{int(time.time())}-{self.failures_path.name}"
        os.replace(self.failures_path, dest)
        # An empty file, not none: the next S3 sync must overwrite the old failures object too.
        atomic_write_bytes(self.failures_path, b"")
        return dest

    # ----------------------------------------------------------------- writing
    def _new_shard(self) -> _OpenShard:
        name = f"part-{self.spec.tag}-{self._next_seq:06d}"
        self._next_seq += 1
        path = self.shards_dir / f"{name}.jsonl.open"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        fsync_dir(self.shards_dir)
        return _OpenShard(name, _OpenFile(path, fd), first_record_at=time.time())

    def append_record(self, prompt_id: str, line: bytes) -> None:
        """``line`` is one JSON object with ``id`` first, ending in a newline."""
        shard = self._open
        if shard is None:
            shard = self._open = self._new_shard()
        f = shard.file
        write_all(f.fd, line)
        shard.ids.append(prompt_id)
        self.records_written += 1
        if self.fsync_policy == "always":
            os.fsync(f.fd)
        else:
            f.dirty = True

    def append_failure(self, prompt_id: str, line: bytes) -> None:
        if self._failures is None:
            fd = os.open(self.failures_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._failures = _OpenFile(self.failures_path, fd)
            fsync_dir(self.failures_dir)
        write_all(self._failures.fd, line)
        self.failures_written += 1
        if self.fsync_policy == "always":
            os.fsync(self._failures.fd)
        else:
            self._failures.dirty = True

    @property
    def open_records(self) -> int:
        return len(self._open.ids) if self._open else 0

    def rotation_due(self, now: float | None = None) -> bool:
        shard = self._open
        if shard is None or not shard.ids:
            return False
        if len(shard.ids) >= self.shard_records:
            return True
        return (now or time.time()) - shard.first_record_at >= self.shard_seconds

    def detach_open_shard(self) -> _OpenShard | None:
        """Take the open shard out of service (the next record opens a new one); the caller finishes
        closing it with ``finalize``, usually in a worker thread."""
        shard, self._open = self._open, None
        return shard

    def finalize(self, shard: _OpenShard) -> ShardMeta | None:
        shard.file.close(sync=True)
        if not shard.ids:
            shard.file.path.unlink(missing_ok=True)
            return None
        return self._finalize_file(shard.file.path, shard.name, shard.ids, shard.first_record_at)

    def _finalize_file(self, path: Path, name: str, ids: list[str], first_record_at: float | None) -> ShardMeta:
        with self._finalize_lock:
            meta = self._write_sidecars(path, name, ids, first_record_at)
            os.replace(path, self.shards_dir / f"{name}.jsonl")
            fsync_dir(self.shards_dir)
            return meta

    def _write_sidecars(self, path: Path, name: str, ids: list[str], first_record_at: float | None) -> ShardMeta:
        sha = hashlib.sha256()
        size = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                sha.update(chunk)
                size += len(chunk)
            os.fsync(f.fileno())
        meta = ShardMeta(name, len(ids), size, sha.hexdigest(), time.time(), first_record_at)
        atomic_write_bytes(self.index_dir / f"{name}.ids", encode_ids(ids))
        atomic_write_json(self.index_dir / f"{name}.meta.json", asdict(meta))
        return meta

    def fsync_pending(self) -> None:
        """Group commit for the ``interval`` policy; safe to call from a worker thread."""
        shard = self._open
        if shard is not None:
            shard.file.fsync()
        if self._failures is not None:
            self._failures.fsync()

    def close(self) -> ShardMeta | None:
        meta = None
        shard = self.detach_open_shard()
        if shard is not None:
            meta = self.finalize(shard)
        if self._failures is not None:
            self._failures.close(sync=True)
            self._failures = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        return meta

    # ----------------------------------------------------------------- closed shards and uploads
    def closed_shards(self) -> list[ShardMeta]:
        out = []
        for p in sorted(self.index_dir.glob("*.meta.json")):
            with contextlib.suppress(ValueError, KeyError, OSError):
                out.append(ShardMeta.from_json(json.loads(p.read_text())))
        return out

    def shard_path(self, name: str) -> Path:
        return self.shards_dir / f"{name}.jsonl"

    def ids_path(self, name: str) -> Path:
        return self.index_dir / f"{name}.ids"

    def is_uploaded(self, name: str) -> bool:
        return (self.index_dir / f"{name}.uploaded").exists()

    def mark_uploaded(self, name: str, info: dict[str, Any]) -> None:
        atomic_write_json(self.index_dir / f"{name}.uploaded", info)

    def adopt_remote_shard(self, meta: ShardMeta, ids: list[str], info: dict[str, Any]) -> None:
        """Record a shard that only S3 holds (written by an earlier host of this shard), so that its
        ids count as done here."""
        atomic_write_bytes(self.index_dir / f"{meta.name}.ids", encode_ids(ids))
        self.mark_uploaded(meta.name, info)
        atomic_write_json(self.index_dir / f"{meta.name}.meta.json", asdict(meta))
        seq = shard_seq(meta.name)
        if seq is not None:
            self.reserve_seq(seq)


def read_lock_pid(root: Path) -> int | None:
    """The pid written in the lock file. It outlives the client that wrote it (a SIGKILL leaves
    it behind), so it says who holds the lock only while the lock is held: see running_client_pid."""
    try:
        text = (root / ".state" / "lock").read_text().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def running_client_pid(root: Path) -> int | None:
    """The pid of the client that holds the output directory's lock now, or None if none does.

    The lock file's pid alone is no evidence: after a crash it names whatever process has since
    been given that number, and signalling it would hit an unrelated program. The lock is probed
    with a shared lock, released at once (a client starting at that instant retries)."""
    try:
        fd = os.open(root / ".state" / "lock", os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return read_lock_pid(root)
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
