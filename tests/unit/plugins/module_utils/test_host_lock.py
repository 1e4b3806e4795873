"""One run per host: the lease file's decisions, on a real file with real flock."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ansible_collections.sglang_ops.fleet.plugins.module_utils import _host_lock
from ansible_collections.sglang_ops.fleet.plugins.module_utils._host_lock import LockError


def identity(run_id: str, ttl: int = 60) -> dict:
    return {
        "run_id": run_id,
        "controller": "ci-runner-1",
        "user": "deploy",
        "controller_pid": 4242,
        "started_at": "2026-12-01T10:00:00Z",
        "ttl_s": ttl,
    }


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "run" / "host.lock")


def test_a_second_run_fails_at_once_naming_the_holder(path: str) -> None:
    _host_lock.acquire(identity("run-a"), path)
    with pytest.raises(LockError) as err:
        _host_lock.acquire(identity("run-b"), path)
    text = str(err.value)
    for word in ("run-a", "deploy", "ci-runner-1", "4242", "2026-12-01T10:00:00Z"):
        assert word in text
    assert err.value.holder is not None and err.value.holder["run_id"] == "run-a"


def test_the_same_run_renews_its_own_lease(path: str) -> None:
    first = _host_lock.acquire(identity("run-a"), path, now=1000.0)
    again = _host_lock.acquire(identity("run-a"), path, now=1010.0)
    assert not first["renewed"] and again["renewed"]
    assert again["lock"]["acquired_at"] == 1000.0 and again["lock"]["renewed_at"] == 1010.0


def test_a_lease_past_its_ttl_is_taken_over_and_says_whose(path: str) -> None:
    _host_lock.acquire(identity("dead-run", ttl=60), path, now=1000.0)
    with pytest.raises(LockError):
        _host_lock.acquire(identity("run-b"), path, now=1059.0)
    got = _host_lock.acquire(identity("run-b"), path, now=1061.0)
    assert got["took_over"]["run_id"] == "dead-run"
    assert got["lock"]["took_over"]["run_id"] == "dead-run"
    assert _host_lock.read(path)["run_id"] == "run-b"


def test_take_over_only_of_the_named_run(path: str) -> None:
    _host_lock.acquire(identity("run-a"), path)
    with pytest.raises(LockError):
        _host_lock.acquire(identity("run-b"), path, take_over="some-other-run")
    assert _host_lock.acquire(identity("run-b"), path, take_over="run-a")["took_over"]["run_id"] == "run-a"


def test_renew_fails_once_the_lease_is_someone_elses(path: str) -> None:
    _host_lock.acquire(identity("run-a", ttl=1), path, now=1000.0)
    _host_lock.acquire(identity("run-b"), path, now=1002.0)
    with pytest.raises(LockError, match="no longer holds the host lock: it is held by run run-b"):
        _host_lock.renew("run-a", path)


def test_release_only_by_the_holder_and_never_unlinks(path: str) -> None:
    _host_lock.acquire(identity("run-a"), path)
    assert not _host_lock.release("run-b", path)
    assert _host_lock.read(path)["run_id"] == "run-a"
    assert _host_lock.release("run-a", path)
    assert Path(path).exists() and _host_lock.read(path) is None
    assert _host_lock.acquire(identity("run-b"), path)["took_over"] is None


def test_guard_without_a_run_refuses_while_a_live_run_holds_the_host(path: str) -> None:
    with _host_lock.guard(None, path):
        pass  # free: a module run on its own may write
    _host_lock.acquire(identity("run-a"), path)
    with pytest.raises(LockError, match="locked by run run-a"), _host_lock.guard(None, path):
        pytest.fail("the body must not run")
    with _host_lock.guard("run-a", path):
        pass


def test_renewer_keeps_a_long_phase_alive_and_records_a_lost_lease(path: str) -> None:
    _host_lock.acquire(identity("run-a", ttl=60), path, now=1000.0)
    with _host_lock.Renewer("run-a", path, interval=0.05) as renewer:
        time.sleep(0.3)
        assert _host_lock.read(path)["renewed_at"] > 1000.0 + 1
        _host_lock.acquire(identity("run-b"), path, take_over="run-a")
        time.sleep(0.3)
    assert renewer.lost is not None and "run-b" in renewer.lost


def test_concurrent_acquires_admit_exactly_one(path: str) -> None:
    winners: list[str] = []
    barrier = threading.Barrier(8)

    def contend(i: int) -> None:
        barrier.wait()
        try:
            _host_lock.acquire(identity(f"run-{i}"), path)
            winners.append(f"run-{i}")
        except LockError:
            pass

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1
    assert json.loads(Path(path).read_text())["run_id"] == winners[0]


def test_an_unreadable_lock_file_is_held_until_it_expires(path: str) -> None:
    Path(path).parent.mkdir(parents=True)
    Path(path).write_text("{not json")
    with pytest.raises(LockError, match="unreadable"):
        _host_lock.acquire(identity("run-a"), path, now=0.0)
    assert _host_lock.acquire(identity("run-a"), path)["took_over"]["run_id"] == "(unreadable lock file)"


def test_a_gone_runs_lease_is_not_taken_over_while_its_phase_still_runs_on_the_host(path: str) -> None:
    """A run that lost its host mid-phase (the host stopped answering) leaves the phase running
    there once the host is back: a rerun must not act beside it, and may once it has ended."""
    phase = subprocess.Popen(["sleep", "30"])
    try:
        _host_lock.acquire(identity("lost-run", ttl=60), path, now=1000.0)
        with _host_lock.guard("lost-run", path, what="retune's start phase"):
            busy = _host_lock.read(path)["busy"]
        # guard names its own process while it runs and clears it after; the lost run's phase
        # was left running, as this one:
        assert busy["what"] == "retune's start phase" and "busy" not in _host_lock.read(path)
        record = {
            **_host_lock.read(path),
            "renewed_at": 0.0,  # and past its TTL
            "busy": {**busy, "pid": phase.pid, "starttime": _host_lock._starttime(phase.pid)},
        }
        Path(path).write_text(json.dumps(record))
        with pytest.raises(LockError, match=r"retune's start phase still runs on this host \(PID \d+"):
            _host_lock.acquire(identity("rerun"), path, take_over="lost-run", now=1010.0)
        with pytest.raises(LockError, match="still runs on this host"), _host_lock.guard(None, path):
            pytest.fail("the body must not run")  # past its TTL, but the phase still runs
    finally:
        phase.kill()
        phase.wait()
    got = _host_lock.acquire(identity("rerun"), path, take_over="lost-run", now=1010.0)
    assert got["took_over"]["run_id"] == "lost-run" and "busy" not in got["lock"]
