"""The control channel of a run: exit statuses, stop requests (signals, fatal errors), the run's
state, and what ``control.json`` says (pause, per-endpoint concurrency), re-read every 2 seconds
and at once on SIGHUP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from sglang_fleet.config import ConfigError, GenerateConfig, normalise_endpoint, parse_concurrency
from sglang_fleet.endpoints import Endpoint

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_USAGE = 2  # bad config or prompts file, or the control socket in use: restarting will not help
EXIT_ENDPOINTS = 3  # no endpoint usable: may help later
EXIT_FAILURES = 4  # too many prompts failing in a row: most likely the request config
EXIT_STORE = 5  # output directory locked by another process or damaged

CONTROL_POLL_S = 2.0

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class FatalError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _normalised(url: str) -> str:
    try:
        return normalise_endpoint(str(url))
    except ConfigError:
        return str(url)


class RunControl:
    """Whether the run goes on, and how: the stop request and its reason, the fatal error that
    ends the run, the run's state (for the status file), the pause, and the concurrency overrides
    of ``control.json``.

    ``endpoints`` is the run's list, shared (filled once the endpoints are made); ``spawn`` starts a
    background task of the run (SIGHUP re-reads the server capacities in such tasks)."""

    def __init__(
        self,
        cfg: GenerateConfig,
        endpoints: list[Endpoint],
        spawn: Callable[[Coroutine[Any, Any, Any], str], None],
    ) -> None:
        self.cfg = cfg
        self.endpoints = endpoints
        self._spawn = spawn
        self.state = "starting"
        self.stop = asyncio.Event()
        self.stop_reason = ""
        self.fatal: FatalError | None = None
        self.hard_stop = asyncio.Event()
        self.paused = False
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._control_mtime: float | None = None

    # ------------------------------------------------------------------ stopping
    def request_stop(self, reason: str) -> None:
        if not self.stop.is_set():
            self.stop_reason = reason
            self.stop.set()

    def fail(self, error: FatalError, reason: str) -> None:
        """End the run with ``error`` (replacing an earlier one)."""
        self.fatal = error
        self.request_stop(reason)

    async def sleep_or_stop(self, seconds: float) -> bool:
        """Wait ``seconds``; True (at once) if a stop is requested meanwhile."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.stop.wait()
        return self.stop.is_set()

    async def wait_unpaused(self) -> None:
        await self._unpaused.wait()

    # ------------------------------------------------------------------ signals
    def add_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_stop_signal, sig.name)
        loop.add_signal_handler(signal.SIGHUP, self._on_reload_signal)

    def remove_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (*_STOP_SIGNALS, signal.SIGHUP):
            loop.remove_signal_handler(sig)

    def _on_stop_signal(self, name: str) -> None:
        if self.stop.is_set():
            log.warning("%s again: abandoning requests in flight now", name)
            self.hard_stop.set()
            return
        self.request_stop(name)

    def _on_reload_signal(self) -> None:
        log.info("SIGHUP: re-reading %s and server capacities", self.cfg.control_path)
        self._control_mtime = None
        self.apply(force=True)
        for ep in self.endpoints:
            if ep.usable:
                self._spawn(ep.refresh_capacity(), f"capacity {ep.url}")

    # ------------------------------------------------------------------ control.json
    async def loop(self) -> None:
        while True:
            self.apply()
            await asyncio.sleep(CONTROL_POLL_S)

    def apply(self, *, force: bool = False) -> None:
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
        if paused != self.paused:
            self.paused = paused
            if paused:
                self._unpaused.clear()
                log.info("paused by %s: no new requests until it says otherwise", path)
            else:
                self._unpaused.set()
                log.info("resumed by %s", path)
