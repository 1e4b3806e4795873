"""Helpers and fixtures of the client's tests: the client as a real process, fake and simulated model
servers, and a real S3 API (moto's server) on loopback. A uniquely named module rather than
``conftest``, so that ``from fleetkit import ...`` never finds another directory's conftest."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_openai import Behaviour, FakeServer

HERE = Path(__file__).resolve().parent  # client/tests/support
SRC = HERE.parents[1] / "src"

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing-secret-value",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port}")


def client_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SGLANG_API_KEY"))}
    env.update(AWS_ENV)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def generate_args(prompts: Path, out: Path, *endpoints: str) -> list[str]:
    """The words of `sglang-fleet generate` for a prompt file, an output directory and endpoints.
    The tests count requests in flight against the servers' capacity, so the auto concurrency is the
    capacity itself (factor 1.0; test_endpoints checks the default factor)."""
    args = ["generate", "--prompts", str(prompts), "--output", str(out), "--concurrency-factor", "1.0"]
    for endpoint in endpoints:
        args += ["--endpoint", endpoint]
    return args


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sglang_fleet", *args],
        env=env or client_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_cli(*args: str, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen[bytes]:
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "sglang_fleet", *args], env=env or client_env(), stdout=out, stderr=out
    )


# Options of `generate` that keep a test's run short: quick retries, progress as log lines, and a
# status file rewritten often enough to poll. FAST_FAKE: against the in-test fake server, which
# answers in milliseconds; FAST_SIM: against the SGLang simulator (real server processes, so slower
# retries), with short completions.
FAST_FAKE = ("--backoff-base", "0.01", "--backoff-max", "0.05", "--progress", "log", "--status-interval", "0.2")
FAST_SIM = (
    "--backoff-base",
    "0.05",
    "--backoff-max",
    "0.5",
    "--progress",
    "log",
    "--status-interval",
    "0.2",
    "--max-tokens",
    "12",
)


def gen(
    prompts: Path, out: Path, *endpoints: str, extra: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """A whole `generate` run against fake servers (``FAST_FAKE``), ``extra`` options added."""
    return cli(*generate_args(prompts, out, *endpoints), *FAST_FAKE, *extra, env=env)


def verify(prompts: Path, *outs: Path) -> str:
    """`verify` of local output directories, which must pass; returns its report."""
    args = ["verify", "--prompts", str(prompts)]
    for o in outs:
        args += ["--output", str(o)]
    r = cli(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def write_prompts(path: Path, n: int, *, start: int = 0, repeat_text: bool = True) -> Path:
    """Mixed prompts: chat and plain, explicit ids, and a block of identical texts with distinct ids
    (repeated prompts are legitimate and must each get their own completion)."""
    with open(path, "w") as f:
        for i in range(start, start + n):
            if repeat_text and i % 7 == 3:
                rec: dict[str, Any] = {"id": f"q{i}", "prompt": "the same question"}
            elif i % 2:
                rec = {"id": f"q{i}", "prompt": f"plain prompt {i}"}
            else:
                rec = {"id": f"q{i}", "messages": [{"role": "user", "content": f"chat prompt {i}"}]}
            f.write(json.dumps(rec) + "\n")
    return path


def read_records(out: Path) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = []
    for p in sorted((out / "shards").glob("part-*.jsonl")):
        with open(p) as f:
            recs.extend(json.loads(line) for line in f)
    return recs


def read_status(out: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads((out / "status.json").read_text())
        return data
    except (OSError, ValueError):
        return {}


def wait_for(pred: Any, timeout: float = 30.0, interval: float = 0.05, what: str = "condition") -> Any:
    """Polls until ``pred()`` is truthy. The timeout only bounds a hang; nothing asserts on speed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def stop_process(p: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    if p.poll() is None:
        p.send_signal(sig)
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait()


class ThreadedFakeServer:
    """A ``FakeServer`` on its own event loop in a thread, so tests can look at what it saw."""

    def __init__(self, behaviour: Behaviour | None = None, port: int = 0) -> None:
        self.behaviour = behaviour or Behaviour()
        self._want_port = port
        self.server: FakeServer | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ThreadedFakeServer:
        self._thread.start()
        self.server = FakeServer(self.behaviour)
        asyncio.run_coroutine_threadsafe(self.server.start(self._want_port), self.loop).result(10)
        return self

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture
def fake() -> Iterator[ThreadedFakeServer]:
    with ThreadedFakeServer(Behaviour(capacity=8, delay=0.002)) as srv:
        yield srv


# ---------------------------------------------------------------------- S3 (moto server)
class MotoServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=client_env(),
        )
        wait_port(self.port, 60)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, url: str | None = None) -> Any:
        import boto3  # noqa: PLC0415  (only the S3 tests pay for the import)
        from botocore.config import Config  # noqa: PLC0415

        return boto3.client(
            "s3",
            endpoint_url=url or self.url,
            region_name="us-east-1",
            aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )

    def new_bucket(self) -> str:
        name = f"b-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="session")
def moto() -> Iterator[MotoServer]:
    srv = MotoServer()
    try:
        yield srv
    finally:
        srv.stop()


class TCPProxy:
    """A forwarding process in front of a server: killing it is a real outage (connection refused),
    and starting it again on the same port ends the outage, while the server keeps its state."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "tcpproxy.py"), str(self.port), str(self.target_port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_port(self.port)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


# ---------------------------------------------------------------------- the SGLang simulator
GPUSIM_SRC = HERE.parents[2] / "tests" / "doubles" / "gpusim" / "src"

# Fast timings (the simulator's own test suite uses the same), tiny model with reasoning output, and
# a throughput that lets a few thousand prompts finish in seconds on two cores.
SIM_CONFIG: dict[str, Any] = {
    "sglang_version": "0.5.23",
    "gpus": {"count": 2},
    "model": {"profile": "tiny", "overrides": {"reasoning": True}},
    "generation": {"output_tokens_min": 4, "output_tokens_max": 12},
    "timing": {
        "startup_s": 0.5,
        "release_delay_s": 0.3,
        "heartbeat_s": 0.1,
        "drain_poll_s": 0.3,
        "warmup_poll_s": 0.1,
        "warmup_timeout_s": 10.0,
        "health_probe_s": 0.02,
        "health_timeout_s": 5.0,
        "subprocess_watchdog_s": 0.2,
        "scheduler_exit_timeout_s": 2.0,
        "scheduler_shutdown_s": 0.1,
        "step_base_s": 0.002,
        "step_per_req_s": 0.00005,
        "idle_metrics_s": 5.0,
    },
}


class SimServer:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL to the whole server (main process and schedulers), as a crash would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def healthy(self) -> bool:
        import http.client  # noqa: PLC0415

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def wait_healthy(self, timeout: float = 60) -> SimServer:
        def ok() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"simulator exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            return self.healthy()

        wait_for(ok, timeout, what=f"simulator on port {self.port}")
        return self


class Simulator:
    """One simulated GPU host: a config, a state dir, fake device files, and SGLang servers on it."""

    def __init__(self, tmp: Path, over: dict[str, Any] | None = None) -> None:
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        cfg = json.loads(json.dumps(SIM_CONFIG))
        cfg["devices_dir"] = str(tmp / "dev")
        for k, v in (over or {}).items():
            cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
        (tmp / "config.json").write_text(json.dumps(cfg))
        self.env = dict(os.environ)
        self.env.update(
            GPUSIM_CONFIG=str(tmp / "config.json"),
            GPUSIM_STATE_DIR=str(tmp / "state"),
            PYTHONPATH=str(GPUSIM_SRC),
            PYTHONUNBUFFERED="1",
        )
        self.servers: list[SimServer] = []
        r = subprocess.run(
            [sys.executable, "-c", "from gpusim.admin import main; raise SystemExit(main())", "setup"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr

    def launch(self, gpu: int = 0, port: int | None = None, *args: str, wait: bool = True) -> SimServer:
        port = port or free_port()
        log = self.tmp / f"server-{port}-{len(self.servers)}.log"
        argv = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            "Qwen/tiny",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--base-gpu-id",
            str(gpu),
            "--reasoning-parser",
            "qwen3",
            "--mem-fraction-static",
            "0.4",
            *args,
        ]
        with open(log, "ab") as fh:
            proc = subprocess.Popen(argv, env=self.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        srv = SimServer(proc, port, log)
        self.servers.append(srv)
        return srv.wait_healthy() if wait else srv

    def cleanup(self) -> None:
        for s in self.servers:
            if s.proc.poll() is None:
                s.kill()


@pytest.fixture
def simulator(tmp_path: Path) -> Iterator[Simulator]:
    sim = Simulator(tmp_path / "sim")
    try:
        yield sim
    finally:
        sim.cleanup()


@pytest.fixture(scope="session")
def shared_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SimServer]]:
    """Two simulated SGLang servers (one per GPU) for tests that do not kill them."""
    sim = Simulator(tmp_path_factory.mktemp("shared-sim"))
    try:
        a = sim.launch(0, None, "--max-running-requests", "48", wait=False)
        b = sim.launch(1, None, "--max-running-requests", "48", wait=False)
        yield [a.wait_healthy(), b.wait_healthy()]
    finally:
        sim.cleanup()
