"""The last upload of a run: on SIGTERM the client keeps uploading for ``s3.stop_sync_timeout``
(the stop is already set then, and must not end that wait at once), and a stop during the
end-of-job upload lets the upload under way go on for that time instead of abandoning it."""

from __future__ import annotations

import asyncio
import threading
import time
import types
from pathlib import Path
from typing import Any

from sglang_fleet.config import build_config
from sglang_fleet.control import RunControl
from sglang_fleet.uploads import Uploads


class _SlowS3:
    """An upload pass that takes ``seconds`` and then has uploaded everything."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.passes = 0
        self.finished = threading.Event()
        self.state = types.SimpleNamespace(last_error=None, uploaded=0)

    def sync_once(self) -> int:
        self.passes += 1
        time.sleep(self.seconds)
        self.state.uploaded += 1
        self.finished.set()
        return 1

    def pending(self) -> list[object]:
        return [] if self.finished.is_set() else [object()]


class _Store:
    def job_state(self) -> dict[str, Any]:
        return {}

    def update_job_state(self, **values: Any) -> None:
        pass


def _uploads(tmp_path: Path, s3: _SlowS3, **s3_cfg: Any) -> Uploads:
    base = {"prompts": "p.jsonl", "output": str(tmp_path / "out"), "endpoints": ["http://127.0.0.1:9"]}
    cfg = build_config({**base, "s3": {"uri": "s3://bucket/prefix", **s3_cfg}}, {}, environ={})
    control = RunControl(cfg, [], lambda coro, name: coro.close())
    up = Uploads(cfg, _Store(), control)  # type: ignore[arg-type]
    up.s3 = s3
    return up


def test_on_sigterm_the_last_upload_runs_for_stop_sync_timeout(tmp_path: Path) -> None:
    s3 = _SlowS3(seconds=0.5)
    up = _uploads(tmp_path, s3, stop_sync_timeout=10)

    async def main() -> None:
        up.control.stop.set()  # SIGTERM arrived before the last upload
        await up.final_sync(ending=False)

    asyncio.run(main())
    assert s3.passes == 1 and s3.finished.is_set() and s3.state.uploaded == 1


def test_a_stop_during_the_end_of_job_upload_lets_it_finish_within_stop_sync_timeout(tmp_path: Path) -> None:
    s3 = _SlowS3(seconds=0.6)
    up = _uploads(tmp_path, s3, stop_sync_timeout=10, final_sync_timeout=0)

    async def main() -> None:
        async def stop_soon() -> None:
            await asyncio.sleep(0.1)
            up.control.stop.set()

        stopper = asyncio.create_task(stop_soon())
        await up.final_sync(ending=True)
        await stopper

    asyncio.run(main())
    assert s3.finished.is_set() and s3.passes == 1


def test_a_stop_sync_timeout_of_zero_uploads_nothing_on_sigterm(tmp_path: Path) -> None:
    s3 = _SlowS3(seconds=0.1)
    up = _uploads(tmp_path, s3, stop_sync_timeout=0)
    up.control.stop.set()
    asyncio.run(up.final_sync(ending=False))
    assert s3.passes == 0
