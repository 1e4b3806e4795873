"""The one backoff schedule, and that ``backoff_max`` bounds every wait that uses it: request
retries, health probes (at start and after an outage), and each S3 retry loop. The loop tests give
each wait a first delay of seconds and a cap of a few milliseconds, so a loop that ignored the cap
would take seconds where these tests allow a fraction of one."""

from __future__ import annotations

import asyncio
import collections
import random
import time
import types
from pathlib import Path
from typing import Any

import pytest

from sglang_fleet import uploads as uploads_mod
from sglang_fleet.backoff import JITTER_LOW, Backoff
from sglang_fleet.config import GenerateConfig, build_config
from sglang_fleet.control import RunControl
from sglang_fleet.dispatch import Dispatcher
from sglang_fleet.endpoints import Endpoint
from sglang_fleet.openai_api import AttemptError, Kind
from sglang_fleet.progress import Stats
from sglang_fleet.prompts import Prompt
from sglang_fleet.uploads import Uploads
from sglang_fleet.workqueue import WorkItem, WorkQueue

CAP = 0.005  # seconds: every wait in these tests is at most this
TOO_SLOW = 1.0  # what a loop that waited its uncapped first delay (2 s or more) would exceed


def test_schedule_doubles_up_to_the_cap_with_jitter_below() -> None:
    b = Backoff(base=1.0, cap=10.0)
    assert [b.nominal(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    random.seed(7)
    for n in range(1, 40):
        d = b.delay(n)
        assert JITTER_LOW * b.nominal(n) <= d <= b.nominal(n) <= 10.0


def test_nominal_delay_never_decreases_and_never_overflows() -> None:
    b = Backoff(base=0.25, cap=60.0)
    nominal = [b.nominal(n) for n in range(0, 5000)]
    assert nominal == sorted(nominal)
    assert nominal[-1] == 60.0


def test_cap_holds_when_the_base_is_above_it_and_capped_only_tightens() -> None:
    b = Backoff(base=30.0, cap=2.0)
    assert max(b.delay(n) for n in range(1, 50)) <= 2.0
    assert b.capped(0.5).cap == 0.5
    assert b.capped(99.0).cap == 2.0


def test_delays_iterator_counts_failures_from_one() -> None:
    random.seed(1)
    it = Backoff(base=1.0, cap=100.0).delays()
    got = [next(it) for _ in range(5)]
    for n, d in enumerate(got, start=1):
        assert 2 ** (n - 1) * JITTER_LOW <= d <= 2 ** (n - 1)


def test_config_backoff_keeps_backoff_max_whatever_the_base() -> None:
    cfg = _cfg(backoff_base=3.0, backoff_max=0.5)
    assert cfg.backoff() == Backoff(3.0, 0.5)
    assert cfg.backoff(base=100.0).cap == 0.5


# ---------------------------------------------------------------------- every wait honours the cap
def _cfg(tmp: Path | None = None, **values: Any) -> GenerateConfig:
    base: dict[str, Any] = {"prompts": "p.jsonl", "output": str(tmp or "out"), "endpoints": ["http://127.0.0.1:9"]}
    return build_config({**base, **values}, {}, environ={})


def _capped_cfg(tmp: Path, **values: Any) -> GenerateConfig:
    # A base far above the cap: only the cap can make these waits short.
    return _cfg(tmp, backoff_base=5.0, backoff_max=CAP, **values)


def _control(cfg: GenerateConfig, endpoints: list[Endpoint] | None = None) -> RunControl:
    return RunControl(cfg, endpoints if endpoints is not None else [], lambda coro, name: coro.close())


def test_request_retries_and_throttling_wait_at_most_backoff_max(tmp_path: Path) -> None:
    cfg = _capped_cfg(tmp_path, max_attempts=100)
    delays: list[float] = []
    work = types.SimpleNamespace(requeue=lambda item, delay: delays.append(delay))
    d = Dispatcher(
        cfg,
        api_key=None,
        stats=Stats(),
        store=None,  # type: ignore[arg-type]  (not reached: no record, no failure)
        work=work,  # type: ignore[arg-type]
        control=_control(cfg),
        endpoints=[],
        rotate=lambda: None,
    )
    ep: Any = types.SimpleNamespace(errors=collections.Counter(), drained=False)
    item = WorkItem(Prompt(id="a", line=1, data={"prompt": "x"}))
    for n in range(1, 30):
        item.sends = n
        d._on_error(ep, item, AttemptError(Kind.THROTTLED, "HTTP 429"))
        d._on_error(ep, item, AttemptError(Kind.RETRY, "HTTP 500"))
    assert len(delays) == 58
    assert max(delays) <= CAP


def _probes_fail_first(ep: Endpoint, failures: int) -> list[int]:
    """Makes the health probes of ``ep`` fail ``failures`` times, then succeed, and its capacity read
    a no-op (there is no server). Returns the number of probes so far, in a list that they update."""
    calls = [0]

    async def probe(timeout: float = 10.0) -> tuple[bool, str]:
        calls[0] += 1
        return (True, "ok") if calls[0] > failures else (False, "refused")

    async def refresh(timeout: float = 10.0) -> None:
        return None

    ep.probe = probe  # type: ignore[method-assign]
    ep.refresh_capacity = refresh  # type: ignore[method-assign]
    return calls


async def _timed(coro: Any) -> float:
    t0 = time.monotonic()
    async with asyncio.timeout(10):
        await coro
    return time.monotonic() - t0


def test_health_probes_of_a_down_endpoint_wait_at_most_backoff_max() -> None:
    async def main() -> float:
        ep = Endpoint(
            "http://127.0.0.1:9",
            headers={},
            override=4,
            factor=1.0,
            default_concurrency=4,
            connect_timeout=1,
            backoff=Backoff(5.0, CAP),
        )
        calls = _probes_fail_first(ep, 5)
        ep.mark_up()
        ep.mark_down("refused")
        elapsed = await _timed(ep.wait_up())
        assert calls[0] == 6
        await ep.close()
        return elapsed

    assert asyncio.run(main()) < TOO_SLOW


def test_health_probes_at_start_wait_at_most_backoff_max(tmp_path: Path) -> None:
    async def main() -> float:
        cfg = _capped_cfg(tmp_path, startup_timeout=30)
        endpoints: list[Endpoint] = []
        d = Dispatcher(
            cfg,
            api_key=None,
            stats=Stats(),
            store=None,  # type: ignore[arg-type]
            work=WorkQueue(1),
            control=_control(cfg, endpoints),
            endpoints=endpoints,
            rotate=lambda: None,
        )
        d.make_endpoints()
        (ep,) = endpoints
        calls = _probes_fail_first(ep, 5)
        elapsed = await _timed(d.start_endpoints())
        assert ep.is_up and calls[0] == 6
        await ep.close()
        return elapsed

    assert asyncio.run(main()) < TOO_SLOW


class _FakeStore:
    def __init__(self) -> None:
        self.job: dict[str, Any] = {}

    def job_state(self) -> dict[str, Any]:
        return dict(self.job)

    def update_job_state(self, **values: Any) -> None:
        self.job.update(values)


class _FlakyS3:
    """Fails the first ``failures`` calls of adopt_remote and sync_once."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        self.state = types.SimpleNamespace(last_error=None, last_error_at=None, uploaded=0)

    def _call(self) -> int:
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError("connection refused")
        return 0

    def adopt_remote(self, *, merge_failures: bool) -> int:
        return self._call()

    def abort_stale_multipart(self) -> int:
        return 0

    def sync_once(self) -> int:
        return self._call()

    def pending(self) -> list[object]:
        return []


def _uploads(tmp_path: Path, **s3: Any) -> Uploads:
    cfg = _capped_cfg(tmp_path, s3={"uri": "s3://bucket/prefix", **s3})
    return Uploads(cfg, _FakeStore(), _control(cfg))  # type: ignore[arg-type]


def test_reading_s3_state_at_start_retries_within_backoff_max(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FlakyS3(failures=5)
    monkeypatch.setattr(uploads_mod, "S3Sync", lambda *a, **k: fake)
    up = _uploads(tmp_path)
    assert asyncio.run(_timed(up.adopt_remote_state(total=1))) < TOO_SLOW
    assert fake.calls == 6


def test_final_upload_retries_within_backoff_max(tmp_path: Path) -> None:
    up = _uploads(tmp_path, final_sync_timeout=0)  # 0: until everything is uploaded
    up.s3 = fake = _FlakyS3(failures=5)
    assert asyncio.run(_timed(up.final_sync(ending=True))) < TOO_SLOW
    assert fake.calls == 6


def test_background_upload_loop_retries_within_backoff_max(tmp_path: Path) -> None:
    up = _uploads(tmp_path, sync_interval=3600)
    up.s3 = fake = _FlakyS3(failures=1000)

    async def main() -> None:
        task = asyncio.create_task(up.loop())
        up._wake.set()  # a shard closed: the loop starts a pass at once, then retries on its own
        await asyncio.sleep(0.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert fake.calls >= 5
