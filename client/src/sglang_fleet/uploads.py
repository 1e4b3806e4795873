"""Closing shards and uploading them: a shard that is due is closed in a worker thread, and each
closed shard wakes the S3 loop, which uploads in a daemon thread so that S3 being slow or down never
stops generation. Also reads what S3 already holds before a run starts, and the last upload at
the end of a run."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sglang_fleet.config import GenerateConfig
from sglang_fleet.control import EXIT_OK, FatalError, RunControl
from sglang_fleet.s3sync import S3Sync, describe_error
from sglang_fleet.store import OutputStore

log = logging.getLogger(__name__)

T = TypeVar("T")

# First waits of the S3 backoffs (the cap is backoff_max). A run that waits for S3 (reading its
# state before the first request, the last upload) tries again soon; the background loop, which
# generation does not wait for, spares a store that is down.
_WAITED_RETRY_BASE_S = 2.0
_BACKGROUND_RETRY_BASE_S = 5.0


def run_in_daemon_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """Like ``asyncio.to_thread`` but in a daemon thread: a hung S3 call never holds the process
    at exit (executor threads are joined at exit; these are not)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def target() -> None:
        try:
            r: Any = fn()
            e: BaseException | None = None
        except BaseException as exc:
            r, e = None, exc
        with contextlib.suppress(RuntimeError):  # loop already closed
            loop.call_soon_threadsafe(settle, r, e)

    threading.Thread(target=target, daemon=True, name="s3-sync").start()
    return fut


class Uploads:
    def __init__(self, cfg: GenerateConfig, store: OutputStore, control: RunControl) -> None:
        self.cfg = cfg
        self.store = store
        self.control = control
        self.s3: Any = None  # the S3Sync, once adopt_remote_state has made it (None without S3)
        self._wake = asyncio.Event()
        self._lock = threading.Lock()  # one S3 pass at a time: a hung one may outlive its wait
        self._finalizing: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ closing shards
    def rotate(self) -> None:
        """Close the open shard (when the store says it is due) and wake the upload loop."""
        shard = self.store.detach_open_shard()
        if shard is None:
            return

        async def finalize() -> None:
            meta = await asyncio.to_thread(self.store.finalize, shard)
            if meta is not None:
                log.info("closed %s (%d records, %d bytes)", meta.name, meta.records, meta.bytes)
                self._wake.set()

        task = asyncio.create_task(finalize())
        self._finalizing.add(task)
        task.add_done_callback(self._finalizing.discard)

    async def wait_closed(self) -> None:
        """Wait for the shards being closed."""
        if self._finalizing:
            await asyncio.gather(*self._finalizing, return_exceptions=True)

    # ------------------------------------------------------------------ S3
    async def adopt_remote_state(self, total: int) -> None:
        """Before the done set is built: what S3 holds for this host shard counts as done."""
        assert self.cfg.s3 is not None
        self.s3 = S3Sync(self.cfg.s3, self.store, total=total)
        fresh = not self.store.job_state().get("s3_adopted")
        delays = self.cfg.backoff(base=_WAITED_RETRY_BASE_S).delays()
        while True:
            try:

                def adopt() -> int:
                    with self._lock:
                        n = self.s3.adopt_remote(merge_failures=fresh)
                        with contextlib.suppress(Exception):
                            aborted = self.s3.abort_stale_multipart()
                            if aborted:
                                log.info("s3: aborted %d unfinished multipart upload(s)", aborted)
                        return int(n)

                await run_in_daemon_thread(adopt)
                self.store.update_job_state(s3_adopted=True)
                return
            except Exception as e:
                if not fresh:
                    log.warning("s3: cannot read remote state (%s); going on with the local state", describe_error(e))
                    return
                delay = next(delays)
                log.warning(
                    "s3: cannot read remote state (%s); this directory is new, so S3 must be read "
                    "before anything is generated (retrying in %.0fs)",
                    describe_error(e),
                    delay,
                )
                if await self.control.sleep_or_stop(delay):
                    raise FatalError("stopped before S3 could be read", EXIT_OK) from None

    def _sync_once(self) -> int:
        with self._lock:
            return int(self.s3.sync_once())

    async def loop(self) -> None:
        """Upload closed shards every sync_interval, and at once when a shard closes."""
        assert self.cfg.s3 is not None
        delay = 0.0
        delays = self.cfg.backoff(base=_BACKGROUND_RETRY_BASE_S).delays()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay or self.cfg.s3.sync_interval):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await run_in_daemon_thread(self._sync_once)
                delay = 0.0
                delays = self.cfg.backoff(base=_BACKGROUND_RETRY_BASE_S).delays()
            except Exception as e:
                self.s3.state.last_error = describe_error(e)
                self.s3.state.last_error_at = time.time()
                delay = next(delays)
                log.warning("s3: sync failed (%s); generation goes on, retry in %.0fs", describe_error(e), delay)

    async def final_sync(self, *, ending: bool) -> None:
        """At the end of the job (``ending``): upload until done (or ``final_sync_timeout``), unless
        a stop arrives. On a stop: try for ``stop_sync_timeout``. What is left goes at the next start."""
        assert self.cfg.s3 is not None
        stop_event = self.control.stop
        ending = ending and not stop_event.is_set()
        # 0: no limit at the end of the job; on a stop, no upload at all.
        if ending:
            timeout = self.cfg.s3.final_sync_timeout
            deadline = time.monotonic() + timeout if timeout > 0 else None
        else:
            if self.cfg.s3.stop_sync_timeout <= 0:
                log.warning("s3: %d shard(s) go at the next start", len(self.s3.pending()))
                return
            deadline = time.monotonic() + self.cfg.s3.stop_sync_timeout
        delays = self.cfg.backoff(base=_WAITED_RETRY_BASE_S).delays()
        sync: asyncio.Future[Any] = run_in_daemon_thread(self._sync_once)
        while True:
            left = None if deadline is None else max(0.1, deadline - time.monotonic())
            waits: set[asyncio.Future[Any]] = {sync}
            # Only the end-of-job sync watches for a stop (which shortens it); once stopping, the
            # stop is already set and would end the wait at once.
            stop: asyncio.Future[Any] | None = asyncio.create_task(stop_event.wait()) if ending else None
            if stop is not None:
                waits.add(stop)
            done, _unused = await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if stop is not None:
                stop.cancel()
            if sync in done and sync.exception() is None:
                log.info("s3: all closed shards uploaded (%d this run)", self.s3.state.uploaded)
                return
            if sync not in done:
                if stop is not None and stop in done:
                    # A stop during the end-of-job sync: the same upload goes on, for the stop's time.
                    ending = False
                    deadline = time.monotonic() + self.cfg.s3.stop_sync_timeout
                    continue
                # Deadline. The upload thread is a daemon: it dies with the process, and the next
                # start finishes its work.
                log.warning("s3: %d shard(s) not uploaded yet; they go at the next start", len(self.s3.pending()))
                return
            exc = sync.exception()
            assert exc is not None
            assert isinstance(exc, Exception)
            self.s3.state.last_error = describe_error(exc)
            delay = next(delays)
            log.warning("s3: upload failed (%s); retrying in %.0fs", describe_error(exc), delay)
            if not ending or (deadline is not None and time.monotonic() + delay > deadline):
                log.warning("s3: giving up for now; %d shard(s) go at the next start", len(self.s3.pending()))
                return
            if await self.control.sleep_or_stop(delay):
                ending = False
                deadline = time.monotonic() + self.cfg.s3.stop_sync_timeout
            sync = run_in_daemon_thread(self._sync_once)
