"""``sglang-fleet generate``: stream prompts to the endpoints and write every answer exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sglang_fleet import __version__
from sglang_fleet.config import ConfigError, GenerateConfig, normalise_endpoint, parse_concurrency
from sglang_fleet.endpoints import Endpoint
from sglang_fleet.fsutil import atomic_write_json
from sglang_fleet.httpclient import ConnectError, ConnectionLost, HTTPError
from sglang_fleet.ids import IdContainer
from sglang_fleet.openai_api import (
    COMPACT_JSON,
    AttemptError,
    Kind,
    RequestBuilder,
    classify_status,
    error_detail,
    parse_response,
)
from sglang_fleet.progress import ProgressReporter, Stats, progress_text, write_status
from sglang_fleet.prompts import (
    Prompt,
    PromptFileError,
    ScanResult,
    file_identity,
    iter_pending,
    iter_prompts,
    scan_prompts,
)
from sglang_fleet.s3sync import S3Sync, describe_error
from sglang_fleet.store import OutputStore, StoreError

log = logging.getLogger(__name__)

T = TypeVar("T")

EXIT_OK = 0
EXIT_USAGE = 2  # bad config or prompts file: restarting will not help
EXIT_ENDPOINTS = 3  # no endpoint usable: may help later
EXIT_FAILURES = 4  # too many prompts failing in a row: most likely the request config
EXIT_STORE = 5  # output directory locked by another process or damaged

_MAX_UNAVAILABLE = 50  # sends to a server that vanished before a prompt's requeues start counting


class FatalError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class WorkItem:
    prompt: Prompt
    attempts: int = 0  # counted attempts (see Kind)
    sends: int = 0
    unavailable: int = 0
    last_error: str = ""
    enqueued: float = field(default_factory=time.monotonic)


class WorkQueue:
    """Fresh prompts from the reader plus retries that wait for their backoff to pass. ``get``
    returns ``None`` once the reader is done and nothing is queued, waiting, or in flight."""

    def __init__(self, maxsize: int) -> None:
        self.fresh: asyncio.Queue[WorkItem] = asyncio.Queue(maxsize)
        self._heap: list[tuple[float, int, WorkItem]] = []
        self._seq = itertools.count()
        self._changed = asyncio.Event()
        self.all_done = asyncio.Event()
        self.reader_done = False
        self.in_flight = 0

    def _notify(self) -> None:
        self._changed.set()
        if self.finished():
            self.all_done.set()

    def finished(self) -> bool:
        return self.reader_done and self.fresh.empty() and not self._heap and self.in_flight == 0

    @property
    def waiting(self) -> int:
        return self.fresh.qsize() + len(self._heap)

    async def put_fresh(self, item: WorkItem) -> None:
        await self.fresh.put(item)
        self._notify()

    def requeue(self, item: WorkItem, delay: float) -> None:
        heapq.heappush(self._heap, (time.monotonic() + delay, next(self._seq), item))
        self._notify()

    def close_reader(self) -> None:
        self.reader_done = True
        self._notify()

    def done_with(self) -> None:
        self.in_flight -= 1
        self._notify()

    def has_ready(self) -> bool:
        return not self.fresh.empty() or bool(self._heap and self._heap[0][0] <= time.monotonic())

    async def get(self) -> WorkItem | None:
        while True:
            self._changed.clear()
            now = time.monotonic()
            if self._heap and self._heap[0][0] <= now:
                self.in_flight += 1
                return heapq.heappop(self._heap)[2]
            if not self.fresh.empty():
                self.in_flight += 1
                item = self.fresh.get_nowait()
                return item
            if self.finished():
                self._notify()  # let the other dispatchers see it too
                return None
            timeout = self._heap[0][0] - now if self._heap else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._changed.wait()


def _backoff(base: float, cap: float, attempt: int) -> float:
    return float(min(cap, base * (2.0 ** max(0, attempt - 1))) * random.uniform(0.5, 1.0))


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


class Generator:
    def __init__(self, cfg: GenerateConfig, *, api_key: str | None) -> None:
        self.cfg = cfg
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._headers = headers
        self.builder = RequestBuilder(cfg)
        self.stats = Stats()
        self.store = OutputStore(
            cfg.output, cfg.shard, shard_records=cfg.shard_records, shard_seconds=cfg.shard_seconds, fsync=cfg.fsync
        )
        self.endpoints: list[Endpoint] = []
        self.work = WorkQueue(maxsize=256)
        self.done: IdContainer = set()
        self.progress = ProgressReporter(cfg.progress, cfg.progress_interval)
        self.s3: Any = None
        self._s3_wake = asyncio.Event()
        self._s3_lock = threading.Lock()
        self._stop = asyncio.Event()
        self._stop_reason = ""
        self._fatal: FatalError | None = None
        self._hard_stop = asyncio.Event()
        self._paused = False
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._inflight: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._finalizing: set[asyncio.Task[Any]] = set()
        self._consecutive_failures = 0
        self._control_mtime: float | None = None
        self._state = "starting"
        self._scan: ScanResult | None = None
        self._generation_started: float | None = None
        self._generation_ended: float | None = None

    # ================================================================== set-up
    def _scan_prompts(self) -> ScanResult:
        cache = self.store.state_dir / "scan.json"
        ident = {**file_identity(self.cfg.prompts), "shard": str(self.cfg.shard), "api": self.cfg.api, "v": 1}
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            cached = json.loads(cache.read_text())
            if cached["identity"] == ident:
                return ScanResult(**cached["result"])
        t0 = time.monotonic()
        result = scan_prompts(self.cfg.prompts, self.cfg.shard)
        if self.cfg.api == "completions":
            for p in iter_prompts(self.cfg.prompts, self.cfg.shard):
                if p.messages is not None:
                    raise PromptFileError(
                        f"{self.cfg.prompts}:{p.line}: 'messages' needs api: chat; api: completions takes 'prompt' text"
                    )
        log.info(
            "scanned %s: %d prompts in shard %s (%d lines) in %.1fs",
            self.cfg.prompts,
            result.total,
            self.cfg.shard,
            result.lines,
            time.monotonic() - t0,
        )
        atomic_write_json(cache, {"identity": ident, "result": result.__dict__}, durable=False)
        return result

    async def _adopt_remote_state(self) -> None:
        """Before the done set is built: what S3 holds for this host shard counts as done."""
        assert self.cfg.s3 is not None
        self.s3 = S3Sync(self.cfg.s3, self.store, total=self.stats.total)
        fresh = not self.store.job_state().get("s3_adopted")
        delay = 2.0
        while True:
            try:

                def adopt() -> int:
                    with self._s3_lock:
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
                log.warning(
                    "s3: cannot read remote state (%s); this directory is new, so S3 must be read "
                    "before anything is generated (retrying in %.0fs)",
                    describe_error(e),
                    delay,
                )
            if await self._sleep_or_stop(delay):
                raise FatalError("stopped before S3 could be read", EXIT_OK)
            delay = min(delay * 2, 60.0)

    async def _sleep_or_stop(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop.wait()
        return self._stop.is_set()

    def _make_endpoints(self) -> None:
        conc = self.cfg.concurrency
        for url in self.cfg.endpoints:
            override = conc.get(url, conc.get("*", "auto")) if isinstance(conc, dict) else conc
            self.endpoints.append(
                Endpoint(
                    url,
                    headers=self._headers,
                    override=override,
                    factor=self.cfg.concurrency_factor,
                    default_concurrency=self.cfg.default_concurrency,
                    connect_timeout=self.cfg.connect_timeout,
                    backoff_base=self.cfg.backoff_base,
                    backoff_max=self.cfg.backoff_max,
                )
            )

    async def _start_endpoints(self) -> None:
        """Wait (up to startup_timeout) for at least one endpoint; the rest join when they come up."""
        deadline = time.monotonic() + self.cfg.startup_timeout
        reasons: dict[str, str] = {}
        delay = 0.5
        while True:
            results = await asyncio.gather(*(ep.probe() for ep in self.endpoints if ep.state == "starting"))
            pending = [ep for ep in self.endpoints if ep.state == "starting"]
            for ep, (ok, reason) in zip(pending, results, strict=True):
                if ok:
                    await ep.refresh_capacity()
                    ep.mark_up()
                    log.info("%s: up, concurrency %d", ep.url, ep.limiter.limit)
                elif "API key" in reason:
                    ep.disable(reason)
                else:
                    reasons[ep.url] = reason
            if any(ep.is_up for ep in self.endpoints):
                break
            if all(ep.state == "disabled" for ep in self.endpoints):
                raise FatalError(
                    "no endpoint accepts the API key: "
                    + "; ".join(f"{ep.url}: {ep.disabled_reason}" for ep in self.endpoints),
                    EXIT_ENDPOINTS,
                )
            if time.monotonic() >= deadline:
                detail = "; ".join(f"{u}: {r}" for u, r in reasons.items())
                raise FatalError(f"no endpoint reachable after {self.cfg.startup_timeout:g}s: {detail}", EXIT_ENDPOINTS)
            if await self._sleep_or_stop(min(delay, max(0.0, deadline - time.monotonic()))):
                raise FatalError("stopped while waiting for endpoints", EXIT_OK)
            delay = min(delay * 2, 10.0)
        for ep in self.endpoints:
            if ep.state == "starting":
                ep.mark_down(reasons.get(ep.url, "not ready at start"))

    # ================================================================== the run
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig.name)
        loop.add_signal_handler(signal.SIGHUP, self._on_reload_signal)
        try:
            return await self._run()
        except FatalError as e:
            if e.code != EXIT_OK:
                log.error("%s", e)
            return e.code
        except PromptFileError as e:
            log.error("%s", e)
            return EXIT_USAGE
        except StoreError as e:
            log.error("%s", e)
            return EXIT_STORE
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    async def _run(self) -> int:
        cfg = self.cfg
        log.info(
            "sglang-fleet %s: prompts %s, output %s, shard %s, %d endpoint(s)",
            __version__,
            cfg.prompts,
            cfg.output,
            cfg.shard,
            len(cfg.endpoints),
        )
        report = self.store.open(prompts=cfg.prompts)
        try:
            if report.recovered_shards or report.truncated_bytes:
                log.info(
                    "recovered %d open shard(s) after an unclean stop, cut %d torn bytes",
                    len(report.recovered_shards),
                    report.truncated_bytes,
                )
            self._scan = await asyncio.to_thread(self._scan_prompts)
            self.stats.total = self._scan.total
            if cfg.s3 is not None:
                await self._adopt_remote_state()
            if cfg.retry_failed:
                moved = self.store.retire_failures()
                if moved:
                    log.info("--retry-failed: earlier failures moved to %s; those prompts are tried again", moved)
            t0 = time.monotonic()
            self.done, _ = await asyncio.to_thread(self.store.load_done, exact=self._scan.exact_ids)
            failed_before = sum(1 for _ in self.store.iter_failed_ids())
            self.stats.done_at_start = len(self.done)
            self.stats.failed_at_start = failed_before
            log.info(
                "resuming: %d of %d prompts already done (%d failed) [done set built in %.2fs]",
                len(self.done),
                self.stats.total,
                failed_before,
                time.monotonic() - t0,
            )
            self._make_endpoints()
            return await self._generate()
        finally:
            await self._shutdown()

    async def _generate(self) -> int:
        self._spawn(self._read_prompts(), "reader")
        # Nothing left to send (a finished job restarted): no endpoint needed.
        while not (self.work.has_ready() or self.work.reader_done or self._stop.is_set()):
            await asyncio.sleep(0.01)
        needs_endpoints = self.work.has_ready()
        self._spawn(self._tick(), "ticker")
        self._spawn(self._fsync_loop(), "fsync")
        self._spawn(self._control_loop(), "control")
        if self.s3 is not None:
            self._spawn(self._s3_loop(), "s3")
        if needs_endpoints:
            await self._start_endpoints()
        self._state = "running"
        self._generation_started = time.monotonic()
        dispatchers = [asyncio.create_task(self._dispatch(ep), name=f"dispatch {ep.url}") for ep in self.endpoints]
        stop_wait = asyncio.create_task(self._stop.wait())
        finished = asyncio.create_task(self.work.all_done.wait())
        try:
            pending = {stop_wait, finished, *dispatchers}
            while not (stop_wait.done() or finished.done()):
                # A dispatcher ends early only when its endpoint is disabled, or with a bug.
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for d in done:
                    if d in dispatchers and not d.cancelled() and d.exception() is not None:
                        raise d.exception()  # type: ignore[misc]
        finally:
            stop_wait.cancel()
            finished.cancel()
            for d in dispatchers:
                d.cancel()
            await asyncio.gather(*dispatchers, return_exceptions=True)
        self._generation_ended = time.monotonic()
        if self._fatal is not None:
            await self._drain()
            raise self._fatal
        if self._stop.is_set():
            log.info(
                "stopping (%s): no new requests; waiting up to %gs for %d in flight",
                self._stop_reason,
                self.cfg.drain_timeout,
                len(self._inflight),
            )
            await self._drain()
            return EXIT_OK
        self._state = "finishing"
        log.info(
            "all %d prompts done: %d completed and %d failed in this run",
            self.stats.total,
            self.stats.succeeded,
            self.stats.failed,
        )
        return EXIT_OK

    async def _drain(self) -> None:
        self._state = "draining"
        if self._inflight:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.drain_timeout):
                    drain: asyncio.Future[Any] = asyncio.gather(*list(self._inflight), return_exceptions=True)
                    hard: asyncio.Future[Any] = asyncio.create_task(self._hard_stop.wait())
                    await asyncio.wait([drain, hard], return_when=asyncio.FIRST_COMPLETED)
                    hard.cancel()
        left = [t for t in self._inflight if not t.done()]
        if left:
            log.warning("drain deadline: abandoning %d request(s); they are sent again at the next start", len(left))
            for t in left:
                t.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    async def _cancel_background(self, names: set[str] | None, *, keep: bool = False) -> None:
        tasks = [t for t in self._background if (names is None or t.get_name() in names) != keep]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _shutdown(self) -> None:
        # The status ticker runs on through the final upload, which can take a while.
        await self._cancel_background({"s3", "ticker"}, keep=True)
        if self._finalizing:
            await asyncio.gather(*self._finalizing, return_exceptions=True)
        meta = await asyncio.to_thread(self.store.close)
        if meta is not None:
            log.info("closed %s (%d records)", meta.name, meta.records)
        await self._cancel_background({"s3"})
        if self.s3 is not None and self._state in ("finishing", "draining", "running"):
            await self._final_sync()
        await self._cancel_background(None)
        for ep in self.endpoints:
            await ep.close()
        ran = self._state in ("finishing", "draining", "running")
        self._state = "stopped" if self._state != "finishing" else "done"
        self.stats.sample()
        self.progress.finish()
        with contextlib.suppress(OSError):
            write_status(self.cfg.status_path, self._status())
        if ran:
            # From the first request to the last record: start-up and the final upload excluded.
            elapsed = max(1e-9, (self._generation_ended or time.monotonic()) - (self._generation_started or 0.0))
            log.info(
                "%s: %s; this run: %d completed, %d failed in %.2fs (%.2f req/s)",
                self._state,
                self._progress_line(),
                self.stats.succeeded,
                self.stats.failed,
                elapsed,
                (self.stats.succeeded + self.stats.failed) / elapsed,
            )

    async def _final_sync(self) -> None:
        """At the end of the job: upload until done (or ``final_sync_timeout``), unless a stop
        arrives. On a stop: try for ``stop_sync_timeout``. What is left goes at the next start."""
        assert self.cfg.s3 is not None
        ending = self._state == "finishing" and not self._stop.is_set()
        timeout = self.cfg.s3.final_sync_timeout if ending else self.cfg.s3.stop_sync_timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        delay = 2.0
        while True:
            left = None if deadline is None else max(0.1, deadline - time.monotonic())
            sync: asyncio.Future[Any] = run_in_daemon_thread(self._sync_once)
            stop: asyncio.Future[Any] = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait([sync, stop], timeout=left, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if sync in done and sync.exception() is None:
                log.info("s3: all closed shards uploaded (%d this run)", self.s3.state.uploaded)
                return
            if sync not in done:
                # Deadline, or a stop during an endless end-of-job sync. The upload thread is a
                # daemon: it dies with the process, and the next start finishes its work.
                log.warning("s3: %d shard(s) not uploaded yet; they go at the next start", len(self.s3.pending()))
                return
            exc = sync.exception()
            assert exc is not None
            assert isinstance(exc, Exception)
            self.s3.state.last_error = describe_error(exc)
            log.warning("s3: upload failed (%s); retrying in %.0fs", describe_error(exc), delay)
            if not ending or (deadline is not None and time.monotonic() + delay > deadline):
                log.warning("s3: giving up for now; %d shard(s) go at the next start", len(self.s3.pending()))
                return
            if await self._sleep_or_stop(delay):
                ending = False
                deadline = time.monotonic() + self.cfg.s3.stop_sync_timeout
            delay = min(delay * 2, 60.0)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                exc = t.exception()
                if isinstance(exc, PromptFileError):
                    self._fatal = FatalError(str(exc), EXIT_USAGE)
                else:
                    log.error("%s task failed: %r", name, exc)
                    self._fatal = FatalError(f"internal error in {name}: {exc!r}", 1)
                self._request_stop("fatal error")

        task.add_done_callback(done)

    # ================================================================== signals and control
    def _on_stop_signal(self, name: str) -> None:
        if self._stop.is_set():
            log.warning("%s again: abandoning requests in flight now", name)
            self._hard_stop.set()
            return
        self._request_stop(name)

    def _request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self._stop_reason = reason
            self._stop.set()

    def _on_reload_signal(self) -> None:
        log.info("SIGHUP: re-reading %s and server capacities", self.cfg.control_path)
        self._control_mtime = None
        self._apply_control(force=True)
        for ep in self.endpoints:
            if ep.is_up:
                self._spawn(ep.refresh_capacity(), f"capacity {ep.url}")

    def _apply_control(self, *, force: bool = False) -> None:
        path = self.cfg.control_path
        try:
            mtime: float | None = path.stat().st_mtime
        except FileNotFoundError:
            mtime = None
        if mtime == self._control_mtime and not force:
            return
        self._control_mtime = mtime
        control: dict[str, Any] = {}
        if mtime is not None:
            try:
                control = json.loads(path.read_text() or "{}")
                if not isinstance(control, dict):
                    raise ValueError("not an object")
            except (OSError, ValueError) as e:
                log.error("%s: ignored (%s)", path, e)
                return
        base = self.cfg.concurrency
        conc = control.get("concurrency", base)
        if isinstance(conc, dict):
            conc = {k if k == "*" else _normalised(k): v for k, v in conc.items()}
        try:
            for ep in self.endpoints:
                if isinstance(conc, dict):
                    value = conc.get(
                        ep.url,
                        conc.get("*", base.get(ep.url, base.get("*", "auto")) if isinstance(base, dict) else base),
                    )
                else:
                    value = conc
                ep.set_override(parse_concurrency(value))
        except Exception as e:
            log.error("%s: bad concurrency (%s)", path, e)
        paused = bool(control.get("paused", False))
        if paused != self._paused:
            self._paused = paused
            if paused:
                self._unpaused.clear()
                log.info("paused by %s: no new requests until it says otherwise", path)
            else:
                self._unpaused.set()
                log.info("resumed by %s", path)

    async def _control_loop(self) -> None:
        while True:
            self._apply_control()
            await asyncio.sleep(2.0)

    # ================================================================== the work
    async def _read_prompts(self) -> None:
        for p in iter_pending(self.cfg.prompts, self.cfg.shard, self.done):
            if p is None:
                await asyncio.sleep(0)  # skipping a long done prefix must not starve the loop
                continue
            await self.work.put_fresh(WorkItem(p))
        self.work.close_reader()

    async def _dispatch(self, ep: Endpoint) -> None:
        while not self._stop.is_set():
            if not ep.is_up:
                if ep.state == "disabled":
                    return
                await ep.wait_up()
                continue
            if self._paused:
                await self._unpaused.wait()
                continue
            await ep.limiter.acquire()
            try:
                item = await self.work.get()
            except BaseException:
                ep.limiter.release()
                raise
            if item is None:
                ep.limiter.release()
                return
            if not ep.is_up or self._paused or self._stop.is_set():
                self.work.requeue(item, 0.0)
                self.work.done_with()
                ep.limiter.release()
                continue
            task = asyncio.create_task(self._run_one(ep, item))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
            if len(self.endpoints) > 1:
                # Without a yield here, the first endpoint's dispatcher would take every queued
                # prompt while it has free slots, and the others would wait for the next batch.
                await asyncio.sleep(0)

    async def _run_one(self, ep: Endpoint, item: WorkItem) -> None:
        ep.in_flight += 1
        try:
            await self._attempt(ep, item)
        finally:
            ep.in_flight -= 1
            ep.limiter.release()
            self.work.done_with()

    async def _attempt(self, ep: Endpoint, item: WorkItem) -> None:
        body = self.builder.body(item.prompt)
        item.sends += 1
        started_wall = time.time()
        t0 = time.monotonic()
        try:
            try:
                async with asyncio.timeout(self.cfg.request_timeout):
                    resp = await ep.pool.request("POST", self.builder.path, body=body, headers=self._headers)
            except TimeoutError:
                raise AttemptError(Kind.RETRY, f"no answer within {self.cfg.request_timeout:g}s") from None
            except (ConnectError, ConnectionLost) as e:
                raise AttemptError(Kind.UNAVAILABLE, str(e)) from None
            except HTTPError as e:
                raise AttemptError(Kind.RETRY, f"bad HTTP answer: {e}") from None
            if resp.status != 200:
                raise AttemptError(
                    classify_status(resp.status), f"HTTP {resp.status}: {error_detail(resp.body)}", resp.status
                )
            try:
                data = resp.json()
            except ValueError:
                raise AttemptError(Kind.RETRY, "answer is not JSON") from None
            comp = parse_response(self.cfg.api, data, split_think_tags=self.cfg.reasoning.split_think_tags)
        except AttemptError as err:
            self._on_error(ep, item, err)
            return
        latency = time.monotonic() - t0
        record: dict[str, Any] = {
            "id": item.prompt.id,
            "output": comp.output,
            "reasoning_content": comp.reasoning,
            "finish_reason": comp.finish_reason,
            "usage": comp.usage,
            "endpoint": ep.url,
            "model": comp.model,
            "attempts": item.sends,
            "timings": {
                "started": round(started_wall, 3),
                "finished": round(started_wall + latency, 3),
                "latency_s": round(latency, 4),
                "queued_s": round(t0 - item.enqueued, 4),
            },
        }
        if self.cfg.include_input:
            record["input"] = item.prompt.messages if item.prompt.messages is not None else item.prompt.text
        line = COMPACT_JSON.encode(record).encode("utf-8", "surrogatepass") + b"\n"
        self.store.append_record(item.prompt.id, line)
        self.stats.succeeded += 1
        ep.completed += 1
        self._consecutive_failures = 0
        if comp.usage:
            self.stats.prompt_tokens += int(comp.usage.get("prompt_tokens") or 0)
            self.stats.completion_tokens += int(comp.usage.get("completion_tokens") or 0)
            self.stats.reasoning_tokens += int(comp.usage.get("reasoning_tokens") or 0)
        if self.store.rotation_due():
            self._rotate()

    def _on_error(self, ep: Endpoint, item: WorkItem, err: AttemptError) -> None:
        ep.errors[err.kind.value] += 1
        self.stats.errors[err.kind.value] += 1
        item.last_error = err.reason
        cfg = self.cfg
        if err.kind is Kind.UNAVAILABLE:
            ep.mark_down(err.reason)
            item.unavailable += 1
            self.stats.requeued_unavailable += 1
            if item.unavailable <= _MAX_UNAVAILABLE:
                self.work.requeue(item, 0.0)
                return
            item.unavailable = 0
        elif err.kind is Kind.THROTTLED:
            self.work.requeue(item, _backoff(cfg.backoff_base, cfg.backoff_max, item.sends))
            return
        elif err.kind is Kind.ENDPOINT:
            ep.disable(err.reason)
            self.work.requeue(item, 0.0)
            if all(e.state == "disabled" for e in self.endpoints):
                self._fatal = FatalError(
                    "every endpoint refused the requests: "
                    + "; ".join(f"{e.url}: {e.disabled_reason}" for e in self.endpoints),
                    EXIT_ENDPOINTS,
                )
                self._request_stop("no usable endpoint")
            return
        item.attempts += 1
        if err.kind is Kind.RETRY and item.attempts < cfg.max_attempts:
            self.stats.retries += 1
            log.debug("%s: %s (attempt %d of %d)", item.prompt.id, err.reason, item.attempts, cfg.max_attempts)
            self.work.requeue(item, _backoff(cfg.backoff_base, cfg.backoff_max, item.attempts))
            return
        self._record_failure(ep, item, err)

    def _record_failure(self, ep: Endpoint, item: WorkItem, err: AttemptError) -> None:
        record = {
            "id": item.prompt.id,
            "error": err.reason,
            "kind": err.kind.value,
            "status": err.status,
            "attempts": item.sends,
            "endpoint": ep.url,
            "failed_at": round(time.time(), 3),
        }
        line = COMPACT_JSON.encode(record).encode("utf-8", "surrogatepass") + b"\n"
        self.store.append_failure(item.prompt.id, line)
        self.stats.failed += 1
        log.warning("%s failed for good after %d attempt(s): %s", item.prompt.id, item.sends, err.reason)
        self._consecutive_failures += 1
        limit = self.cfg.max_consecutive_failures
        if limit and self._consecutive_failures >= limit and self._fatal is None:
            self._fatal = FatalError(
                f"{self._consecutive_failures} prompts failed in a row (last: {err.reason}); stopping, since this "
                "usually means a bad request setting. Fix it, then run again with --retry-failed",
                EXIT_FAILURES,
            )
            self._request_stop("too many failures")

    # ================================================================== shards, fsync, status
    def _rotate(self) -> None:
        shard = self.store.detach_open_shard()
        if shard is None:
            return

        async def finalize() -> None:
            meta = await asyncio.to_thread(self.store.finalize, shard)
            if meta is not None:
                log.info("closed %s (%d records, %d bytes)", meta.name, meta.records, meta.bytes)
                self._s3_wake.set()

        task = asyncio.create_task(finalize())
        self._finalizing.add(task)
        task.add_done_callback(self._finalizing.discard)

    async def _fsync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.fsync_interval)
            if self.cfg.fsync == "interval":
                await asyncio.to_thread(self.store.fsync_pending)

    async def _tick(self) -> None:
        last_status = 0.0
        while True:
            now = time.monotonic()
            self.stats.sample(now)
            if self.store.rotation_due():
                self._rotate()
            self.progress.update(self.stats, self._in_flight())
            if now - last_status >= self.cfg.status_interval:
                last_status = now
                try:
                    write_status(self.cfg.status_path, self._status())
                except OSError as e:
                    log.warning("cannot write %s: %s", self.cfg.status_path, e)
            await asyncio.sleep(1.0)

    def _in_flight(self) -> dict[str, int]:
        return {ep.url: ep.in_flight for ep in self.endpoints}

    def _progress_line(self) -> str:
        return progress_text(self.stats, self._in_flight())

    def _status(self) -> dict[str, Any]:
        rps, tps = self.stats.rates()
        s = self.stats
        return {
            "version": __version__,
            "state": self._state,
            "paused": self._paused,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "shard": str(self.cfg.shard),
            "updated_at": time.time(),
            "started_at": s.started_at,
            "total": s.total,
            "done": s.done,
            "remaining": max(0, s.total - s.done),
            "done_at_start": s.done_at_start,
            "completed_this_run": s.succeeded,
            "failed_total": s.failed_at_start + s.failed,
            "failed_this_run": s.failed,
            "retries": s.retries,
            "requeued_unavailable": s.requeued_unavailable,
            "requests_per_s": round(rps, 3),
            "completion_tokens_per_s": round(tps, 1),
            "completion_tokens": s.completion_tokens,
            "prompt_tokens": s.prompt_tokens,
            "eta_s": None if s.eta_s() is None else round(s.eta_s() or 0.0, 1),
            "in_flight": sum(ep.in_flight for ep in self.endpoints),
            "queued": self.work.waiting,
            "errors": dict(s.errors),
            "endpoints": {ep.url: ep.snapshot() for ep in self.endpoints},
            "shards": {
                "closed": len(self.store.closed_shards()),
                "open_records": self.store.open_records,
                "records_written_this_run": self.store.records_written,
            },
            "s3": None if self.s3 is None else self.s3.state.snapshot(),
        }

    # ================================================================== S3
    def _sync_once(self) -> int:
        with self._s3_lock:
            return int(self.s3.sync_once())

    async def _s3_loop(self) -> None:
        assert self.cfg.s3 is not None
        delay = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay or self.cfg.s3.sync_interval):
                    await self._s3_wake.wait()
            self._s3_wake.clear()
            try:
                await run_in_daemon_thread(self._sync_once)
                delay = 0.0
            except Exception as e:
                self.s3.state.last_error = describe_error(e)
                self.s3.state.last_error_at = time.time()
                delay = min(300.0, max(5.0, delay * 2)) * random.uniform(0.8, 1.0)
                log.warning("s3: sync failed (%s); generation goes on, retry in %.0fs", describe_error(e), delay)


def _normalised(url: str) -> str:
    try:
        return normalise_endpoint(str(url))
    except ConfigError:
        return str(url)


def load_api_key(env_name: str) -> str | None:
    key = os.environ.get(env_name)
    return key or None


def default_output_for(prompts: Path) -> Path:
    return prompts.with_suffix("").with_name(prompts.stem + ".out")
