"""Is an endpoint stalled? A server can accept requests and stop producing, /health still 200
(after a SIGKILL and a restart on the same port, after hours of load). The client decides from what
it sees: an endpoint with requests in flight that has completed nothing for ``stall_factor`` times
its longest recent request (at least ``stall_min_s``), while another endpoint completed requests
in that time, is stalled. Its requests in flight are cancelled and requeued (the dispatcher), and
it is probed with small generations until one completes (the endpoint).

The threshold is the endpoint's own: its longest latency among its recent completions, or, before
it completed anything, the longest among every endpoint's. With no completion anywhere yet there is
nothing to compare with, and nothing is called stalled; with one endpoint there is nowhere to send
its work, and nothing is called stalled either.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from sglang_fleet.endpoints import Endpoint


def stall_threshold(ep: Endpoint, endpoints: Sequence[Endpoint], factor: float, floor: float) -> float | None:
    """Seconds of silence after which ``ep`` is stalled; None when there is nothing to derive it from."""
    own = list(ep.latencies)
    basis = own or [lat for other in endpoints for lat in other.latencies]
    if not basis or factor <= 0:
        return None
    return max(floor, factor * max(basis))


def stall_reason(ep: Endpoint, endpoints: Sequence[Endpoint], factor: float, floor: float, now: float) -> str | None:
    """Why ``ep`` is stalled now, or None if it is not."""
    if not ep.usable or ep.in_flight == 0:
        return None
    others = [o for o in endpoints if o is not ep]
    if not any(o.usable for o in others):
        return None
    threshold = stall_threshold(ep, endpoints, factor, floor)
    if threshold is None:
        return None
    silent = now - ep.progress_at
    if silent < threshold:
        return None
    # The others completed meanwhile: the prompts are not simply all long ones.
    if not any(o.last_completion_at is not None and o.last_completion_at > ep.progress_at for o in others):
        return None
    basis = "its longest recent request" if ep.latencies else "the longest recent request of any endpoint"
    longest = max(ep.latencies) if ep.latencies else threshold / factor
    return (
        f"no completion for {silent:.1f}s with {ep.in_flight} request(s) in flight while other endpoints "
        f"completed (threshold {threshold:.1f}s: {factor:g} x {basis}, {longest:.2f}s)"
    )


def check_interval(floor: float) -> float:
    """How often the endpoints are looked at: a quarter of the shortest threshold, within [0.05, 1] s."""
    return min(1.0, max(0.05, floor / 4))


async def watch(
    endpoints: Sequence[Endpoint],
    factor: float,
    floor: float,
    on_stalled: Callable[[Endpoint, str], None],
    stop: asyncio.Event,
) -> None:
    """Look at every endpoint now and then, until ``stop``; ``on_stalled`` for each that stalled."""
    if factor <= 0:
        return
    interval = check_interval(floor)
    while not stop.is_set():
        now = time.monotonic()
        for ep in list(endpoints):
            reason = stall_reason(ep, endpoints, factor, floor, now)
            if reason is not None:
                on_stalled(ep, reason)
        await asyncio.sleep(interval)
