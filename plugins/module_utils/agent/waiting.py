# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The one wait helper: every polling loop of the agent (unit states, process deaths, teardown,
GPU memory release, a start becoming healthy) waits through it, so each has a monotonic deadline
and reports how long it took in the same way."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(
    ready: Callable[[], bool],
    deadline: float,
    interval: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[bool, float]:
    """Call ``ready`` until it returns true or ``deadline`` (a ``clock`` reading) has passed,
    sleeping ``interval`` seconds between calls (never past the deadline). It is always called
    at least once, so a deadline already past still takes one sample.

    Returns (ready, elapsed): whether it became ready, and the seconds from the start of the wait
    to the end of the last call of ``ready``."""
    start = clock()
    while True:
        done = ready()
        now = clock()
        if done or now >= deadline:
            return done, now - start
        sleep(max(0.0, min(interval, deadline - now)))
