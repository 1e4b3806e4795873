"""One model server: its connection pool, its concurrency limit, and whether it is up.

A server that refuses connections or answers 503 is *down*: nothing is sent to it, and one task
probes ``/health`` with exponential backoff and jitter until it answers 200, then re-reads
``/server_info`` (a relaunch may have changed its capacity) and opens it again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from typing import Any

from sglang_fleet.backoff import Backoff
from sglang_fleet.httpclient import HTTPError, HTTPPool

log = logging.getLogger(__name__)

# Health probes of a server that is down (or not up yet at start) are never further apart than
# this, whatever backoff_max says: a relaunched server is back in use within seconds.
PROBE_INTERVAL_MAX = 10.0


class AdjustableLimiter:
    """A semaphore whose limit can change while it is held (lowering it lets the excess drain)."""

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._used = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def used(self) -> int:
        return self._used

    def set_limit(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._wake()

    async def acquire(self) -> None:
        if self._used < self._limit and not self._waiters:
            self._used += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted just as we were cancelled: give the slot back
            else:
                with contextlib.suppress(ValueError):  # _wake may have dropped it already
                    self._waiters.remove(fut)
            raise

    def release(self) -> None:
        self._used -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._used < self._limit:
            fut = self._waiters.popleft()
            if not fut.done():
                self._used += 1
                fut.set_result(None)


def capacity_from_server_info(info: Any) -> int | None:
    """Requests the server runs at once: ``internal_states[0].effective_max_running_requests_per_dp``
    times ``dp_size`` (SGLang); older servers report ``max_running_requests`` instead."""
    if not isinstance(info, dict):
        return None
    per_dp = None
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        per_dp = states[0].get("effective_max_running_requests_per_dp")
        if per_dp is None:
            per_dp = states[0].get("max_running_requests")
    if per_dp is None:
        per_dp = info.get("max_running_requests")
    if not isinstance(per_dp, int | float) or isinstance(per_dp, bool) or per_dp <= 0:
        return None
    dp = info.get("dp_size") or 1
    if not isinstance(dp, int) or dp < 1:
        dp = 1
    return int(per_dp) * dp


class Endpoint:
    def __init__(
        self,
        url: str,
        *,
        headers: dict[str, str],
        override: int | str,
        factor: float,
        default_concurrency: int,
        connect_timeout: float,
        backoff: Backoff,
    ) -> None:
        self.url = url
        self.pool = HTTPPool(url, connect_timeout=connect_timeout)
        self._headers = headers
        self.override = override
        self.factor = factor
        self.default_concurrency = default_concurrency
        self.server_capacity: int | None = None
        self.limiter = AdjustableLimiter(self._target_limit())
        self.state = "starting"
        self.state_reason = ""
        self.disabled_reason: str | None = None
        self._up = asyncio.Event()
        self._probe_task: asyncio.Task[None] | None = None
        self.probe_backoff = backoff.capped(PROBE_INTERVAL_MAX)
        self.in_flight = 0
        self.completed = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.down_since: float | None = None
        self.relaunches_seen = 0

    # ------------------------------------------------------------------ concurrency
    def _target_limit(self) -> int:
        if isinstance(self.override, int):
            return self.override
        if self.server_capacity is None:
            return self.default_concurrency
        return max(1, math.ceil(self.server_capacity * self.factor))

    def set_override(self, override: int | str) -> None:
        self.override = override
        self._apply_limit()

    def _apply_limit(self) -> None:
        new = self._target_limit()
        if new != self.limiter.limit:
            log.info("%s: concurrency %d -> %d", self.url, self.limiter.limit, new)
            self.limiter.set_limit(new)

    # ------------------------------------------------------------------ health
    @property
    def is_up(self) -> bool:
        return self.state == "up"

    async def wait_up(self) -> None:
        await self._up.wait()

    async def probe(self, timeout: float = 10.0) -> tuple[bool, str]:
        """Ready to serve? ``(False, reason)`` when not."""
        try:
            async with asyncio.timeout(timeout):
                resp = await self.pool.request("GET", "/health", headers=self._headers)
                if resp.status == 404:  # servers without /health: ask for the model list instead
                    resp = await self.pool.request("GET", "/v1/models", headers=self._headers)
        except TimeoutError:
            return False, "health check timed out"
        except HTTPError as e:
            return False, str(e)
        if resp.status in (401, 403):
            return False, f"HTTP {resp.status} (API key rejected)"
        if resp.status != 200:
            return False, f"health: HTTP {resp.status}"
        return True, "ok"

    async def refresh_capacity(self, timeout: float = 10.0) -> None:
        info: Any = None
        try:
            async with asyncio.timeout(timeout):
                for path in ("/server_info", "/get_server_info"):
                    resp = await self.pool.request("GET", path, headers=self._headers)
                    if resp.status == 200:
                        info = resp.json()
                        break
        except (TimeoutError, HTTPError, ValueError) as e:
            log.warning("%s: cannot read server info (%s); concurrency stays %d", self.url, e, self.limiter.limit)
            return
        cap = capacity_from_server_info(info)
        if cap != self.server_capacity:
            if cap is None:
                log.info(
                    "%s: server info has no max running requests; default concurrency %d",
                    self.url,
                    self.default_concurrency,
                )
            else:
                log.info("%s: server runs up to %d requests at once", self.url, cap)
        self.server_capacity = cap
        self._apply_limit()

    def mark_up(self) -> None:
        if self.state != "up":
            if self.down_since is not None:
                log.info("%s: back up after %.1fs", self.url, time.monotonic() - self.down_since)
            self.state = "up"
            self.state_reason = ""
            self.down_since = None
            self._up.set()

    def mark_down(self, reason: str) -> None:
        """Stop sending here and start probing, once (many failing requests call this together)."""
        if self.state in ("down", "disabled"):
            return
        if self.state == "up":
            log.warning("%s: down (%s); its requests wait for it", self.url, reason)
            self.relaunches_seen += 1
        self.state = "down"
        self.state_reason = reason
        self.down_since = time.monotonic()
        self._up.clear()
        if self._probe_task is None or self._probe_task.done():
            self._probe_task = asyncio.create_task(self._recover(), name=f"probe {self.url}")

    def disable(self, reason: str) -> None:
        log.error("%s: taken out of service: %s", self.url, reason)
        self.state = "disabled"
        self.disabled_reason = reason
        self.state_reason = reason
        self._up.clear()

    async def _recover(self) -> None:
        delays = self.probe_backoff.delays()
        last_logged = time.monotonic()
        while self.state == "down":
            ok, reason = await self.probe()
            if ok:
                await self.refresh_capacity()
                if self.state == "down":
                    self.mark_up()
                return
            self.state_reason = reason
            now = time.monotonic()
            if now - last_logged > 60:
                log.info("%s: still down (%s)", self.url, reason)
                last_logged = now
            await asyncio.sleep(next(delays))

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
        await self.pool.close()

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "reason": self.state_reason or None,
            "in_flight": self.in_flight,
            "concurrency": self.limiter.limit,
            "server_capacity": self.server_capacity,
            "completed": self.completed,
            "outages": self.relaunches_seen,
            "errors": dict(self.errors),
            "down_for_s": round(time.monotonic() - self.down_since, 1) if self.down_since else None,
        }
