"""``sglang-fleet generate``: stream prompts to the endpoints and write every answer exactly once.

``Generator`` runs a job from start to end and composes the parts that do the work:
``workqueue`` (the prompts left and their queue), ``dispatch`` (endpoints, requests, records and
failures), ``control`` (signals, stop, pause, ``control.json``), ``control_socket`` (drain and
resume of endpoints by a retune), ``status`` (progress, ``status.json``, the endpoint log) and
``uploads`` (closing shards, S3).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

from sglang_fleet import __version__
from sglang_fleet.config import GenerateConfig
from sglang_fleet.control import EXIT_OK, EXIT_STORE, EXIT_USAGE, FatalError, RunControl
from sglang_fleet.control_socket import ControlServer, ControlSocketError
from sglang_fleet.dispatch import Dispatcher
from sglang_fleet.endpoints import Endpoint
from sglang_fleet.ids import IdContainer
from sglang_fleet.progress import Stats
from sglang_fleet.prompts import PromptFileError, ScanResult
from sglang_fleet.status import EndpointLog, StatusReporter
from sglang_fleet.store import OutputStore, StoreError
from sglang_fleet.uploads import Uploads
from sglang_fleet.workqueue import WorkQueue, feed, scan

log = logging.getLogger(__name__)

# States in which the run got as far as sending (or finding nothing left to send).
_RAN = ("finishing", "draining", "running")


class Generator:
    def __init__(self, cfg: GenerateConfig, *, api_key: str | None) -> None:
        self.cfg = cfg
        self.stats = Stats()
        self.store = OutputStore(
            cfg.output, cfg.shard, shard_records=cfg.shard_records, shard_seconds=cfg.shard_seconds, fsync=cfg.fsync
        )
        self.endpoints: list[Endpoint] = []  # shared by the parts below; filled once the prompts are known
        self.work = WorkQueue(maxsize=256)
        self.done: IdContainer = set()
        self._background: set[asyncio.Task[Any]] = set()
        self.control = RunControl(cfg, self.endpoints, self._spawn)
        self.uploads = Uploads(cfg, self.store, self.control)
        self.dispatcher = Dispatcher(
            cfg,
            api_key=api_key,
            stats=self.stats,
            store=self.store,
            work=self.work,
            control=self.control,
            endpoints=self.endpoints,
            rotate=self.uploads.rotate,
        )
        self.status = StatusReporter(
            cfg,
            stats=self.stats,
            store=self.store,
            work=self.work,
            control=self.control,
            endpoints=self.endpoints,
            uploads=self.uploads,
        )
        self.control_server: ControlServer | None = None
        self.endpoint_log: EndpointLog | None = None
        self._scan: ScanResult | None = None
        self._generation_started: float | None = None
        self._generation_ended: float | None = None

    # ================================================================== the run
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.control.add_signal_handlers(loop)
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
            self.control.remove_signal_handlers(loop)

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
            # The endpoints exist from here (idle until the prompts are known), so that the control
            # socket, opened early to fail fast when its path is taken, can name them.
            if cfg.endpoint_log:
                path = Path(cfg.endpoint_log).expanduser()
                try:
                    self.endpoint_log = EndpointLog(path)
                except OSError as e:
                    raise FatalError(f"endpoint_log {path}: {e.strerror or e}", EXIT_USAGE) from None
                self.dispatcher.on_endpoint_event = self.endpoint_log.write
            self.dispatcher.make_endpoints()
            if cfg.control_socket:
                self.control_server = ControlServer(
                    Path(cfg.control_socket).expanduser(),
                    cfg=cfg,
                    endpoints=self.endpoints,
                    dispatcher=self.dispatcher,
                    control=self.control,
                )
                try:
                    await self.control_server.start()
                except ControlSocketError as e:
                    self.control_server = None
                    raise FatalError(str(e), EXIT_USAGE) from None
            if report.recovered_shards or report.truncated_bytes:
                log.info(
                    "recovered %d open shard(s) after an unclean stop, cut %d torn bytes",
                    len(report.recovered_shards),
                    report.truncated_bytes,
                )
            self._scan = await asyncio.to_thread(scan, cfg, self.store.state_dir)
            self.stats.total = self._scan.total
            if cfg.s3 is not None:
                await self.uploads.adopt_remote_state(self.stats.total)
            if cfg.retry_failed:
                moved = self.store.retire_failures()
                if moved:
                    log.info("--retry-failed: earlier failures moved to %s; those prompts are tried again", moved)
            t0 = time.monotonic()
            self.done, _unused = await asyncio.to_thread(self.store.load_done, exact=self._scan.exact_ids)
            failed_before = sum(1 for _unused in self.store.iter_failed_ids())
            self.stats.done_at_start = len(self.done)
            self.stats.failed_at_start = failed_before
            log.info(
                "resuming: %d of %d prompts already done (%d failed) [done set built in %.2fs]",
                len(self.done),
                self.stats.total,
                failed_before,
                time.monotonic() - t0,
            )
            return await self._generate()
        finally:
            await self._shutdown()

    async def _generate(self) -> int:
        control = self.control
        self._spawn(feed(self.work, self.cfg, self.done), "reader")
        # Nothing left to send (a finished job restarted): no endpoint needed.
        while not (self.work.has_ready() or self.work.reader_done or control.stop.is_set()):
            await asyncio.sleep(0.01)
        needs_endpoints = self.work.has_ready()
        self._spawn(self.status.tick(), "ticker")
        self._spawn(self._fsync_loop(), "fsync")
        self._spawn(control.loop(), "control")
        if self.uploads.s3 is not None:
            self._spawn(self.uploads.loop(), "s3")
        if needs_endpoints:
            await self.dispatcher.start_endpoints()
            self._spawn(self.dispatcher.watch_stalls(), "stall watch")
        control.state = "running"
        self._generation_started = time.monotonic()
        dispatchers = [
            asyncio.create_task(self.dispatcher.dispatch(ep), name=f"dispatch {ep.url}") for ep in self.endpoints
        ]
        stop_wait = asyncio.create_task(control.stop.wait())
        finished = asyncio.create_task(self.work.all_done.wait())
        try:
            pending = {stop_wait, finished, *dispatchers}
            while not (stop_wait.done() or finished.done()):
                # A dispatcher ends early only with a bug (a disabled endpoint's waits for a new key).
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
        if control.fatal is not None:
            await self._drain()
            raise control.fatal
        if control.stop.is_set():
            log.info(
                "stopping (%s): no new requests; waiting up to %gs for %d in flight",
                control.stop_reason,
                self.cfg.drain_timeout,
                len(self.dispatcher.inflight),
            )
            await self._drain()
            return EXIT_OK
        control.state = "finishing"
        log.info(
            "all %d prompts done: %d completed and %d failed in this run",
            self.stats.total,
            self.stats.succeeded,
            self.stats.failed,
        )
        return EXIT_OK

    async def _drain(self) -> None:
        self.control.state = "draining"
        await self.dispatcher.drain()

    async def _fsync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.fsync_interval)
            if self.cfg.fsync == "interval":
                await asyncio.to_thread(self.store.fsync_pending)

    async def _cancel_background(self, names: set[str] | None, *, keep: bool = False) -> None:
        tasks = [t for t in self._background if (names is None or t.get_name() in names) != keep]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _shutdown(self) -> None:
        control = self.control
        if self.control_server is not None:
            # Nothing more is sent to any endpoint: drains and resumes have nothing left to act on.
            await self.control_server.close()
        # The status ticker runs on through the final upload, which can take a while.
        await self._cancel_background({"s3", "ticker"}, keep=True)
        await self.uploads.wait_closed()
        meta = await asyncio.to_thread(self.store.close)
        if meta is not None:
            log.info("closed %s (%d records)", meta.name, meta.records)
        await self._cancel_background({"s3"})
        if self.uploads.s3 is not None and control.state in _RAN:
            await self.uploads.final_sync(ending=control.state == "finishing")
        await self._cancel_background(None)
        for ep in self.endpoints:
            await ep.close()
        if self.endpoint_log is not None:
            self.endpoint_log.close()
        ran = control.state in _RAN
        control.state = "stopped" if control.state != "finishing" else "done"
        self.status.finish()
        if ran:
            # From the first request to the last record: start-up and the final upload excluded.
            elapsed = max(1e-9, (self._generation_ended or time.monotonic()) - (self._generation_started or 0.0))
            log.info(
                "%s: %s; this run: %d completed, %d failed in %.2fs (%.2f req/s)",
                control.state,
                self.status.progress_line(),
                self.stats.succeeded,
                self.stats.failed,
                elapsed,
                (self.stats.succeeded + self.stats.failed) / elapsed,
            )

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                exc = t.exception()
                if isinstance(exc, PromptFileError):
                    self.control.fail(FatalError(str(exc), EXIT_USAGE), "fatal error")
                else:
                    log.error("%s task failed: %r", name, exc)
                    self.control.fail(FatalError(f"internal error in {name}: {exc!r}", 1), "fatal error")

        task.add_done_callback(done)


def load_api_key(env_name: str) -> str | None:
    key = os.environ.get(env_name)
    return key or None


def default_output_for(prompts: Path) -> Path:
    return prompts.with_suffix("").with_name(prompts.stem + ".out")
