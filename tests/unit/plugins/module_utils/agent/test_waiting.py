"""The one wait helper, on a fake clock."""

from __future__ import annotations

from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.waiting import wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_polls_until_ready_and_says_how_long_it_took() -> None:
    clock = Clock()
    answers = iter([False, False, True])
    assert wait_until(lambda: next(answers), 110.0, 2.0, clock, clock.sleep) == (True, 4.0)
    assert clock.sleeps == [2.0, 2.0]


def test_gives_up_at_the_deadline_without_sleeping_past_it() -> None:
    clock = Clock()
    calls = []
    ready, elapsed = wait_until(lambda: calls.append(clock.now) is not None, 105.0, 2.0, clock, clock.sleep)
    assert (ready, elapsed) == (False, 5.0)
    assert clock.sleeps == [2.0, 2.0, 1.0]
    assert calls == [100.0, 102.0, 104.0, 105.0]  # a last sample at the deadline


def test_a_deadline_already_past_still_takes_one_sample() -> None:
    clock = Clock()
    assert wait_until(lambda: True, 0.0, 1.0, clock, clock.sleep) == (True, 0.0)
    assert wait_until(lambda: False, 0.0, 1.0, clock, clock.sleep) == (False, 0.0)
    assert clock.sleeps == []
