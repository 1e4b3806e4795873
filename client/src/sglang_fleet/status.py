"""What a run reports while it goes: the progress line or bar (for people) and ``status.json``
(for programs), refreshed by one ticker that also closes a shard whose time is up."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from sglang_fleet import __version__
from sglang_fleet.config import GenerateConfig
from sglang_fleet.control import RunControl
from sglang_fleet.endpoints import Endpoint
from sglang_fleet.progress import ProgressReporter, Stats, progress_text, write_status
from sglang_fleet.store import OutputStore
from sglang_fleet.uploads import Uploads
from sglang_fleet.workqueue import WorkQueue

log = logging.getLogger(__name__)

TICK_S = 1.0


class StatusReporter:
    def __init__(
        self,
        cfg: GenerateConfig,
        *,
        stats: Stats,
        store: OutputStore,
        work: WorkQueue,
        control: RunControl,
        endpoints: list[Endpoint],
        uploads: Uploads,
    ) -> None:
        self.cfg = cfg
        self.stats = stats
        self.store = store
        self.work = work
        self.control = control
        self.endpoints = endpoints
        self.uploads = uploads
        self.progress = ProgressReporter(cfg.progress, cfg.progress_interval)

    async def tick(self) -> None:
        last_status = 0.0
        while True:
            now = time.monotonic()
            self.stats.sample(now)
            # A shard is also due by age (shard_seconds): with few answers, no record would close it.
            if self.store.rotation_due():
                self.uploads.rotate()
            self.progress.update(self.stats, self._in_flight())
            if now - last_status >= self.cfg.status_interval:
                last_status = now
                try:
                    write_status(self.cfg.status_path, self.status())
                except OSError as e:
                    log.warning("cannot write %s: %s", self.cfg.status_path, e)
            await asyncio.sleep(TICK_S)

    def _in_flight(self) -> dict[str, int]:
        return {ep.url: ep.in_flight for ep in self.endpoints}

    def progress_line(self) -> str:
        return progress_text(self.stats, self._in_flight())

    def status(self) -> dict[str, Any]:
        rps, tps = self.stats.rates()
        s = self.stats
        return {
            "version": __version__,
            "state": self.control.state,
            "paused": self.control.paused,
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
            "control_socket": self.cfg.control_socket or None,
            "endpoints": {ep.url: ep.snapshot() for ep in self.endpoints},
            # Endpoints that accept requests and complete none: their work goes to the others.
            "stalled": {ep.url: ep.state_reason for ep in self.endpoints if ep.state == "stalled"},
            # Endpoints taken out of service (their server refused the API key or the path): nothing
            # is sent there until a retune hands over a new key, or the client restarts.
            "disabled": {ep.url: ep.disabled_reason for ep in self.endpoints if ep.state == "disabled"},
            "shards": {
                "closed": len(self.store.closed_shards()),
                "open_records": self.store.open_records,
                "records_written_this_run": self.store.records_written,
            },
            "s3": None if self.uploads.s3 is None else self.uploads.s3.state.snapshot(),
        }

    def finish(self) -> None:
        """The last status file and progress of the run."""
        self.stats.sample()
        self.progress.finish()
        with contextlib.suppress(OSError):
            write_status(self.cfg.status_path, self.status())


class EndpointLog:
    """The ``endpoint_log`` file: one JSON line per endpoint state change,
    ``{"t": unix time, "url", "event": up|down|stalled|drained|resumed|capacity, "capacity": concurrency
    limit}`` (a stalled event also has its ``reason``; the endpoint's next ``up`` is its return),
    and one when the client starts and when it stops (``{"t", "event": client_start|client_stop,
    "pid"}``: no endpoint is served in between), appended with one ``write()`` each (state changes
    are rare; requests write nothing here)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._failed = False
        self._append({"t": round(time.time(), 3), "event": "client_start", "pid": os.getpid()})

    def write(self, ep: Endpoint, event: str) -> None:
        rec: dict[str, Any] = {"t": round(time.time(), 3), "url": ep.url, "event": event, "capacity": ep.limiter.limit}
        if event == "stalled":
            rec["reason"] = ep.state_reason
        self._append(rec)

    def _append(self, rec: dict[str, Any]) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, (json.dumps(rec, separators=(",", ":")) + "\n").encode())
        except OSError as e:
            if not self._failed:
                self._failed = True
                log.warning("cannot write %s: %s", self.path, e)

    def close(self) -> None:
        if self._fd is not None:
            self._append({"t": round(time.time(), 3), "event": "client_stop", "pid": os.getpid()})
            os.close(self._fd)
            self._fd = None
