"""The simulated server end to end: startup, process tree, GPU memory, HTTP, signals."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import SPEC, wait_for

from gpusim import procutil

B200_QWEN36 = {"gpus": {"name": "NVIDIA B200", "memory_total_mib": 183359}, "model": {"profile": "qwen3.6-27b"}}


def connectable(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_port_bound_after_load_and_health_503_then_200(sim):
    sim.write_config({"timing": {"startup_s": 1.5, "warmup_poll_s": 0.4}})
    start = time.monotonic()
    srv = sim.start()
    first_bind = None
    codes = []
    while time.monotonic() - start < 15:
        if first_bind is None and connectable(srv.port):
            first_bind = time.monotonic() - start
        if first_bind is not None:
            code = srv.health()
            codes.append(code)
            if code == 200:
                break
        time.sleep(0.02)
    assert first_bind is not None and first_bind >= 1.4
    assert 503 in codes and codes[-1] == 200
    assert codes.index(200) > codes.index(503)
    log = srv.log()
    order = [
        "server_args=ServerArgs(model_path='Qwen/tiny'",
        "Load weight begin.",
        "KV Cache is allocated. dtype: torch.bfloat16, #tokens: ",
        "max_total_num_tokens=",
        "INFO:     Started server process",
        "INFO:     Waiting for application startup.",
        "INFO:     Application startup complete.",
        f"INFO:     Uvicorn running on http://127.0.0.1:{srv.port} (Press CTRL+C to quit)",
        '"GET /model_info HTTP/1.1" 200 OK',
        "Prefill batch, #new-seq: 1, #new-token: 8, #cached-token: 0, token usage: 0.00, #running-req: 0, "
        "#queue-req: 0, #pending-token: 0, cuda graph: True, input throughput (token/s): ",
        '"POST /generate HTTP/1.1" 200 OK',
        "The server is fired up and ready to roll!",
    ]
    pos = [log.find(s) for s in order]
    assert all(p >= 0 for p in pos), list(zip(order, pos, strict=True))
    assert pos == sorted(pos)
    assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] The server is fired up", log, re.M)


def test_process_tree_titles_comm_and_devices(sim):
    srv = sim.start("--tp-size", "2", env={"CUDA_VISIBLE_DEVICES": "3,5"})
    srv.wait_healthy()
    kids = srv.children()
    titles = sorted(cmd for comm, cmd in kids.values() if cmd.startswith("sglang::"))
    assert titles == ["sglang::detokenizer", "sglang::scheduler_TP0", "sglang::scheduler_TP1"]
    for pid, (comm, cmd) in kids.items():
        if cmd.startswith("sglang::scheduler"):
            assert comm == "sglang::schedul"
            assert Path(f"/proc/{pid}/cmdline").read_bytes() == cmd.encode() + b"\0"
        if cmd == "sglang::detokenizer":
            assert comm == "sglang::detoken"
    ps = subprocess.run(["ps", "-o", "comm=,args=", "--ppid", str(srv.pid)], capture_output=True, text=True).stdout
    assert re.search(r"^sglang::schedul\s+sglang::scheduler_TP1$", ps, re.M)
    main_cmd = Path(f"/proc/{srv.pid}/cmdline").read_bytes().split(b"\0")
    assert b"sglang.launch_server" in main_cmd
    apps = sim.compute_apps()
    assert sorted(a[1] for a in apps) == ["sglang::scheduler_TP0", "sglang::scheduler_TP1"]
    used = sim.memory_used()
    assert used[3] > 100000 and used[5] > 100000 and used[0] == 0 and used[4] == 0
    sched = {cmd: pid for pid, (_, cmd) in kids.items()}
    links = {
        os.readlink(f"/proc/{sched['sglang::scheduler_TP1']}/fd/{fd}")
        for fd in os.listdir(f"/proc/{sched['sglang::scheduler_TP1']}/fd")
    }
    assert str(sim.devices / "nvidia5") in links and str(sim.devices / "nvidiactl") in links
    main_links = {os.readlink(f"/proc/{srv.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{srv.pid}/fd")}
    assert not any("nvidia" in link for link in main_links)


def test_sigkill_main_takes_children_and_memory_is_released_late(sim):
    # A release delay long enough for the looks below on a loaded machine (each nvidia-smi call
    # can take most of a second there).
    sim.write_config({"timing": {"release_delay_s": 4.0}})
    srv = sim.start()
    srv.wait_healthy()
    kids = list(srv.children())
    assert sim.memory_used()[0] > 100000
    os.kill(srv.pid, signal.SIGKILL)
    assert srv.wait_exit() == -signal.SIGKILL
    wait_for(lambda: not any(procutil.is_alive(p) for p in kids), timeout=5, msg="children to die")
    assert sim.compute_apps() == []
    assert sim.memory_used()[0] > 100000
    wait_for(lambda: sim.memory_used()[0] == 0, timeout=10, msg="memory release")


def test_memory_follows_mem_fraction_static_and_grows_during_startup(sim):
    sim.write_config({"timing": {"startup_s": 2.0}})
    a = sim.start("--mem-fraction-static", "0.5", "--base-gpu-id", "0")
    b = sim.start("--mem-fraction-static", "0.8", "--base-gpu-id", "1")
    samples = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and a.health() != 200:
        samples.append(sim.memory_used()[0])
        time.sleep(0.1)
    a.wait_healthy()
    b.wait_healthy()
    used = sim.memory_used()
    assert abs(used[0] - (143771 * 0.5 + 128)) < 40
    assert abs(used[1] - (143771 * 0.8 + 128)) < 40
    growing = [s for s in samples if s > 0]
    assert growing and growing[0] < used[0]
    # Several distinct values while it starts, judged when the 2 s start-up was sampled often enough
    # (on a loaded machine each nvidia-smi call can take most of a second).
    if len(samples) >= 10:
        assert len(set(growing)) >= 3, samples


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--max-mamba-cache-size", "80", "--mamba-full-memory-ratio", "0.4"], 16),
        (
            [
                "--max-mamba-cache-size",
                "200",
                "--mamba-full-memory-ratio",
                "0.6",
                "--mem-fraction-static",
                "0.93",
                "--max-running-requests",
                "64",
            ],
            40,
        ),
    ],
)
def test_server_info_effective_max_running_mamba_mtp(sim, extra, expected):
    sim.write_config(B200_QWEN36)
    srv = sim.start(*SPEC, *extra, model="Qwen/Qwen3.6-27B")
    srv.wait_healthy()
    info = srv.get_json("/server_info")
    state = info["internal_states"][0]
    assert state["effective_max_running_requests_per_dp"] == expected
    assert info["speculative_algorithm"] == "EAGLE"
    assert info["version"] == "0.5.23" and info["status"] == "ready"
    assert {"weight", "kvcache", "startup_available", "token_capacity", "graph"} <= set(state["memory_usage"])
    assert "startup_time" in info and "max_req_input_len" in info
    log = srv.log()
    assert f"max_running_requests is capped to {expected} by the mamba state cache" in log
    assert re.search(
        r"Mamba Cache is allocated\. max_mamba_cache_size: \d+, conv_state size: [\d.]+GB, "
        r"ssm_state size: [\d.]+GB intermediate_ssm_state_cache size: [\d.]+GB "
        r"intermediate_conv_window_cache size: [\d.]+GB $",
        log,
        re.M,
    )
    assert f"max_running_requests={expected}, context_len=262144" in log


def test_server_info_dense_and_v9_shape(sim):
    sim.write_config({"sglang_version": "0.5.9"})
    srv = sim.start("--max-running-requests", "7")
    srv.wait_healthy()
    info = srv.get_json("/get_server_info")
    st = info["internal_states"][0]
    assert st["effective_max_running_requests_per_dp"] == 7
    assert set(st["memory_usage"]) == {"weight", "kvcache", "token_capacity", "graph"}
    assert "startup_time" not in info and info["version"] == "0.5.9"
    assert info["tp_size"] == 1 and info["served_model_name"] == "Qwen/tiny"
    assert "Endpoint '/get_server_info' is deprecated" in srv.log()
    mi = srv.get_json("/model_info")
    assert mi["architectures"] == ["Qwen3ForCausalLM"] and "served_model_name" not in mi
    models = srv.get_json("/v1/models")
    assert models["data"][0]["id"] == "Qwen/tiny" and models["data"][0]["max_model_len"] == 4096
    assert srv.get("/nope")[0] == 404 and srv.get("/nope")[1] == b'{"detail":"Not Found"}'
    assert srv.request("DELETE", "/generate")[0] == 405
    assert srv.get("/ready")[0] == 404


def test_metrics_off_and_on(sim):
    # Each on a GPU of its own: on one GPU, whichever loads second finds the first's memory taken
    # (it depended on the two starts' timing whether they both saw the GPU free).
    off = sim.start("--base-gpu-id", "0")
    on = sim.start("--enable-metrics", "--served-model-name", "my-model", "--base-gpu-id", "1")
    off.wait_healthy()
    on.wait_healthy()
    assert off.get("/metrics")[0] == 404
    on.post("/generate", {"text": "hello there", "sampling_params": {"max_new_tokens": 4}})
    status, body, headers = on.request("GET", "/metrics")
    text = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain; version=")
    labels = 'engine_type="unified",model_name="my-model",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    assert f"sglang:num_running_reqs{{{labels}}} " in text
    assert f"sglang:num_queue_reqs{{{labels}}} " in text
    assert f"sglang:token_usage{{{labels}}} " in text
    assert f"sglang:gen_throughput{{{labels}}} " in text
    assert re.search(rf"sglang:max_total_num_tokens{{{re.escape(labels)}}} \d\.\d+e\+\d\d", text)
    assert "# TYPE sglang:prompt_tokens_total counter" in text
    m = re.search(
        r'sglang:num_requests_total\{engine_type="unified",is_streaming="false",'
        r'model_name="my-model"\} (\S+)',
        text,
    )
    assert m and float(m.group(1)) >= 1
    # the warmup's 8 tokens count too, health probes do not
    assert re.search(r"sglang:generation_tokens_total\{[^}]*\} 12\.0", text)
    assert 'sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="false",le="0.1",' in text
    assert "sglang:mamba_usage" not in text


def test_metrics_v9_labels_and_mamba_gauge(sim):
    sim.write_config({"sglang_version": "0.5.9", **B200_QWEN36})
    srv = sim.start("--enable-metrics", model="Qwen/Qwen3.6-27B")
    srv.wait_healthy()
    srv.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    text = srv.get("/metrics")[1].decode()
    assert re.search(r'sglang:prompt_tokens_total\{model_name="Qwen/Qwen3.6-27B"\} \d', text)
    assert "is_streaming" not in text
    assert 'sglang:mamba_usage{engine_type="unified"' in text


def test_api_key(sim):
    sim.write_config({"sglang_version": "0.5.23"})
    srv = sim.start(api_key="s3cret")
    srv.wait_healthy()
    srv.api_key = None
    for path in ("/v1/models", "/server_info", "/model_info", "/flush_cache"):
        status, body = srv.get(path)
        assert (status, body) == (401, b'{"error":"Unauthorized"}'), path
    assert srv.get("/health")[0] == 200
    assert srv.get("/health_generate")[0] == 200
    assert srv.get("/ready")[0] == 200
    assert srv.get("/metrics")[0] == 404
    assert srv.get("/v1/models", headers={"Authorization": "bearer s3cret"})[0] == 200
    assert srv.get("/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert srv.get("/v1/models", headers={"Authorization": "s3cret"})[0] == 401
    assert srv.post("/generate", {"text": "x"}, headers={"Authorization": "Bearer s3cret"})[0] == 200


def test_deterministic_completions_and_shapes(sim):
    sim.write_config(
        {
            "model": {"profile": "tiny", "overrides": {"reasoning": True}},
            "generation": {"output_tokens_min": 12, "output_tokens_max": 40},
        }
    )
    srv = sim.start("--reasoning-parser", "qwen3")
    srv.wait_healthy()
    body = {"text": "Tell me about GPUs", "sampling_params": {"max_new_tokens": 100, "temperature": 0}}
    _, r1 = srv.post("/generate", body)
    _, r2 = srv.post("/generate", body)
    assert r1["text"] == r2["text"] and r1["output_ids"] == r2["output_ids"]
    assert r1["meta_info"]["finish_reason"] == {"type": "stop", "matched": 151645}
    assert r1["meta_info"]["completion_tokens"] == len(r1["output_ids"])
    _, r3 = srv.post("/generate", {**body, "sampling_params": {"max_new_tokens": 100, "seed": 7}})
    assert r3["text"] != r1["text"]
    _, short = srv.post("/generate", {"text": "Tell me about GPUs", "sampling_params": {"max_new_tokens": 3}})
    assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert short["text"] == "".join(r1["text"])[: len(short["text"])]
    _, batch = srv.post("/generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}})
    assert isinstance(batch, list) and len(batch) == 2

    chat = {"model": "anything", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
    _, c1 = srv.post("/v1/chat/completions", chat)
    _, c2 = srv.post("/v1/chat/completions", chat)
    assert c1["choices"][0]["message"] == c2["choices"][0]["message"]
    msg = c1["choices"][0]["message"]
    assert c1["object"] == "chat.completion" and c1["model"] == "anything"
    assert msg["reasoning_content"] and msg["content"] and "</think>" not in msg["content"]
    assert c1["choices"][0]["finish_reason"] == "stop"
    assert c1["usage"]["total_tokens"] == c1["usage"]["prompt_tokens"] + c1["usage"]["completion_tokens"]
    _, c3 = srv.post("/v1/chat/completions", {**chat, "max_tokens": 2})
    assert c3["choices"][0]["finish_reason"] == "length" and c3["usage"]["completion_tokens"] == 2

    _, comp = srv.post("/v1/completions", {"prompt": "abc", "max_tokens": 5})
    assert comp["object"] == "text_completion" and comp["model"] == "default"
    assert comp["choices"][0]["finish_reason"] == "length"


def test_streaming(sim):
    srv = sim.start()
    srv.wait_healthy()
    status, raw, headers = srv.request(
        "POST", "/generate", {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 5}}
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e[len("data: ") :] for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert parsed[0]["meta_info"]["finish_reason"] is None
    assert parsed[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert all(parsed[i]["text"].startswith(parsed[i - 1]["text"]) for i in range(1, len(parsed)))
    status, raw, _ = srv.request(
        "POST",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "max_tokens": 4,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e and e != "data: [DONE]"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert raw.decode().endswith("data: [DONE]\n\n")


def test_queueing_above_effective_limit(sim):
    sim.write_config(
        {
            "timing": {"step_base_s": 0.02, "step_per_req_s": 0.0},
            "generation": {"output_tokens_min": 30, "output_tokens_max": 30},
        }
    )
    limited = sim.start("--max-running-requests", "2", "--decode-log-interval", "5", "--enable-metrics")
    wide = sim.start("--max-running-requests", "8")
    limited.wait_healthy()
    wide.wait_healthy()

    def burst(srv) -> float:
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futs = [
                pool.submit(srv.post, "/generate", {"text": f"q{i}", "sampling_params": {"max_new_tokens": 20}})
                for i in range(6)
            ]
            assert all(f.result()[0] == 200 for f in futs)
        return time.monotonic() - start

    t_limited = burst(limited)
    t_wide = burst(wide)
    assert t_limited > 2.2 * t_wide
    log = limited.log()
    assert re.search(
        r"Decode batch, #running-req: 2, #token: \d+, token usage: [\d.]+, cuda graph: True, "
        r"gen throughput \(token/s\): [\d.]+, #queue-req: [1-4]$",
        log,
        re.M,
    )
    assert "#running-req: 3" not in log


def test_many_concurrent_connections(sim):
    srv = sim.start()
    srv.wait_healthy()
    socks = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", srv.port))
            socks.append(s)
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            res = list(
                pool.map(
                    lambda i: srv.post("/generate", {"text": f"c{i}", "sampling_params": {"max_new_tokens": 2}})[0],
                    range(200),
                )
            )
        assert res.count(200) == 200
    finally:
        for s in socks:
            s.close()


def _slow(sim, version: str):
    sim.write_config(
        {
            "sglang_version": version,
            "timing": {"step_base_s": 0.05, "drain_poll_s": 0.3},
            "generation": {"output_tokens_min": 200, "output_tokens_max": 200},
        }
    )


def test_sigterm_drain_waits_for_inflight(sim):
    _slow(sim, "0.5.23")
    srv = sim.start()
    srv.wait_healthy()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(srv.post, "/generate", {"text": "long", "sampling_params": {"max_new_tokens": 40}})
        time.sleep(0.3)
        os.kill(srv.pid, signal.SIGTERM)
        srv.wait_log("SIGTERM received. signum=None frame=None. Draining requests and shutting down...")
        srv.wait_log("Gracefully exiting... Remaining number of requests 1. Remaining requests remaining_rids=['")
        assert srv.health() == 503
        assert "Health check request received during shutdown. Returning 503." in srv.log()
        late = srv.post("/generate", {"text": "late", "sampling_params": {"max_new_tokens": 2}})
        assert late[0] == 200
        assert srv.proc.poll() is None
        assert long.result()[0] == 200
    assert srv.wait_exit() == 0
    assert "Gracefully exiting... Remaining number of requests 0." in srv.log()


def test_sgl_force_shutdown(sim):
    _slow(sim, "0.5.23")
    srv = sim.start(env={"SGL_FORCE_SHUTDOWN": "1"})
    srv.wait_healthy()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: _swallow(srv.post, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 100}}))
        time.sleep(0.3)
        os.kill(srv.pid, signal.SIGTERM)
        assert srv.wait_exit(timeout=10) == 0
    assert "Signal SIGTERM received while force shutdown flag set. Force exiting." in srv.log()


def _swallow(fn, *a):
    try:
        return fn(*a)
    except OSError:
        return None


@pytest.mark.parametrize(("version", "code"), [("0.5.9", -9), ("0.5.18", -9), ("0.5.23", 0)])
def test_version_exit_paths_after_drain(sim, version, code):
    sim.write_config({"sglang_version": version})
    srv = sim.start()
    srv.wait_healthy()
    kids = list(srv.children())
    os.kill(srv.pid, signal.SIGTERM)
    assert srv.wait_exit() == code
    wait_for(lambda: not any(procutil.is_alive(p) for p in kids), timeout=5, msg="children gone")
    log = srv.log()
    if version == "0.5.23":
        assert "kill_process_tree called: parent_pid=" in log and "Finished server process" in log
    else:
        assert "Finished server process" not in log


def test_sigterm_before_warmup_is_the_default_action(sim):
    sim.write_config({"timing": {"startup_s": 3.0}})
    srv = sim.start()
    wait_for(lambda: len(sim.compute_apps()) == 1, timeout=10, msg="scheduler up")
    kids = list(srv.children())
    os.kill(srv.pid, signal.SIGTERM)
    assert srv.wait_exit() == -signal.SIGTERM
    wait_for(lambda: not any(procutil.is_alive(p) for p in kids), timeout=5, msg="children gone")
    assert "SIGTERM received" not in srv.log()


def test_sigquit_kills_tree(sim):
    srv = sim.start()
    srv.wait_healthy()
    os.kill(srv.pid, signal.SIGQUIT)
    assert srv.wait_exit() == -signal.SIGKILL
    assert "SIGQUIT received. signum=None, frame=None. It usually means one child failed." in srv.log()


def test_child_death_watchdog_v23_and_zombie_service_v9(sim):
    srv = sim.start()
    srv.wait_healthy()
    sched = next(p for p, (_, cmd) in srv.children().items() if cmd == "sglang::scheduler")
    os.kill(sched, signal.SIGKILL)
    assert srv.wait_exit() == -signal.SIGKILL
    assert re.search(
        rf"Subprocess scheduler_0 \(pid={sched}\) crashed with exit code -9\. "
        r"Triggering SIGQUIT for cleanup\.\.\.",
        srv.log(),
    )

    # GPU 0 still holds the killed scheduler's memory until the release delay: use GPU 1.
    sim.write_config({"sglang_version": "0.5.9", "timing": {"health_timeout_s": 1.0}})
    old = sim.start("--base-gpu-id", "1")
    old.wait_healthy()
    sched = next(p for p, (_, cmd) in old.children().items() if cmd == "sglang::scheduler")
    os.kill(sched, signal.SIGKILL)
    time.sleep(0.8)
    assert old.proc.poll() is None
    assert old.health() == 503
    assert "Health check failed. Server couldn't get a response from detokenizer" in old.log()
    with pytest.raises(OSError):
        old.post("/generate", {"text": "x"}, timeout=1.0)


def test_scheduler_shutdown_req_releases_memory_late(sim):
    # Long enough to be seen after the exit by a slow look on a loaded machine.
    sim.write_config({"sglang_version": "0.5.23", "timing": {"release_delay_s": 3.0}})
    srv = sim.start()
    srv.wait_healthy()
    os.kill(srv.pid, signal.SIGTERM)
    assert srv.wait_exit() == 0
    assert sim.memory_used()[0] > 0
    wait_for(lambda: sim.memory_used()[0] == 0, timeout=8, msg="release")


def test_natural_port_conflict_with_old_server(sim):
    old = sim.start()
    old.wait_healthy()
    new = sim.start("--base-gpu-id", "1", port=old.port)
    code = new.wait_exit(timeout=20)
    log = new.log()
    assert code == 1
    assert (
        f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {old.port}): "
        "[errno 98] address already in use"
    ) in log
    assert log.index("[Errno 98]") < log.index("The server is fired up and ready to roll!")
    assert old.health() == 200
    wait_for(lambda: len(sim.compute_apps()) == 1, timeout=5, msg="new scheduler gone")


def test_flush_cache(sim):
    srv = sim.start()
    srv.wait_healthy()
    status, body = srv.get("/flush_cache")
    assert status == 200 and body.startswith(b"Cache flushed.\n")


def test_hybrid_spec_batch_log_layout(sim):
    sim.write_config(
        {
            **B200_QWEN36,
            "sglang_version": "0.5.23",
            "timing": {"step_base_s": 0.01},
            "generation": {"output_tokens_min": 60, "output_tokens_max": 60},
        }
    )
    srv = sim.start(*SPEC, "--max-mamba-cache-size", "80", "--decode-log-interval", "3", model="Qwen/Qwen3.6-27B")
    srv.wait_healthy()
    _, out = srv.post("/generate", {"text": "spec", "sampling_params": {"max_new_tokens": 40}})
    assert out["meta_info"]["spec_verify_ct"] > 0 and out["meta_info"]["spec_accept_length"] > 1
    log = srv.log()
    assert re.search(
        r"Prefill batch, #new-seq: 1, #new-token: \d+, #cached-token: 0, full token usage: 0\.00, "
        r"mamba usage: [\d.]+, #running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: True, "
        r"input throughput \(token/s\): [\d.]+$",
        log,
        re.M,
    )
    # One running request holds its working slot and extra_buffer's two ping-pong tracking slots
    # (0.5.23 mem_cache/memory_pool.py:1393, 1572-1630), not the 5 slots per request the pool is
    # sized with: occupancy 3 / 80.
    assert re.search(
        r"Decode batch, #running-req: 1, #full token: \d+, full token usage: 0\.00, mamba num: 3, "
        r"mamba usage: 0\.04, accept len: [\d.]+, accept rate: [\d.]+, cuda graph: True, "
        r"gen throughput \(token/s\): [\d.]+, #queue-req: 0$",
        log,
        re.M,
    )
    state = srv.get_json("/server_info")["internal_states"][0]
    assert state["avg_spec_accept_length"] > 1


def test_v9_prefill_layout_and_bare_resolution_warnings(sim):
    sim.write_config({"sglang_version": "0.5.9"})
    srv = sim.start("--speculative-algorithm", "EAGLE")
    srv.wait_healthy()
    log = srv.log()
    assert re.search(
        r"^Max running requests is reset to 48 for speculative decoding\. You can override this by "
        r"explicitly setting --max-running-requests\.$",
        log,
        re.M,
    )
    assert re.search(
        r"Prefill batch, #new-seq: 1, #new-token: 8, #cached-token: 0, token usage: 0\.00, "
        r"#running-req: 0, #queue-req: 0, input throughput \(token/s\): [\d.]+, cuda graph: False$",
        log,
        re.M,
    )
    assert "KV Cache is allocated. #tokens: " in log
    assert "Load weight end. elapsed=" in log and "dtype=torch.bfloat16" in log


def test_data_parallel_tree(sim):
    srv = sim.start("--dp-size", "2", "--enable-metrics")
    srv.wait_healthy()
    kids = srv.children()
    ctrl = next(p for p, (_, cmd) in kids.items() if cmd == "sglang::data_parallel_controller")
    scheds = {cmd: p for p, (_, cmd) in kids.items() if cmd.startswith("sglang::scheduler")}
    assert sorted(scheds) == ["sglang::scheduler_DP0", "sglang::scheduler_DP1"]
    assert all(procutil.ppid(p) == ctrl for p in scheds.values())
    info = srv.get_json("/server_info")
    assert len(info["internal_states"]) == 2
    assert sim.memory_used()[0] > 0 and sim.memory_used()[1] > 0
    os.kill(srv.pid, signal.SIGKILL)
    wait_for(lambda: not any(procutil.is_alive(p) for p in scheds.values()), timeout=5, msg="DP schedulers gone")
