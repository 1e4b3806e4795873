"""One model server: its connection pool, its concurrency limit, and whether it is up.

A server that refuses connections or answers 503 is *down*: nothing is sent to it, and one task
probes ``/health`` with exponential backoff and jitter until it answers 200, then re-reads
``/server_info`` (a relaunch may have changed its capacity) and opens it again.

Apart from its health, an endpoint can be *drained* through the control socket (a retune relaunching
its server): nothing new is sent to it, it is not probed, and its errors count against nothing. A
drain ends with a resume, another drain, or its lease; the endpoint then proves itself with
``/health`` and ``/server_info`` before it is used again.

An endpoint is *stalled* when it accepts requests and completes none (``stall.py`` decides from its
recent completion times): nothing is sent to it, and one task sends it a small generation now and
then; when one completes it is used again. /health is no proof here: a stalled server answers it.

Each endpoint keeps, cheaply (work at state changes only), how long it served and how long it did
not since it was first up, and its last not-serving intervals, for status.json and the endpoint log.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sglang_fleet.backoff import Backoff
from sglang_fleet.httpclient import HTTPError, HTTPPool

log = logging.getLogger(__name__)

# Health probes of a server that is down (or not up yet at start) are never further apart than
# this, whatever backoff_max says: a relaunched server is back in use within seconds.
PROBE_INTERVAL_MAX = 10.0
# How long a resume (or a lapsed drain) waits for the server's /health and /server_info before the
# endpoint goes down and is probed as usual.
RESUME_TIMEOUT_S = 30.0
_RESUME_BACKOFF = Backoff(0.2, 2.0)
# Not-serving intervals kept per endpoint (status.json).
INTERVALS_KEPT = 100
# Recent request latencies kept per endpoint: the stall threshold is derived from them.
LATENCIES_KEPT = 64

# A generation probe of a stalled endpoint: True it completed, False it did not (timed out, an
# error answer), None the server is away (connection refused or lost); and why.
GenerationProbe = Callable[[], Awaitable[tuple[bool | None, str]]]

# The capacity ledger's segments: before the first "up" nothing counts; then the endpoint is serving
# (up and not drained) or not (drained, or down/starting/disabled).
_PRE, _SERVING, _DRAINED, _DOWN, _STALLED = "pre", "serving", "drained", "down", "stalled"


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


def key_rejection(status: int) -> str:
    """The reason given for a server that refuses this client's API key (the words "API key" mark
    it: such an endpoint is taken out of service, not probed again, until a new key comes)."""
    return f"HTTP {status} (API key rejected)"


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
        # Its own copy: a retune that relaunches this server with another API key hands the new key
        # to this endpoint alone (set_api_key), while the others still run with the old one.
        self.headers = dict(headers)
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
        self.peak_in_flight = 0  # since the last change of the concurrency limit
        self.completed = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.last_error = ""  # the reason of the last failed attempt here
        self.down_since: float | None = None
        self.relaunches_seen = 0
        # Why the server refused this client's API key at its last /server_info read; None if not.
        self.key_rejected: str | None = None
        # Completions (stall.py): recent latencies, the last completion, and the start of the
        # current silence (a completion, the endpoint coming up, or its first request after idling).
        self.latencies: collections.deque[float] = collections.deque(maxlen=LATENCIES_KEPT)
        self.last_completion_at: float | None = None
        self.progress_at = time.monotonic()
        self.stalls = 0
        self.stalled_since: float | None = None
        self.requeued_on_stall = 0
        # Called with (endpoint, event) at each state change: up, down, drained, resumed, capacity.
        self.on_event: Callable[[Endpoint, str], None] | None = None
        # Drains (control socket).
        self.drained = False
        self.drained_by = ""
        self.drains = 0
        self._drain_seq = 0  # bumped by every drain and resume: a slower resume check then stands down
        self._lease: asyncio.TimerHandle | None = None
        self._resume_task: asyncio.Task[int | None] | None = None
        # The capacity ledger (see _account).
        self._segment = _PRE
        self._segment_since = time.monotonic()
        self.serving_s = 0.0
        self.not_serving_s = 0.0
        self.drained_s = 0.0
        self.intervals: collections.deque[dict[str, Any]] = collections.deque(maxlen=INTERVALS_KEPT)

    # ------------------------------------------------------------------ concurrency
    @property
    def follows_server(self) -> bool:
        """Auto concurrency: the limit is the server's capacity x ``factor`` (a fixed one is not)."""
        return not isinstance(self.override, int)

    def _target_limit(self) -> int:
        if isinstance(self.override, int):
            return self.override  # a fixed concurrency
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
            self.peak_in_flight = self.in_flight
            self._emit("capacity")

    # ------------------------------------------------------------------ state changes
    @property
    def usable(self) -> bool:
        """Requests may be sent here: up and not drained."""
        return self.state == "up" and not self.drained

    def _emit(self, event: str) -> None:
        if self.on_event is not None:
            self.on_event(self, event)

    def _changed(self) -> None:
        """After any change of state or drain: wake or hold the dispatcher, and keep the ledger."""
        if self.usable:
            self._up.set()
        else:
            self._up.clear()
        self._account()

    def _account(self) -> None:
        if self.usable:
            segment = _SERVING
        elif self._segment == _PRE:
            return  # not up yet since the run started: nothing lost so far
        else:
            segment = _DRAINED if self.drained else _STALLED if self.state == "stalled" else _DOWN
        if segment == self._segment:
            return
        now = time.monotonic()
        self._close_segment(now)
        if segment != _SERVING:
            self.intervals.append({"from": round(time.time(), 3), "to": None, "why": segment})
        self._segment = segment
        self._segment_since = now

    def _close_segment(self, now: float) -> None:
        dt = now - self._segment_since
        if self._segment == _SERVING:
            self.serving_s += dt
        elif self._segment != _PRE:
            self.not_serving_s += dt
            if self._segment == _DRAINED:
                self.drained_s += dt
            if self.intervals and self.intervals[-1]["to"] is None:
                self.intervals[-1]["to"] = round(time.time(), 3)

    def ledger(self) -> dict[str, float]:
        """Seconds served, not served (since first up) and drained, the current segment included."""
        dt = time.monotonic() - self._segment_since
        serving, not_serving, drained = self.serving_s, self.not_serving_s, self.drained_s
        if self._segment == _SERVING:
            serving += dt
        elif self._segment != _PRE:
            not_serving += dt
            if self._segment == _DRAINED:
                drained += dt
        return {"serving_s": round(serving, 3), "not_serving_s": round(not_serving, 3), "drained_s": round(drained, 3)}

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
                resp = await self.pool.request("GET", "/health", headers=self.headers)
                if resp.status == 404:  # servers without /health: ask for the model list instead
                    resp = await self.pool.request("GET", "/v1/models", headers=self.headers)
        except TimeoutError:
            return False, "health check timed out"
        except HTTPError as e:
            return False, str(e)
        if resp.status in (401, 403):
            return False, key_rejection(resp.status)
        if resp.status != 200:
            return False, f"health: HTTP {resp.status}"
        return True, "ok"

    async def refresh_capacity(self, timeout: float = 10.0) -> bool:
        """Re-read the server's capacity and apply it; False if /server_info could not be read."""
        info: Any = None
        try:
            async with asyncio.timeout(timeout):
                for path in ("/server_info", "/get_server_info"):
                    resp = await self.pool.request("GET", path, headers=self.headers)
                    if resp.status in (401, 403):
                        # SGLang exempts /health from its API key, not /server_info: a server that
                        # answers /health may still refuse every request of this client.
                        self.key_rejected = key_rejection(resp.status)
                        log.warning("%s: %s on %s", self.url, self.key_rejected, path)
                        return False
                    if resp.status == 200:
                        info = resp.json()
                        break
        except (TimeoutError, HTTPError, ValueError) as e:
            log.warning("%s: cannot read server info (%s); concurrency stays %d", self.url, e, self.limiter.limit)
            return False
        self.key_rejected = None
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
        return True

    def mark_up(self) -> None:
        if self.state != "up":
            if self.stalled_since is not None:
                log.info("%s: completes again after a stall of %.1fs", self.url, time.monotonic() - self.stalled_since)
            elif self.down_since is not None:
                log.info("%s: back up after %.1fs", self.url, time.monotonic() - self.down_since)
            self.state = "up"
            self.state_reason = ""
            self.down_since = None
            self.stalled_since = None
            self.progress_at = time.monotonic()
            self._changed()
            self._emit("up")

    # ------------------------------------------------------------------ completions and stalls
    def note_sent(self) -> None:
        """A request is sent: the first after the endpoint idled starts a new silence."""
        if self.in_flight == 0:
            self.progress_at = time.monotonic()

    def note_completed(self, latency: float) -> None:
        now = time.monotonic()
        self.latencies.append(latency)
        self.last_completion_at = now
        self.progress_at = now

    def stall(self, reason: str, probe: GenerationProbe) -> bool:
        """Stop sending here (the caller requeues what is in flight) and probe with generations
        until one completes. Only an endpoint in use stalls; returns whether this one did."""
        if not self.usable:
            return False
        log.warning("%s: stalled (%s); its requests go to the other endpoints", self.url, reason)
        self.state = "stalled"
        self.state_reason = reason
        self.stalled_since = time.monotonic()
        self.stalls += 1
        self._changed()
        self._emit("stalled")
        self._probe_task = asyncio.create_task(self._recover_stalled(probe), name=f"stall probe {self.url}")
        return True

    async def _recover_stalled(self, probe: GenerationProbe) -> None:
        delays = self.probe_backoff.delays()
        while self.state == "stalled" and not self.drained:
            try:
                ok, reason = await probe()
            except Exception as e:  # a probe that broke says nothing about the server: try again
                ok, reason = False, f"probe failed: {e!r}"
            if self.state != "stalled" or self.drained:
                return  # drained (a retune relaunching it) or taken out meanwhile: that decides
            if ok:
                await self.refresh_capacity()
                self.mark_up()
                return
            if ok is None:
                # The server is away (relaunched, crashed): probed for health as any endpoint down.
                self._probe_task = None
                self._go_down(reason)
                return
            self.state_reason = f"{self.state_reason.split('; probe: ')[0]}; probe: {reason}"
            await asyncio.sleep(next(delays))

    def mark_down(self, reason: str) -> None:
        """Stop sending here and start probing, once (many failing requests call this together).
        A drained endpoint is left alone: its server is being relaunched, and its resume checks it;
        a stalled one too (its requests were requeued and end in errors; its probe decides)."""
        if self.state in ("down", "disabled", "stalled") or self.drained:
            return
        self._go_down(reason)

    def _go_down(self, reason: str) -> None:
        was_down = self.state == "down"
        if self.state == "up":
            log.warning("%s: down (%s); its requests wait for it", self.url, reason)
            self.relaunches_seen += 1
        self.state = "down"
        self.state_reason = reason
        self.stalled_since = None
        if not was_down:
            self.down_since = time.monotonic()
        self._changed()
        if not was_down:
            self._emit("down")
        if self._probe_task is None or self._probe_task.done():
            self._probe_task = asyncio.create_task(self._recover(), name=f"probe {self.url}")

    def disable(self, reason: str) -> None:
        log.error("%s: taken out of service: %s", self.url, reason)
        self.state = "disabled"
        self.disabled_reason = reason
        self.state_reason = reason
        self._changed()
        self._emit("down")

    # ------------------------------------------------------------------ drain and resume
    def drain(self, lease: float, by: str) -> None:
        """Send nothing more here (the caller waits for the requests in flight) until a resume, or
        until ``lease`` seconds from now, whichever comes first. A new drain renews the lease."""
        self._drain_seq += 1
        self._cancel_lease()
        self._lease = asyncio.get_running_loop().call_later(lease, self._lease_lapsed, by, lease)
        self.drained_by = by
        if self.drained:
            return
        self.drained = True
        self.drains += 1
        if self._probe_task is not None:  # a drained endpoint is not probed
            self._probe_task.cancel()
            self._probe_task = None
        self._changed()
        self._emit("drained")

    def _cancel_lease(self) -> None:
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None

    def _lease_lapsed(self, by: str, lease: float) -> None:
        self._lease = None
        if not self.drained:
            return
        log.warning("%s: the drain asked by %s lapsed after %gs without a resume; using it again", self.url, by, lease)
        self._resume_task = asyncio.create_task(self.resume(), name=f"lapsed drain {self.url}")

    def set_api_key(self, key: str) -> bool:
        """Send ``key`` (empty: none) to this server from now on. True if it changed."""
        old = self.headers.get("Authorization")
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        else:
            self.headers.pop("Authorization", None)
        return self.headers.get("Authorization") != old

    async def resume(self, timeout: float = RESUME_TIMEOUT_S, api_key: str | None = None) -> int | None:
        """End a drain: check the server (``/health``, then its capacity from ``/server_info``) for at
        most ``timeout`` seconds, then use it again, or, if it does not answer, mark it down (and probe
        it as usual); if it refuses the API key, take it out of service. ``api_key`` (not None): the
        key to send from now on (a retune that relaunched the server with another key hands it over
        here); an endpoint taken out of service for a refused key is checked again with it.
        Returns the concurrency limit now in force, or None if the endpoint is not usable."""
        self._cancel_lease()
        self._drain_seq += 1
        seq = self._drain_seq
        if api_key is not None and self.set_api_key(api_key):
            log.info("%s: a new API key was handed over", self.url)
            if self.state == "disabled" and "API key" in (self.disabled_reason or ""):
                self.state, self.disabled_reason = "starting", None
        if self.state == "disabled":
            self._undrain()
            return None
        self.pool.drop_idle()  # connections to the server before its relaunch are dead
        ok, reason = await self._check_back(timeout)
        if seq != self._drain_seq:
            return None  # a drain or another resume came meanwhile: it decides
        if self.state == "disabled":  # refused the API key meanwhile
            self._undrain()
            return None
        if not ok and "API key" in reason:
            # Waiting would not help: the client lacks the key the server was relaunched with.
            self.drained = False
            self._emit("resumed")
            self.disable(reason)
            return None
        # The state is settled before the drain is lifted, so the ledger goes straight from drained
        # to serving (or to down).
        was_drained, self.drained = self.drained, False
        if was_drained:
            self._emit("resumed")
        if not ok:
            self._go_down(f"not ready after resume: {reason}")
            return None
        if self.state != "up":
            self.mark_up()
        else:
            self._changed()
        return self.limiter.limit

    def _undrain(self) -> None:
        if self.drained:
            self.drained = False
            self._changed()
            self._emit("resumed")

    async def _check_back(self, timeout: float) -> tuple[bool, str]:
        deadline = time.monotonic() + timeout
        delays = _RESUME_BACKOFF.delays()
        reason = f"no answer within {timeout:g}s"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False, reason
            ok, reason = await self.probe(timeout=min(10.0, left))
            if ok:
                await self.refresh_capacity(timeout=max(0.5, min(10.0, deadline - time.monotonic())))
                if self.key_rejected is not None:
                    return False, self.key_rejected
                return True, "ok"
            if "API key" in reason:
                return False, reason
            await asyncio.sleep(max(0.0, min(next(delays), deadline - time.monotonic())))

    async def _recover(self) -> None:
        delays = self.probe_backoff.delays()
        last_logged = time.monotonic()
        while self.state == "down" and not self.drained:
            ok, reason = await self.probe()
            if ok:
                await self.refresh_capacity()
                if self.state == "down" and not self.drained:
                    if self.key_rejected is not None:
                        self.disable(self.key_rejected)
                    else:
                        self.mark_up()
                return
            self.state_reason = reason
            now = time.monotonic()
            if now - last_logged > 60:
                log.info("%s: still down (%s)", self.url, reason)
                last_logged = now
            await asyncio.sleep(next(delays))

    async def close(self) -> None:
        self._cancel_lease()
        for task in (self._probe_task, self._resume_task):
            if task is not None:
                task.cancel()
        await self.pool.close()

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "reason": self.state_reason or None,
            "drained": self.drained,
            "drained_by": self.drained_by if self.drained else None,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "concurrency": self.limiter.limit,
            "capacity": self.limiter.limit,
            "server_capacity": self.server_capacity,
            "completed": self.completed,
            "outages": self.relaunches_seen,
            "errors": dict(self.errors),
            "down_for_s": round(time.monotonic() - self.down_since, 1) if self.down_since else None,
            "stalls": self.stalls,
            "requeued_on_stall": self.requeued_on_stall,
            "stalled_for_s": round(time.monotonic() - self.stalled_since, 1) if self.stalled_since else None,
            "longest_recent_latency_s": round(max(self.latencies), 3) if self.latencies else None,
            **self.ledger(),
            "drains": self.drains,
            "intervals": [dict(i) for i in self.intervals],
        }
