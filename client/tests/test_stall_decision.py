"""The stall decision (stall.py) on endpoints described by their completions: when an endpoint is
stalled, and when it is not (nothing to compare with, nowhere else to send, everyone slow)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from sglang_fleet.stall import check_interval, stall_reason, stall_threshold

NOW = 1000.0


def ep(*latencies: float, in_flight: int = 4, progress_at: float = NOW - 10, last: float | None = None) -> Any:
    return SimpleNamespace(
        usable=True,
        in_flight=in_flight,
        latencies=list(latencies),
        progress_at=progress_at,
        last_completion_at=last if last is not None else (progress_at if latencies else None),
    )


def test_threshold_is_the_endpoints_own_longest_recent_latency_times_the_factor() -> None:
    stuck, other = ep(0.5, 2.0), ep(30.0)
    assert stall_threshold(stuck, [stuck, other], factor=4, floor=1) == 8.0
    assert stall_threshold(stuck, [stuck, other], factor=4, floor=60) == 60.0
    # Before it completed anything: the longest of every endpoint's.
    fresh = ep()
    assert stall_threshold(fresh, [fresh, other], factor=4, floor=1) == 120.0
    assert stall_threshold(fresh, [fresh, ep()], factor=4, floor=1) is None
    assert stall_threshold(stuck, [stuck, other], factor=0, floor=1) is None


def test_silent_past_the_threshold_while_another_completes_is_a_stall() -> None:
    stuck = ep(0.5, 2.0, progress_at=NOW - 8.5)
    other = ep(1.0, last=NOW - 0.1)
    reason = stall_reason(stuck, [stuck, other], factor=4, floor=1, now=NOW)
    assert reason is not None
    assert reason.startswith("no completion for 8.5s with 4 request(s) in flight while other endpoints completed")
    assert "threshold 8.0s: 4 x its longest recent request, 2.00s" in reason
    assert stall_reason(stuck, [stuck, other], factor=4, floor=1, now=NOW - 1) is None  # not yet


def test_no_stall_when_nobody_else_completed_nothing_is_in_flight_or_there_is_nowhere_to_go() -> None:
    stuck = ep(0.5, progress_at=NOW - 100)
    quiet_other = ep(1.0, last=NOW - 200)
    assert stall_reason(stuck, [stuck, quiet_other], factor=4, floor=1, now=NOW) is None
    busy_other = ep(1.0, last=NOW - 1)
    idle = ep(0.5, in_flight=0, progress_at=NOW - 100)
    assert stall_reason(idle, [idle, busy_other], factor=4, floor=1, now=NOW) is None
    assert stall_reason(stuck, [stuck], factor=4, floor=1, now=NOW) is None
    busy_other.usable = False
    assert stall_reason(stuck, [stuck, busy_other], factor=4, floor=1, now=NOW) is None


def test_the_endpoints_are_looked_at_four_times_per_shortest_threshold() -> None:
    assert check_interval(60) == 1.0 and check_interval(0.5) == 0.125 and check_interval(0.01) == 0.05
