# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""One retune (or deploy) per host at a time: a lease kept in a file on the host.

A run takes the lease before it touches anything on the host and renews it with every
operation (and every few seconds while a long one runs); the lease names the run that holds it
(run id, controller host, user, controller PID, start time). Another run that finds a live lease
fails at once, naming the holder. A lease left by a run that died is taken over: when its renewal
is older than its TTL, or when the controller says the holder's process is gone (see
``plugins/action/host_lock.py``). The file lives under /run, so a reboot frees it too.

The file is never removed, only emptied: every reader and writer holds ``flock`` on that one
inode, so a read-decide-write is atomic and an unlink cannot split the lock in two.

While a run's operation works on the host (``guard``: a retune phase, a write of the server
role), the lease names its process (``busy``). A lease whose run is gone is not taken over while
that process still runs: a run that lost its host mid-phase (the host stopped answering) leaves
the phase running there once the host is back, and a rerun must not act beside it.

Standard library only: modules import it on the host.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

LOCK_PATH_DEFAULT = "/run/sglang-fleet/host.lock"
# How long to wait for another process's read-decide-write (a few milliseconds in practice).
FLOCK_TIMEOUT = 10.0


class LockError(Exception):
    """The lease is held by another live run, or was lost; ``holder`` says by whom."""

    def __init__(self, msg: str, holder: dict[str, Any] | None = None):
        self.holder = holder
        super().__init__(msg)


def describe(holder: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    age = now - float(holder.get("renewed_at") or 0)
    return (
        f"run {holder.get('run_id')} (user {holder.get('user')} on controller {holder.get('controller')}, "
        f"PID {holder.get('controller_pid')}, started {holder.get('started_at')}, "
        f"last renewed {age:.0f}s ago, TTL {holder.get('ttl_s')}s)"
    )


def is_stale(holder: dict[str, Any], now: float) -> bool:
    return now > float(holder.get("renewed_at") or 0) + float(holder.get("ttl_s") or 0)


def _starttime(pid: int) -> str | None:
    """Clock ticks since boot at which ``pid`` started (tells a reused PID apart), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            raw = handle.read()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()[19]


def still_busy(holder: dict[str, Any]) -> dict[str, Any] | None:
    """The holder's operation that still runs on this host (its process alive, the same one), or
    None."""
    busy = holder.get("busy")
    if not isinstance(busy, dict) or not isinstance(busy.get("pid"), int):
        return None
    return busy if _starttime(busy["pid"]) == busy.get("starttime") else None


def _refuse_while_busy(holder: dict[str, Any], now: float) -> None:
    busy = still_busy(holder)
    if busy:
        raise LockError(
            f"the host lock's run is gone ({describe(holder, now)}), but its {busy.get('what')} still runs on this "
            f"host (PID {busy['pid']}, for {now - float(busy.get('since') or now):.0f}s): it ends within its own "
            "deadline; try again once it has",
            holder,
        )


@contextlib.contextmanager
def _locked_file(path: str) -> Iterator[Any]:
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    handle = os.fdopen(fd, "r+", encoding="utf-8")
    try:
        deadline = time.monotonic() + FLOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockError(f"could not get flock on {path} within {FLOCK_TIMEOUT:.0f}s") from None
                time.sleep(0.05)
        yield handle
    finally:
        handle.close()  # releases the flock


def _read(handle: Any) -> dict[str, Any] | None:
    handle.seek(0)
    text = handle.read().strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        # Unreadable: treat as held by an unknown run that expires like any other.
        return {"run_id": "(unreadable lock file)", "renewed_at": os.fstat(handle.fileno()).st_mtime, "ttl_s": 0}
    return value if isinstance(value, dict) else None


def _write(handle: Any, record: dict[str, Any] | None) -> None:
    handle.seek(0)
    handle.truncate()
    if record is not None:
        handle.write(json.dumps(record, sort_keys=True) + "\n")
    handle.flush()
    os.fsync(handle.fileno())


def read(path: str = LOCK_PATH_DEFAULT) -> dict[str, Any] | None:
    """The current holder, or None (never creates anything)."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read().strip()
    except FileNotFoundError:
        return None
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return {"run_id": "(unreadable lock file)"}
    return value if isinstance(value, dict) else None


def acquire(
    identity: dict[str, Any], path: str = LOCK_PATH_DEFAULT, take_over: str | None = None, now: float | None = None
) -> dict[str, Any]:
    """Take the lease for ``identity`` (run_id, controller, user, controller_pid, started_at,
    ttl_s). Returns {"lock": record, "took_over": previous holder or None, "renewed": bool}.
    ``take_over`` names a holder's run id that the caller has proven dead: only that run's
    lease is taken before its TTL ends."""
    now = time.time() if now is None else now
    with _locked_file(path) as handle:
        holder = _read(handle)
        took_over = None
        if holder and holder.get("run_id") != identity["run_id"]:
            if not (is_stale(holder, now) or (take_over and holder.get("run_id") == take_over)):
                raise LockError(f"the host is locked by {describe(holder, now)}", holder)
            _refuse_while_busy(holder, now)
            took_over = holder
        same_run = holder is not None and took_over is None
        record = dict(identity, renewed_at=now, acquired_at=(holder or {}).get("acquired_at", now) if same_run else now)
        if took_over is not None:
            record["took_over"] = {k: took_over.get(k) for k in ("run_id", "controller", "user", "started_at")}
        _write(handle, record)
    return {"lock": record, "took_over": took_over, "renewed": same_run}


def renew(run_id: str, path: str = LOCK_PATH_DEFAULT, now: float | None = None) -> dict[str, Any]:
    """Prove the lease is still ``run_id``'s and extend it; LockError if it is not."""
    now = time.time() if now is None else now
    with _locked_file(path) as handle:
        holder = _read(handle)
        if not holder or holder.get("run_id") != run_id:
            who = describe(holder, now) if holder else "nobody"
            raise LockError(f"this run ({run_id}) no longer holds the host lock: it is held by {who}", holder)
        holder["renewed_at"] = now
        _write(handle, holder)
    return holder


def ensure_free_or_mine(run_id: str | None, path: str = LOCK_PATH_DEFAULT, now: float | None = None) -> None:
    """Before a write outside a locked run (the server role run on its own): refuse while
    another live run holds the host; with a run id, renew that run's lease."""
    if run_id:
        renew(run_id, path, now)
        return
    now = time.time() if now is None else now
    holder = read(path)
    if holder and not is_stale(holder, now):
        raise LockError(f"the host is locked by {describe(holder, now)}", holder)
    if holder:
        _refuse_while_busy(holder, now)


def release(run_id: str, path: str = LOCK_PATH_DEFAULT) -> bool:
    """Empty the lock file if ``run_id`` holds it; True if it did."""
    if not os.path.exists(path):
        return False
    with _locked_file(path) as handle:
        holder = _read(handle)
        if not holder or holder.get("run_id") != run_id:
            return False
        _write(handle, None)
    return True


class Renewer:
    """Renews ``run_id``'s lease every ``interval`` seconds while a long operation runs, so a
    start that takes an hour never looks like a dead run. A lost lease is recorded, not raised:
    the operation under way is finished (stopping half-way would be worse)."""

    def __init__(self, run_id: str | None, path: str = LOCK_PATH_DEFAULT, interval: float = 60.0):
        self.run_id = run_id
        self.path = path
        self.interval = interval
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Renewer:
        if self.run_id:
            renew(self.run_id, self.path)  # raises before anything is touched
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                renew(str(self.run_id), self.path)
            except LockError as exc:
                self.lost = str(exc)
                return

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _mark_busy(run_id: str, what: str, path: str, clear: bool = False) -> None:
    """Name this process in ``run_id``'s lease as working on the host (or no longer)."""
    pid = os.getpid()
    with _locked_file(path) as handle:
        holder = _read(handle)
        if not holder or holder.get("run_id") != run_id:
            return  # taken over meanwhile: nothing of ours to mark
        if clear:
            if (holder.get("busy") or {}).get("pid") != pid:
                return
            holder.pop("busy")
        else:
            holder["busy"] = {"pid": pid, "starttime": _starttime(pid), "what": what, "since": time.time()}
        _write(handle, holder)


@contextlib.contextmanager
def guard(
    run_id: str | None, path: str = LOCK_PATH_DEFAULT, interval: float = 60.0, what: str = "write"
) -> Iterator[Renewer]:
    """Around a write to the host: with a run id, prove the lease is that run's, keep it renewed
    and name this process in it (``what`` it does) meanwhile; without one (a module run on its
    own), refuse while another live run holds the host. Raises LockError before the body runs,
    never during it."""
    if not run_id:
        ensure_free_or_mine(None, path)
    with Renewer(run_id, path, interval) as renewer:
        if run_id:
            _mark_busy(run_id, what, path)
        try:
            yield renewer
        finally:
            if run_id:
                with contextlib.suppress(LockError):  # a mark left behind names a process soon gone
                    _mark_busy(run_id, what, path, clear=True)
