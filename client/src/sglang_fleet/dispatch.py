"""Dispatch: the endpoints, one dispatcher per endpoint within its concurrency limit, and what
becomes of each attempt (a record, a retry after backoff, a requeue, or a failure for good)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from sglang_fleet import stall
from sglang_fleet.config import GenerateConfig
from sglang_fleet.control import EXIT_ENDPOINTS, EXIT_FAILURES, EXIT_OK, FatalError, RunControl
from sglang_fleet.endpoints import PROBE_INTERVAL_MAX, Endpoint
from sglang_fleet.httpclient import ConnectError, ConnectionLost, HTTPError
from sglang_fleet.openai_api import (
    COMPACT_JSON,
    AttemptError,
    Kind,
    RequestBuilder,
    classify_status,
    error_detail,
    parse_response,
)
from sglang_fleet.progress import Stats
from sglang_fleet.store import OutputStore
from sglang_fleet.workqueue import WorkItem, WorkQueue

log = logging.getLogger(__name__)

_MAX_UNAVAILABLE = 50  # sends to a server that vanished before a prompt's requeues start counting


class Dispatcher:
    """Sends the queued prompts to the endpoints and writes what comes back.

    Each prompt is sent by one request at a time: a retry is queued only once its attempt has
    ended, so the record written is the one answer that came back."""

    def __init__(
        self,
        cfg: GenerateConfig,
        *,
        api_key: str | None,
        stats: Stats,
        store: OutputStore,
        work: WorkQueue,
        control: RunControl,
        endpoints: list[Endpoint],
        rotate: Callable[[], None],
    ) -> None:
        self.cfg = cfg
        # Each endpoint sends its own copy (a retune may hand one endpoint a new API key).
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._headers = headers
        self.builder = RequestBuilder(cfg)
        self.stats = stats
        self.store = store
        self.work = work
        self.control = control
        self.endpoints = endpoints
        self._rotate = rotate  # closes the open shard once it is due (checked after each record)
        self._retry = cfg.backoff()
        # Each request in flight, with its endpoint and prompt.
        self.inflight: dict[asyncio.Task[None], tuple[Endpoint, WorkItem]] = {}
        self._consecutive_failures = 0
        # Given to every endpoint: called at each of its state changes (the endpoint log).
        self.on_endpoint_event: Callable[[Endpoint, str], None] | None = None

    # ------------------------------------------------------------------ endpoints
    def make_endpoints(self) -> None:
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
                    backoff=self.cfg.backoff(),
                )
            )
            self.endpoints[-1].on_event = self.on_endpoint_event

    async def start_endpoints(self) -> None:
        """Wait (up to startup_timeout) for at least one endpoint; the rest join when they come up."""
        deadline = time.monotonic() + self.cfg.startup_timeout
        reasons: dict[str, str] = {}
        # The probes at start follow the schedule of an endpoint that is down, from a shorter first wait.
        delays = self.cfg.backoff(base=0.5).capped(PROBE_INTERVAL_MAX).delays()
        while True:
            # A drained endpoint is not probed: its resume (or lapsed lease) checks it.
            pending = [ep for ep in self.endpoints if ep.state == "starting" and not ep.drained]
            results = await asyncio.gather(*(ep.probe() for ep in pending))
            for ep, (ok, reason) in zip(pending, results, strict=True):
                if ep.state != "starting" or ep.drained:
                    continue  # drained (or resumed) while probed: that decides
                if ok:
                    await ep.refresh_capacity()
                    if ep.key_rejected is not None:
                        ep.disable(ep.key_rejected)
                        continue
                    ep.mark_up()
                    log.info("%s: up, concurrency %d", ep.url, ep.limiter.limit)
                elif "API key" in reason:
                    ep.disable(reason)
                else:
                    reasons[ep.url] = reason
            if any(ep.usable for ep in self.endpoints):
                break
            if all(ep.state == "disabled" for ep in self.endpoints):
                raise FatalError(
                    "no endpoint accepts the API key: "
                    + "; ".join(f"{ep.url}: {ep.disabled_reason}" for ep in self.endpoints),
                    EXIT_ENDPOINTS,
                )
            # A drain bounds itself (its lease), so waiting for a drained endpoint is not waiting forever.
            drained = any(ep.drained and ep.state == "starting" for ep in self.endpoints)
            if time.monotonic() >= deadline and not drained:
                detail = "; ".join(f"{u}: {r}" for u, r in reasons.items())
                raise FatalError(f"no endpoint reachable after {self.cfg.startup_timeout:g}s: {detail}", EXIT_ENDPOINTS)
            if await self.control.sleep_or_stop(min(next(delays), max(0.0, deadline - time.monotonic()))):
                raise FatalError("stopped while waiting for endpoints", EXIT_OK)
        for ep in self.endpoints:
            if ep.state == "starting" and not ep.drained:
                ep.mark_down(reasons.get(ep.url, "not ready at start"))

    # ------------------------------------------------------------------ sending
    async def dispatch(self, ep: Endpoint) -> None:
        control = self.control
        while not control.stop.is_set():
            if not ep.usable:
                # A disabled endpoint (its server refused the API key, or the path) waits too: a
                # retune that hands it a new key brings it back; none left usable ends the run.
                if ep.state == "disabled":
                    self._fail_if_all_disabled("every endpoint refused the requests")
                await ep.wait_up()
                continue
            if control.paused:
                await control.wait_unpaused()
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
            if not ep.usable or control.paused or control.stop.is_set():
                self.work.requeue(item, 0.0)
                self.work.done_with()
                ep.limiter.release()
                continue
            # Counted in flight from here, synchronously: a drain that comes before the task first
            # runs must wait for it.
            task = asyncio.create_task(self._attempt(ep, item))
            ep.note_sent()
            ep.in_flight += 1
            ep.peak_in_flight = max(ep.peak_in_flight, ep.in_flight)
            self.inflight[task] = (ep, item)
            task.add_done_callback(self._ended)
            if len(self.endpoints) > 1:
                # Without a yield here, the first endpoint's dispatcher would take every queued
                # prompt while it has free slots, and the others would wait for the next batch.
                await asyncio.sleep(0)

    async def drain(self) -> None:
        """Let the requests in flight finish, up to drain_timeout (or a second stop signal)."""
        if self.inflight:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.drain_timeout):
                    drain: asyncio.Future[Any] = asyncio.gather(*list(self.inflight), return_exceptions=True)
                    hard: asyncio.Future[Any] = asyncio.create_task(self.control.hard_stop.wait())
                    await asyncio.wait([drain, hard], return_when=asyncio.FIRST_COMPLETED)
                    hard.cancel()
        left = [t for t in self.inflight if not t.done()]
        if left:
            log.warning("drain deadline: abandoning %d request(s); they are sent again at the next start", len(left))
            for t in left:
                t.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A request's end, however it ended (a done callback: this runs even for a task cancelled
        before it started)."""
        ep, item = self.inflight.pop(task)
        ep.in_flight -= 1
        ep.limiter.release()
        if item.abandoned:
            item.abandoned = False
            if task.cancelled():
                # Abandoned by a drain's deadline: no record was written (see _attempt), so the
                # prompt goes back to the queue, before done_with, which may end the run.
                self.work.requeue(item, 0.0)
        self.work.done_with()

    async def wait_drained(self, endpoints: list[Endpoint], timeout: float) -> int:
        """Wait until no request to ``endpoints`` is in flight, for at most ``timeout`` seconds; then
        cancel the attempts still open at endpoints still drained, and requeue their prompts for the
        other endpoints. Returns how many were abandoned. The endpoints are drained already, so no new
        request to them starts meanwhile."""
        targets = set(endpoints)
        tasks = [t for t, (ep, _unused) in self.inflight.items() if ep in targets]
        if tasks and timeout > 0:
            await asyncio.wait(tasks, timeout=timeout)
        left = [t for t in tasks if not t.done() and self.inflight[t][0].drained]
        for t in left:
            self.inflight[t][1].abandoned = True
            t.cancel()
        if left:
            await asyncio.wait(left)  # a cancelled attempt ends at its next step
        return sum(1 for t in left if t.cancelled())

    # ------------------------------------------------------------------ stalls
    async def watch_stalls(self) -> None:
        """Until the run stops: route around an endpoint that stalls (stall.py)."""
        cfg = self.cfg
        await stall.watch(self.endpoints, cfg.stall_factor, cfg.stall_min_s, self.on_stalled, self.control.stop)

    def on_stalled(self, ep: Endpoint, reason: str) -> None:
        """Stop sending to ``ep``, cancel what is in flight there and requeue it for the others (no
        record was written for a cancelled attempt, so each prompt is still done once), and probe
        it with a generation that may take as long as the threshold it was judged by."""
        timeout = stall.stall_threshold(ep, self.endpoints, self.cfg.stall_factor, self.cfg.stall_min_s)
        probe_timeout = timeout if timeout is not None else self.cfg.stall_min_s
        if not ep.stall(reason, lambda: self._generation_probe(ep, probe_timeout)):
            return
        tasks = [t for t, (e, _unused) in self.inflight.items() if e is ep]
        for t in tasks:
            self.inflight[t][1].abandoned = True
            t.cancel()
        ep.requeued_on_stall += len(tasks)
        log.warning("%s: %d request(s) in flight there requeued for the other endpoints", ep.url, len(tasks))

    async def _generation_probe(self, ep: Endpoint, timeout: float) -> tuple[bool | None, str]:
        try:
            async with asyncio.timeout(timeout):
                resp = await ep.pool.request(
                    "POST", self.builder.path, body=self.builder.probe_body(), headers=ep.headers
                )
        except TimeoutError:
            return False, f"a one-token generation did not finish within {timeout:.1f}s"
        except (ConnectError, ConnectionLost) as e:
            return None, str(e)
        except HTTPError as e:
            return False, f"bad HTTP answer: {e}"
        if resp.status != 200:
            return False, f"a one-token generation answered HTTP {resp.status}"
        return True, "ok"

    async def _attempt(self, ep: Endpoint, item: WorkItem) -> None:
        body = self.builder.body(item.prompt)
        item.sends += 1
        started_wall = time.time()
        t0 = time.monotonic()
        try:
            try:
                async with asyncio.timeout(self.cfg.request_timeout):
                    resp = await ep.pool.request("POST", self.builder.path, body=body, headers=ep.headers)
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
        if item.abandoned:
            # Cannot happen (nothing is awaited between the answer and here, and a cancel is taken at
            # an await), but a cancelled attempt must never also write: its prompt is requeued.
            raise asyncio.CancelledError
        self.store.append_record(item.prompt.id, line)
        self.stats.succeeded += 1
        ep.completed += 1
        ep.note_completed(latency)
        self._consecutive_failures = 0
        if comp.usage:
            self.stats.prompt_tokens += int(comp.usage.get("prompt_tokens") or 0)
            self.stats.completion_tokens += int(comp.usage.get("completion_tokens") or 0)
            self.stats.reasoning_tokens += int(comp.usage.get("reasoning_tokens") or 0)
        if self.store.rotation_due():
            self._rotate()

    def _on_error(self, ep: Endpoint, item: WorkItem, err: AttemptError) -> None:
        ep.errors[err.kind.value] += 1
        ep.last_error = err.reason
        self.stats.errors[err.kind.value] += 1
        item.last_error = err.reason
        cfg = self.cfg
        if ep.drained and err.kind is not Kind.PERMANENT:
            # A retune is relaunching this server: its errors count against neither the prompt nor
            # the endpoint (no attempt used, not marked down); the prompt goes to the other endpoints.
            self.work.requeue(item, 0.0)
            return
        if err.kind is Kind.UNAVAILABLE:
            ep.mark_down(err.reason)
            item.unavailable += 1
            self.stats.requeued_unavailable += 1
            if item.unavailable <= _MAX_UNAVAILABLE:
                self.work.requeue(item, 0.0)
                return
            item.unavailable = 0
        elif err.kind is Kind.THROTTLED:
            self.work.requeue(item, self._retry.delay(item.sends))
            return
        elif err.kind is Kind.ENDPOINT:
            ep.disable(err.reason)
            self.work.requeue(item, 0.0)
            self._fail_if_all_disabled("every endpoint refused the requests")
            return
        item.attempts += 1
        if err.kind is Kind.RETRY and item.attempts < cfg.max_attempts:
            self.stats.retries += 1
            log.debug("%s: %s (attempt %d of %d)", item.prompt.id, err.reason, item.attempts, cfg.max_attempts)
            self.work.requeue(item, self._retry.delay(item.attempts))
            return
        self._record_failure(ep, item, err)

    def _fail_if_all_disabled(self, words: str) -> None:
        """End the run (exit 3) once every endpoint is out of service, naming each one's reason."""
        if self.control.fatal is None and all(e.state == "disabled" for e in self.endpoints):
            self.control.fail(
                FatalError(
                    f"{words}: " + "; ".join(f"{e.url}: {e.disabled_reason}" for e in self.endpoints),
                    EXIT_ENDPOINTS,
                ),
                "no usable endpoint",
            )

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
        if limit and self._consecutive_failures >= limit and self.control.fatal is None:
            self.control.fail(
                FatalError(
                    f"{self._consecutive_failures} prompts failed in a row (last: {err.reason}); stopping, since "
                    "this usually means a bad request setting. Fix it, then run again with --retry-failed",
                    EXIT_FAILURES,
                ),
                "too many failures",
            )
