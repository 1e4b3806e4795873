"""The test bed: a simulated GPU host with a real systemd behaves like a GPU node running SGLang."""

from __future__ import annotations

import json
import time

TOTAL_MIB = 143771  # the default simulated GPU: H200


def wait_for(check, timeout: float, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def gpu_used(host) -> dict[int, int]:
    out = host.check_output("nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits")
    return {int(i): int(u) for i, u in (line.split(", ") for line in out.splitlines())}


def health(host) -> str:
    return host.run(
        "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:30000/health', timeout=5).status)\""
    ).stdout.strip()


def test_systemd_runs_the_unit(host) -> None:
    assert host.run("systemctl is-system-running").stdout.strip() in ("running", "degraded")
    svc = host.service("gpusim-smoke.service")
    assert svc.is_running
    assert svc.is_enabled


def test_health_reaches_200_and_server_info_reports_the_flags(host) -> None:
    assert wait_for(lambda: health(host) == "200", 30)
    info = json.loads(
        host.check_output(
            "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:30000/server_info').read().decode())\""
        )
    )
    assert info["mem_fraction_static"] == 0.5
    assert info["version"] == "0.5.23"
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] > 0


def test_process_tree_and_gpu_memory(host) -> None:
    tree = host.check_output("ps -eo comm,args --no-headers")
    assert "sglang::schedul sglang::scheduler" in tree
    assert "sglang::detoken sglang::detokenizer" in tree
    used = gpu_used(host)
    # CUDA_VISIBLE_DEVICES=1: the scheduler is on physical GPU 1 only.
    assert used[0] == 0
    assert used[1] >= TOTAL_MIB * 0.5
    apps = host.check_output("nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits")
    pid = int(apps.split(", ")[0])
    assert host.check_output(f"cat /proc/{pid}/comm") == "sglang::schedul"


def test_stop_frees_gpu_memory_only_after_the_release_delay(host) -> None:
    # Timed from the stop request: the stop itself takes the processes' teardown (they stay a
    # moment after SIGKILL), while the release delay runs from the scheduler's exit.
    asked = time.monotonic()
    host.check_output("systemctl stop gpusim-smoke.service")
    stopped = time.monotonic()
    assert host.check_output("systemctl show -p ActiveState --value gpusim-smoke.service") == "inactive"
    # The processes are gone, but the driver has not released the memory yet: judged when the look
    # came well within the delay (4 s) of the stop (a loaded machine's looks can take longer).
    assert host.check_output("nvidia-smi --query-compute-apps=pid --format=csv,noheader") == ""
    held = gpu_used(host)[1]
    if time.monotonic() - stopped < 3.0:
        assert held > 0
    assert wait_for(lambda: gpu_used(host)[1] == 0, 30)
    # Released after the configured delay (4 s), not at once.
    assert time.monotonic() - asked >= 2.5
    host.check_output("systemctl start gpusim-smoke.service")
    assert wait_for(lambda: health(host) == "200", 30)
