"""The one retry schedule of the client: exponential backoff with jitter, capped.

Every wait before trying again (a throttled or failed request, a health probe of a server that is
down, reading or writing S3) takes its delay from here, so ``backoff_max`` bounds all of them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

# Each delay is its nominal value times a factor drawn from [0.5, 1]: clients that failed together
# (a server relaunch drops every connection at once) spread their retries instead of arriving in a
# burst. Jitter only shortens a delay, so the cap holds for every delay returned.
JITTER_LOW = 0.5


@dataclass(frozen=True, slots=True)
class Backoff:
    """``delay(n)`` after the n-th failure in a row (n >= 1): ``base * 2**(n - 1)``, at most ``cap``,
    times the jitter. The nominal delay never decreases as n grows. Delays are durations, to be
    waited with the monotonic clock (asyncio timeouts, ``time.monotonic`` deadlines), so a change
    of the wall clock never stretches or skips a wait."""

    base: float
    cap: float

    def nominal(self, n: int) -> float:
        # The exponent stops at 1023: 2.0 ** 1024 raises OverflowError, and the cap is reached long before.
        return min(self.cap, self.base * 2.0 ** max(0, min(n - 1, 1023)))

    def delay(self, n: int) -> float:
        return self.nominal(n) * random.uniform(JITTER_LOW, 1.0)

    def delays(self) -> Iterator[float]:
        """The delays after the first, second, ... failure in a row; start a new iterator after a
        success."""
        n = 0
        while True:
            n += 1
            yield self.delay(n)

    def capped(self, cap: float) -> Backoff:
        """The same schedule under a tighter cap (never a looser one)."""
        return Backoff(self.base, min(self.cap, cap))
