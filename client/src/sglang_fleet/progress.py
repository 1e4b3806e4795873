"""Counters, rates, the progress line for people and the status file for programs."""

from __future__ import annotations

import collections
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from sglang_fleet.fsutil import atomic_write_json

_WINDOW_S = 60.0
log = logging.getLogger(__name__)


@dataclass
class Stats:
    total: int = 0
    done_at_start: int = 0
    failed_at_start: int = 0
    succeeded: int = 0
    failed: int = 0
    retries: int = 0
    requeued_unavailable: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    started_at: float = field(default_factory=time.time)
    _samples: collections.deque[tuple[float, int, int]] = field(default_factory=collections.deque)

    @property
    def done(self) -> int:
        return self.done_at_start + self.succeeded + self.failed

    def sample(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, self.succeeded + self.failed, self.completion_tokens))
        while len(self._samples) > 2 and now - self._samples[1][0] >= _WINDOW_S:
            self._samples.popleft()

    def rates(self) -> tuple[float, float]:
        """Requests/s and completion tokens/s over the last minute."""
        if len(self._samples) < 2:
            return 0.0, 0.0
        t0, n0, k0 = self._samples[0]
        t1, n1, k1 = self._samples[-1]
        dt = t1 - t0
        if dt <= 0:
            return 0.0, 0.0
        return (n1 - n0) / dt, (k1 - k0) / dt

    def eta_s(self) -> float | None:
        rps, _unused = self.rates()
        remaining = max(0, self.total - self.done)
        if remaining == 0:
            return 0.0
        return remaining / rps if rps > 0 else None


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "--:--"
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}d{h:02d}:{m:02d}:{s:02d}" if d else f"{h}:{m:02d}:{s:02d}"


def fmt_count(x: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.1f}" if x != int(x) else str(int(x))


def progress_text(stats: Stats, in_flight: dict[str, int], *, width: int | None = None) -> str:
    rps, tps = stats.rates()
    pct = 100.0 * stats.done / stats.total if stats.total else 100.0
    errs = sum(stats.errors.values())
    flight = sum(in_flight.values())
    parts = [
        f"{stats.done}/{stats.total} ({pct:.1f}%)",
        f"{rps:.2f} req/s",
        f"{fmt_count(tps)} tok/s",
        f"ETA {fmt_duration(stats.eta_s())}",
        f"in flight {flight}" + (f" [{' '.join(str(v) for v in in_flight.values())}]" if len(in_flight) > 1 else ""),
        f"failed {stats.failed_at_start + stats.failed}",
        f"errors {errs}",
    ]
    text = " | ".join(parts)
    if width is not None:
        bar_w = max(10, min(40, width - len(text) - 4))
        filled = int(bar_w * pct / 100)
        text = f"[{'#' * filled}{'.' * (bar_w - filled)}] {text}"
        text = text[: width - 1]
    return text


class ProgressReporter:
    """A live bar on a terminal, a log line every ``interval`` seconds otherwise."""

    def __init__(self, mode: str, interval: float, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "log"
        self.mode = mode
        self.interval = interval
        self._last = 0.0
        self._bar_shown = False

    def update(self, stats: Stats, in_flight: dict[str, int], *, force: bool = False) -> None:
        if self.mode == "off":
            return
        now = time.monotonic()
        if self.mode == "bar":
            try:
                width = os.get_terminal_size(self.stream.fileno()).columns
            except OSError:
                width = 100
            self.stream.write("\r\x1b[K" + progress_text(stats, in_flight, width=width))
            self.stream.flush()
            self._bar_shown = True
        elif force or now - self._last >= self.interval:
            self._last = now
            log.info("progress: %s", progress_text(stats, in_flight))

    def clear(self) -> None:
        """Called before a log line so it does not land in the middle of the bar."""
        if self._bar_shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def finish(self) -> None:
        if self._bar_shown:
            self.stream.write("\n")
            self.stream.flush()
            self._bar_shown = False


def write_status(path: Path, status: dict[str, Any]) -> None:
    # Readers poll this file; the rename makes every read whole. It need not survive a power loss.
    atomic_write_json(path, status, durable=False)
