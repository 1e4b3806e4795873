"""Fault injections, each scoped so a healthy server can run next to a faulty one."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import free_port, wait_for

from gpusim import procutil


def test_ignore_sigterm_scoped_by_port(sim):
    bad_port = free_port()
    sim.write_config({"faults": [{"kind": "ignore_sigterm", "match": {"port": bad_port}}]})
    bad = sim.start(port=bad_port)
    good = sim.start("--base-gpu-id", "1")
    bad.wait_healthy()
    good.wait_healthy()
    os.kill(bad.pid, signal.SIGTERM)
    os.kill(good.pid, signal.SIGTERM)
    assert good.wait_exit() == 0
    time.sleep(1.0)
    assert bad.proc.poll() is None and bad.health() == 200
    assert "SIGTERM received" not in bad.log()
    os.kill(bad.pid, signal.SIGKILL)
    assert bad.wait_exit() == -signal.SIGKILL


def test_detached_scheduler_survives_main(sim):
    sim.write_config({"faults": [{"kind": "detach_scheduler"}], "timing": {"release_delay_s": 0.5}})
    srv = sim.start()
    srv.wait_healthy()
    apps = sim.compute_apps()
    assert len(apps) == 1 and apps[0][1] == "sglang::scheduler"
    orphan = int(apps[0][0])
    assert orphan not in srv.children()
    assert procutil.ppid(orphan) != srv.pid
    assert os.getsid(orphan) != os.getsid(srv.pid)
    os.kill(srv.pid, signal.SIGKILL)
    srv.wait_exit()
    time.sleep(1.0)
    assert procutil.is_alive(orphan)
    assert [a[0] for a in sim.compute_apps()] == [str(orphan)]
    assert sim.memory_used()[0] > 100000
    links = {os.readlink(f"/proc/{orphan}/fd/{fd}") for fd in os.listdir(f"/proc/{orphan}/fd")}
    assert str(sim.devices / "nvidia0") in links
    os.kill(orphan, signal.SIGKILL)
    wait_for(lambda: sim.memory_used()[0] == 0, timeout=5, msg="release after the orphan dies")


def test_detached_scheduler_outlives_graceful_stop(sim):
    sim.write_config({"faults": [{"kind": "detach_scheduler"}]})
    srv = sim.start()
    srv.wait_healthy()
    orphan = int(sim.compute_apps()[0][0])
    os.kill(srv.pid, signal.SIGTERM)
    assert srv.wait_exit() == 0
    assert procutil.is_alive(orphan)
    os.kill(orphan, signal.SIGKILL)


def test_never_release(sim):
    sim.write_config({"faults": [{"kind": "never_release"}], "timing": {"release_delay_s": 0.3}})
    srv = sim.start()
    srv.wait_healthy()
    used = sim.memory_used()[0]
    os.kill(srv.pid, signal.SIGKILL)
    srv.wait_exit()
    time.sleep(1.0)
    assert sim.compute_apps() == []
    assert sim.memory_used()[0] == used
    sim.gpusim("reset")
    assert sim.memory_used()[0] == 0


def test_startup_crash_only_for_new_settings(sim):
    sim.write_config(
        {
            "faults": [
                {
                    "kind": "startup_crash",
                    "match": {"args": {"max_running_requests": 300}},
                    "at_fraction": 0.5,
                    "message": "boom",
                }
            ]
        }
    )
    bad = sim.start("--max-running-requests", "300")
    assert bad.wait_exit() == -signal.SIGKILL
    log = bad.log()
    assert "Scheduler hit an exception: Traceback (most recent call last):" in log
    assert "RuntimeError: boom" in log
    assert "Received sigquit from a child process. It usually means the child failed." in log
    assert "Uvicorn running" not in log
    good = sim.start("--max-running-requests", "100", "--base-gpu-id", "1")
    good.wait_healthy()


def test_natural_cuda_oom(sim):
    srv = sim.start("--mem-fraction-static", "0.995")
    assert srv.wait_exit() == -signal.SIGKILL
    log = srv.log()
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in log
    assert "Received sigquit from a child process" in log


def test_weights_do_not_fit(sim):
    sim.write_config({"model": {"overrides": {"weights_gib": 200}}})
    srv = sim.start()
    assert srv.wait_exit() == -signal.SIGKILL
    assert "CUDA out of memory" in srv.log()


def test_generation_hangs_while_health_is_200(sim):
    sim.write_config({"faults": [{"kind": "generation_hang", "after_requests": 1}]})
    srv = sim.start()
    srv.wait_healthy()
    assert srv.post("/generate", {"text": "first", "sampling_params": {"max_new_tokens": 2}})[0] == 200
    with pytest.raises(OSError):
        srv.post("/generate", {"text": "second", "sampling_params": {"max_new_tokens": 2}}, timeout=1.5)
    assert srv.health() == 200


def _realtime_tokens(srv) -> float:
    text = srv.get("/metrics")[1].decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("sglang:realtime_tokens_total{")
    )


def test_a_hung_server_processes_no_token_while_it_holds_requests(sim):
    """sglang:realtime_tokens_total moves with every batch a working server runs and stays flat on a
    hung one that holds requests: what the retune's pre-flight reads a stall from."""
    sim.write_config({"faults": [{"kind": "generation_hang", "after_requests": 1}]})
    srv = sim.start("--enable-metrics")
    srv.wait_healthy()
    before = _realtime_tokens(srv)
    assert srv.post("/generate", {"text": "first", "sampling_params": {"max_new_tokens": 4}})[0] == 200
    served = _realtime_tokens(srv)
    assert served >= before + 4
    with pytest.raises(OSError):
        srv.post("/generate", {"text": "second", "sampling_params": {"max_new_tokens": 4}}, timeout=1.5)
    assert _realtime_tokens(srv) == served and srv.health() == 200


def test_port_taken_after_load(sim):
    sim.write_config({"faults": [{"kind": "port_taken"}], "timing": {"warmup_timeout_s": 1.0}})
    srv = sim.start()
    code = srv.wait_exit(timeout=20)
    log = srv.log()
    assert code == -signal.SIGKILL
    assert f"[Errno 98] error while attempting to bind on address ('127.0.0.1', {srv.port}): " in log
    assert "Initialization failed. warmup error: Traceback" in log
    assert "fired up" not in log
    assert log.index("Load weight end.") < log.index("[Errno 98]")


def test_settings_mismatch(sim):
    sim.write_config(
        {
            "faults": [
                {
                    "kind": "settings_mismatch",
                    "report": {
                        "max_running_requests": 99,
                        "effective_max_running_requests_per_dp": 99,
                        "mem_fraction_static": 0.5,
                    },
                }
            ]
        }
    )
    srv = sim.start("--max-running-requests", "50")
    srv.wait_healthy()
    info = srv.get_json("/server_info")
    assert info["max_running_requests"] == 99 and info["mem_fraction_static"] == 0.5
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 99
    assert "max_running_requests=50," in srv.log()


def test_config_errors_are_reported(sim):
    sim.config_path.write_text('{"faults": [{"kind": "bogus"}]}')
    res = sim.nvsmi("-L")
    assert res.returncode != 0 and "unknown fault kind" in res.stderr
    sim.config_path.write_text('{"gpus": {"colour": "red"}}')
    res = sim.nvsmi("-L")
    assert "unknown config key: gpus.colour" in res.stderr


def test_scheduler_killed_during_init(sim):
    sim.write_config({"timing": {"startup_s": 3.0}})
    srv = sim.start()
    pid = wait_for(
        lambda: next((p for p, (_, c) in srv.children().items() if c == "sglang::scheduler"), None),
        timeout=10,
        msg="scheduler",
    )
    os.kill(pid, signal.SIGKILL)
    assert srv.wait_exit() == 1
    assert (
        "RuntimeError: Rank 0 scheduler died during initialization (exit code: -9). If exit code is -9 "
        "(SIGKILL), a common cause is the OS OOM killer."
    ) in srv.log()


def test_driver_not_loaded_breaks_server_start(sim):
    sim.write_config({"sglang_version": "0.5.9", "nvidia_smi": {"mode": "driver_not_loaded"}})
    srv = sim.start()
    assert srv.wait_exit() == 1
    assert "RuntimeError: nvidia-smi error: " in srv.log()
    sim.write_config({"sglang_version": "0.5.23", "nvidia_smi": {"mode": "garbled"}})
    ok = sim.start()
    ok.wait_healthy()
    assert (
        "Failed to get GPU memory capacity from nvidia-smi. Falling back to torch.cuda.mem_get_info(). "
        "Reported total GPU memory per device (MiB): [143771"
    ) in ok.log()


def test_invalid_device_ordinal(sim):
    srv = sim.start("--tp-size", "2", env={"CUDA_VISIBLE_DEVICES": "4"})
    assert srv.wait_exit() == -signal.SIGKILL
    log = srv.log()
    assert "CUDA error: invalid device ordinal" in log
    assert "Received sigquit from a child process" in log
