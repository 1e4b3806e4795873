"""A killed simulated SGLang process stays in teardown for ``timing.teardown_s``, then goes.

Reference section 8: SIGKILL only queues teardown; a process in GPU teardown holds its memory
and ports for a while. The per-host driver holds each killed process at PTRACE_EVENT_EXIT.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SRC, wait_for

from gpusim import procutil

TEARDOWN = 2.0


@pytest.fixture
def tsim(sim):
    """A sim whose driver runs, or a skip where the kernel refuses ptrace here."""
    sim.start_driver()
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from gpusim import driver; "
            "r = driver._request(Path(sys.argv[1]), {'op': 'trace', 'teardown_s': 0.1}, 5); print(r)",
            str(sim.state),
        ],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    if "'ok': True" not in probe.stdout:
        pytest.skip(f"the kernel refuses ptrace here: {probe.stdout.strip()} {probe.stderr.strip()}")
    return sim


def fds(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def can_bind(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


def exists(pid: int) -> bool:
    return procutil.state(pid) not in (None, "Z", "X")


def wait_gone(pid: int, timeout: float) -> float:
    start = time.monotonic()
    wait_for(lambda: not exists(pid), timeout=timeout, interval=0.02, msg=f"pid {pid} gone")
    return time.monotonic() - start


def test_killed_main_keeps_pid_port_and_title_then_goes(tsim):
    tsim.write_config({"timing": {"teardown_s": TEARDOWN}})
    srv = tsim.start()
    srv.wait_healthy()
    cmdline = procutil.cmdline(srv.pid)
    t0 = time.monotonic()
    os.kill(srv.pid, signal.SIGKILL)
    time.sleep(0.3)
    assert procutil.state(srv.pid) == "t"
    assert procutil.cmdline(srv.pid) == cmdline
    assert srv.proc.poll() is None  # not reaped: systemd would still see its main PID
    assert not can_bind(srv.port), "the port of a process in teardown must stay bound"
    # The listening socket accepts connections (kernel backlog), but nobody answers.
    with socket.create_connection(("127.0.0.1", srv.port), timeout=2) as c:
        c.settimeout(0.5)
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        with pytest.raises(TimeoutError):
            c.recv(100)
    os.kill(srv.pid, signal.SIGKILL)  # a second SIGKILL is discarded: the process is exiting
    time.sleep(0.5)
    assert procutil.state(srv.pid) == "t"
    assert not can_bind(srv.port)
    assert srv.wait_exit(timeout=TEARDOWN + 5) == -signal.SIGKILL
    elapsed = time.monotonic() - t0
    assert TEARDOWN - 0.3 <= elapsed <= TEARDOWN + 3, elapsed
    wait_for(lambda: can_bind(srv.port), timeout=2, msg="port free after teardown")


def test_killed_scheduler_keeps_device_and_memory_then_release_delay(tsim):
    # 0.5.9: main keeps serving after a scheduler dies, so only the scheduler is in teardown.
    tsim.write_config({"sglang_version": "0.5.9", "timing": {"teardown_s": TEARDOWN, "release_delay_s": 1.5}})
    srv = tsim.start()
    srv.wait_healthy()
    used = tsim.memory_used()[0]
    assert used > 0
    sched = next(p for p, (_, cl) in srv.children().items() if cl == "sglang::scheduler")
    t0 = time.monotonic()
    os.kill(sched, signal.SIGKILL)
    time.sleep(0.3)
    os.kill(sched, signal.SIGKILL)
    assert procutil.state(sched) == "t"
    assert procutil.cmdline(sched) == ["sglang::scheduler"]
    assert Path(f"/proc/{sched}/comm").read_text().strip() == "sglang::schedul"
    assert str(tsim.devices / "nvidia0") in fds(sched)
    assert sched in procutil.children(srv.pid)
    apps = tsim.compute_apps()
    assert [a[:2] for a in apps] == [[str(sched), "sglang::scheduler"]]
    assert tsim.memory_used()[0] == used
    status = json.loads(tsim.gpusim("status").stdout)
    # The driver's own account, judged only when the look ended within the teardown: on a loaded
    # machine the status command alone can outlast it (the tracee is then gone from the account).
    if time.monotonic() - t0 < TEARDOWN - 0.3:
        entry = next(t for t in status["driver"]["tracees"] if t["pid"] == sched)
        assert entry["state"] == "teardown" and entry["killed_by"] == signal.SIGKILL
        assert [a["state"] for a in status["allocations"]] == ["alive"]
    gone_after = time.monotonic() - t0 + wait_gone(sched, TEARDOWN + 5)
    seen_gone = time.monotonic()
    assert TEARDOWN - 0.3 <= gone_after <= TEARDOWN + 3, gone_after
    # The release delay counts from the process's end, not from its last heartbeat (which was
    # TEARDOWN seconds earlier, longer than the release delay): judged when the look came within
    # the delay (1.5 s) of the end.
    assert tsim.compute_apps() == []
    held = tsim.memory_used()[0]
    if time.monotonic() - seen_gone < 1.2:
        assert held == used
    wait_for(lambda: tsim.memory_used()[0] == 0, timeout=5, msg="memory released")
    assert time.monotonic() - t0 >= TEARDOWN + 1.0
    assert srv.proc.poll() is None


def test_cgroup_kill_holds_every_process(tsim):
    # What systemd does at the end of a stop: SIGKILL to everything in the unit at once.
    tsim.write_config({"timing": {"teardown_s": TEARDOWN}})
    srv = tsim.start("--tp-size", "2")
    srv.wait_healthy()
    sglang = [p for p, (_, cl) in srv.children().items() if cl.startswith("sglang::")]
    assert len(sglang) == 3  # two schedulers and the detokenizer
    watched = [srv.pid, *sglang]
    t0 = time.monotonic()
    os.killpg(srv.pid, signal.SIGKILL)
    time.sleep(0.5)
    assert {p: procutil.state(p) for p in watched} == dict.fromkeys(watched, "t")
    assert sorted(int(a[0]) for a in tsim.compute_apps()) == sorted(
        p for p in sglang if procutil.cmdline(p)[0].startswith("sglang::scheduler")
    )
    time.sleep(TEARDOWN - 0.9)
    alive = {p: exists(p) for p in watched}
    # Judged only when the look came before the teardown's end: a loaded machine can oversleep
    # past it, and then their being gone says nothing.
    if time.monotonic() - t0 < TEARDOWN - 0.2:
        assert all(alive.values()), alive
    for p in watched:
        wait_gone(p, 5)


def test_parent_death_signal_starts_the_childrens_teardown_after_the_parents(tsim):
    tsim.write_config({"sglang_version": "0.5.9", "timing": {"teardown_s": TEARDOWN}})
    srv = tsim.start()
    srv.wait_healthy()
    sched = next(p for p, (_, cl) in srv.children().items() if cl == "sglang::scheduler")
    t0 = time.monotonic()
    os.kill(srv.pid, signal.SIGKILL)
    time.sleep(0.5)
    # PDEATHSIG fires only when the parent has finished exiting.
    assert procutil.state(sched) in ("S", "R")
    srv.wait_exit(timeout=TEARDOWN + 5)
    wait_for(lambda: procutil.state(sched) == "t", timeout=2, msg="scheduler in teardown")
    wait_gone(sched, TEARDOWN + 5)
    assert time.monotonic() - t0 >= 2 * TEARDOWN - 0.5


def test_voluntary_exit_is_not_held(tsim):
    tsim.write_config({"timing": {"teardown_s": 10.0}})
    srv = tsim.start("--no-such-flag")
    t0 = time.monotonic()
    assert srv.wait_exit(timeout=10) == 2
    assert time.monotonic() - t0 < 5


def test_tracer_death_releases_tracees(tsim):
    tsim.write_config({"timing": {"teardown_s": 60.0}})
    srv = tsim.start()
    srv.wait_healthy()
    os.kill(srv.pid, signal.SIGKILL)
    time.sleep(0.3)
    assert procutil.state(srv.pid) == "t"
    drv = json.loads(tsim.gpusim("status").stdout)["driver"]["pid"]
    os.kill(drv, signal.SIGKILL)
    assert srv.wait_exit(timeout=5) == -signal.SIGKILL


def test_no_driver_means_immediate_death(sim):
    sim.write_config({"timing": {"teardown_s": 30.0}})
    srv = sim.start()
    srv.wait_healthy()
    os.kill(srv.pid, signal.SIGKILL)
    assert srv.wait_exit(timeout=5) == -signal.SIGKILL
