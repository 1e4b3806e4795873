"""``/server_info`` asks every scheduler over IPC, so it hangs when one is stuck or gone.

Reference 3.2 (sgl-project/sglang#4191) and 2.3 ("A child dies after startup", 0.5.9).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import free_port

from gpusim import procutil


def hangs(srv, path: str, timeout: float = 1.5) -> bool:
    try:
        srv.get(path, timeout=timeout)
    except TimeoutError:
        return True
    return False


def test_fault_hangs_server_info_scoped_by_port(sim):
    bad_port = free_port()
    sim.write_config({"faults": [{"kind": "server_info_hang", "match": {"port": bad_port}}]})
    bad = sim.start(port=bad_port)
    good = sim.start("--base-gpu-id", "1")
    bad.wait_healthy()
    good.wait_healthy()
    assert hangs(bad, "/server_info")
    assert hangs(bad, "/get_server_info")
    assert bad.health() == 200
    assert bad.get("/model_info")[0] == 200
    status, body = bad.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}})
    assert status == 200 and body["meta_info"]["completion_tokens"] <= 4
    assert good.get_json("/server_info")["port"] == good.port


def test_fault_answer_after(sim):
    sim.write_config({"faults": [{"kind": "server_info_hang", "answer_after_s": 1.5}]})
    srv = sim.start()
    srv.wait_healthy()
    assert hangs(srv, "/server_info", timeout=0.8)
    t0 = time.monotonic()
    info = srv.get_json("/server_info")
    assert time.monotonic() - t0 >= 1.4
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] > 0


def test_v9_dead_scheduler_hangs_server_info_health_503(sim):
    sim.write_config({"sglang_version": "0.5.9"})
    srv = sim.start()
    srv.wait_healthy()
    assert srv.get_json("/server_info")["version"] == "0.5.9"
    sched = next(p for p, (_, cl) in srv.children().items() if cl == "sglang::scheduler")
    os.kill(sched, signal.SIGKILL)
    time.sleep(0.5)
    assert hangs(srv, "/server_info")
    assert hangs(srv, "/get_server_info")
    assert srv.get("/model_info")[0] == 200
    t0 = time.monotonic()
    assert srv.health(timeout=10) == 503  # after health_timeout_s (2 s here)
    assert time.monotonic() - t0 >= 1.8
    assert srv.proc.poll() is None and procutil.is_alive(srv.pid)


@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_stopped_scheduler_hangs_server_info_until_it_resumes(sim, version):
    sim.write_config({"sglang_version": version})
    srv = sim.start()
    srv.wait_healthy()
    sched = next(p for p, (_, cl) in srv.children().items() if cl == "sglang::scheduler")
    gen = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}
    os.kill(sched, signal.SIGSTOP)
    try:
        time.sleep(0.5)
        assert hangs(srv, "/server_info")
        with pytest.raises(TimeoutError):
            srv.post("/generate", gen, timeout=1.0)  # a stopped scheduler produces nothing
    finally:
        os.kill(sched, signal.SIGCONT)
    assert srv.get_json("/server_info")["version"] == version
    assert srv.post("/generate", gen)[0] == 200
