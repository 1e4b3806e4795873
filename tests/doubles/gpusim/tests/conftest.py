"""Harness: each test gets its own config file, state dir, device dir and console-script shims.

The simulator runs from the source tree (PYTHONPATH) so the suite needs no installation;
``test_packaging.py`` checks the installable distribution separately.
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
sys.path.insert(0, str(SRC))

from gpusim import driver, procutil, registry  # noqa: E402  (importable only after the path insert)

# MTP speculative decoding as the example inventory's B200 hosts run it.
SPEC = [
    "--speculative-algorithm",
    "NEXTN",
    "--speculative-num-steps",
    "3",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "4",
]

FAST = {
    "sglang_version": "0.5.23",
    "model": {"profile": "tiny"},
    "timing": {
        "startup_s": 0.6,
        "release_delay_s": 1.0,
        "teardown_s": 0.0,
        "heartbeat_s": 0.1,
        "drain_poll_s": 0.3,
        "warmup_poll_s": 0.1,
        "warmup_timeout_s": 2.0,
        "health_probe_s": 0.05,
        "health_timeout_s": 2.0,
        "subprocess_watchdog_s": 0.2,
        "scheduler_exit_timeout_s": 2.0,
        "scheduler_shutdown_s": 0.1,
        "step_base_s": 0.005,
        "step_per_req_s": 0.0005,
        "idle_metrics_s": 5.0,
    },
}


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in ("overrides", "by_path"):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, sim: Sim, proc: subprocess.Popen, port: int, log: Path, api_key: str | None):
        self.sim = sim
        self.proc = proc
        self.port = port
        self.logfile = log
        self.api_key = api_key

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.logfile.read_text(errors="replace")

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 10
    ) -> tuple[int, bytes, dict[str, str]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        hdrs = {"Content-Type": "application/json"}
        if self.api_key:
            hdrs["Authorization"] = f"Bearer {self.api_key}"
        hdrs.update(headers or {})
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body), headers=hdrs)
            resp = conn.getresponse()
            return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()

    def get(self, path: str, **kw: Any) -> tuple[int, bytes]:
        status, body, _ = self.request("GET", path, **kw)
        return status, body

    def get_json(self, path: str) -> Any:
        status, body = self.get(path)
        assert status == 200, (status, body)
        return json.loads(body)

    def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        status, data, _ = self.request("POST", path, body, **kw)
        try:
            return status, json.loads(data)
        except ValueError:
            return status, data

    def health(self, timeout: float = 5) -> int | None:
        try:
            return self.get("/health", timeout=timeout)[0]
        except OSError:
            return None

    def wait_healthy(self, timeout: float = 20) -> float:
        start = time.monotonic()
        deadline = start + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()}")
            if self.health() == 200:
                return time.monotonic() - start
            time.sleep(0.05)
        raise AssertionError(f"server not healthy in {timeout}s:\n{self.log()}")

    def wait_log(self, needle: str, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.log():
                return
            time.sleep(0.05)
        raise AssertionError(f"{needle!r} not in log:\n{self.log()}")

    def wait_exit(self, timeout: float = 15) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server still running after {timeout}s:\n{self.log()}") from None

    def children(self) -> dict[int, tuple[str, str]]:
        """pid -> (comm, cmdline) for every descendant."""
        out = {}
        for pid in procutil.children(self.pid):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            out[pid] = (comm, " ".join(procutil.cmdline(pid)))
        return out


class Sim:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.devices = tmp / "dev"
        self.state = tmp / "state"
        self.bin = tmp / "bin"
        self.config_path = tmp / "config.json"
        self.config: dict[str, Any] = {}
        self.servers: list[Server] = []
        self.bin.mkdir()
        for name, target in (("nvidia-smi", "gpusim.nvsmi"), ("gpusim", "gpusim.admin")):
            shim = self.bin / name
            shim.write_text(
                f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(SRC)!r})\n"
                f"from {target} import main\nsys.exit(main())\n"
            )
            shim.chmod(0o755)
        self.write_config({})
        self.gpusim("setup", "--driver", "none")

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            GPUSIM_CONFIG=str(self.config_path),
            GPUSIM_STATE_DIR=str(self.state),
            PYTHONPATH=str(SRC),
            PATH=f"{self.bin}:{env.get('PATH', '')}",
            PYTHONUNBUFFERED="1",
        )
        for k in ("SGL_FORCE_SHUTDOWN", "CUDA_VISIBLE_DEVICES", "SGLANG_ENABLE_SPEC_V2"):
            env.pop(k, None)
        return env

    def write_config(self, over: dict[str, Any]) -> dict[str, Any]:
        cfg = deep_merge(FAST, {"devices_dir": str(self.devices)})
        cfg = deep_merge(cfg, over)
        self.config = cfg
        self.config_path.write_text(json.dumps(cfg))
        return cfg

    def run(self, *cmd: str, timeout: float = 30, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(cmd), env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout
        )

    def nvsmi(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return self.run(str(self.bin / "nvidia-smi"), *args, timeout=timeout)

    def gpusim(self, *args: str) -> subprocess.CompletedProcess:
        res = self.run(str(self.bin / "gpusim"), *args)
        assert res.returncode == 0, res.stderr
        return res

    def start_driver(self) -> dict[str, Any]:
        """The per-host teardown tracer, as a daemon for this test's state dir."""
        res = self.gpusim("setup", "--driver", "fork")
        drv = json.loads(res.stdout)["driver"]
        assert drv["running"], drv
        return drv

    def memory_used(self) -> list[int]:
        res = self.nvsmi("--query-gpu=memory.used", "--format=csv,noheader,nounits")
        assert res.returncode == 0, res.stdout + res.stderr
        return [int(x) for x in res.stdout.split()]

    def compute_apps(self) -> list[list[str]]:
        res = self.nvsmi("--query-compute-apps=pid,process_name,gpu_uuid,used_memory", "--format=csv,noheader,nounits")
        assert res.returncode == 0
        return [line.split(", ") for line in res.stdout.splitlines() if line]

    def start(
        self,
        *args: str,
        port: int | None = None,
        model: str = "Qwen/tiny",
        env: dict[str, str] | None = None,
        api_key: str | None = None,
    ) -> Server:
        port = port or free_port()
        log = self.tmp / f"server-{port}-{len(self.servers)}.log"
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port), *args]
        if api_key:
            argv += ["--api-key", api_key]
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                argv, env={**self.env, **(env or {})}, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
        srv = Server(self, proc, port, log, api_key)
        self.servers.append(srv)
        return srv

    def cleanup(self) -> None:
        for srv in self.servers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(srv.proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                srv.proc.wait(timeout=5)
        for h in registry.scan(self.state, 0.0, prune=False):
            if h.alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(h.alloc.pid, signal.SIGKILL)
        # Stopping the tracer makes the kernel release whatever it still holds in teardown.
        driver.stop(self.state)


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Sim]:
    s = Sim(tmp_path)
    try:
        yield s
    finally:
        s.cleanup()


def wait_for(pred, timeout: float = 10, interval: float = 0.05, msg: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {msg}; last={last!r}")
