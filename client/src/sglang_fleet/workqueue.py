"""The work: which prompts are left, and the queue that hands them to the dispatchers.

The prompts file is scanned once (the count, and a check of every line, cached by file identity),
then streamed past the done set into a bounded queue, so only the prompts in flight are in memory.
Retries wait in the same queue until their backoff has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from sglang_fleet.config import GenerateConfig
from sglang_fleet.fsutil import atomic_write_json
from sglang_fleet.ids import IdContainer
from sglang_fleet.prompts import (
    Prompt,
    PromptFileError,
    ScanResult,
    file_identity,
    iter_pending,
    iter_prompts,
    scan_prompts,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkItem:
    prompt: Prompt
    attempts: int = 0  # counted attempts (see Kind)
    sends: int = 0
    unavailable: int = 0
    last_error: str = ""
    enqueued: float = field(default_factory=time.monotonic)
    # Set just before its attempt is cancelled by a drain's deadline: the prompt is then requeued for
    # the other endpoints, and that attempt can no longer write a record.
    abandoned: bool = False


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


def scan(cfg: GenerateConfig, state_dir: Path) -> ScanResult:
    """Validate the prompts file and count this shard's prompts, or take both from the cache."""
    cache = state_dir / "scan.json"
    ident = {**file_identity(cfg.prompts), "shard": str(cfg.shard), "api": cfg.api, "v": 1}
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        cached = json.loads(cache.read_text())
        if cached["identity"] == ident:
            return ScanResult(**cached["result"])
    t0 = time.monotonic()
    result = scan_prompts(cfg.prompts, cfg.shard)
    if cfg.api == "completions":
        for p in iter_prompts(cfg.prompts, cfg.shard):
            if p.messages is not None:
                raise PromptFileError(
                    f"{cfg.prompts}:{p.line}: 'messages' needs api: chat; api: completions takes 'prompt' text"
                )
    log.info(
        "scanned %s: %d prompts in shard %s (%d lines) in %.1fs",
        cfg.prompts,
        result.total,
        cfg.shard,
        result.lines,
        time.monotonic() - t0,
    )
    atomic_write_json(cache, {"identity": ident, "result": result.__dict__}, durable=False)
    return result


async def feed(work: WorkQueue, cfg: GenerateConfig, done: IdContainer) -> None:
    """Stream the prompts not done yet into the queue, then close it."""
    for p in iter_pending(cfg.prompts, cfg.shard, done):
        if p is None:
            await asyncio.sleep(0)  # skipping a long done prefix must not starve the loop
            continue
        await work.put_fresh(WorkItem(p))
    work.close_reader()
