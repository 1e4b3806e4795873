"""Live simulated instances for the throughput model's fixtures (tools/record_throughput_fixtures.py):
a simulated GPU host (the GPU simulator, tests/doubles/gpusim, as local processes), SGLang servers
on it with an instance's settings, the Molecule scenario's steady load (tests/testbed/loadgen.py),
observe's sampling and the agent's stepped measurement against them. Only tests and that tool
import the simulator, the product never does."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent import http_client
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.host import Host
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.op_measure import measure_instance, workload_shape
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.op_observe import JOURNAL_PATTERN, parse_metrics

GPUSIM_SRC = Path(__file__).resolve().parents[3] / "doubles" / "gpusim" / "src"
LOADGEN = Path(__file__).resolve().parents[3] / "testbed" / "loadgen.py"
B200_MIB = 183359

# The simulator's own timings halved (prefill twice as fast): every step takes half as long, so
# every throughput doubles and every ratio of throughputs stays; the tests take half the time.
TIMING_SCALE = 0.5


def sim_config(tmp: Path, gpus: int, output_tokens: tuple[int, int]) -> dict[str, Any]:
    return {
        "sglang_version": "0.5.23",
        "gpus": {"count": gpus, "name": "NVIDIA B200", "memory_total_mib": B200_MIB},
        "generation": {"output_tokens_min": output_tokens[0], "output_tokens_max": output_tokens[1]},
        "devices_dir": str(tmp / "dev"),
        "timing": {
            "startup_s": 0.3,
            "release_delay_s": 0.2,
            "drain_poll_s": 0.2,
            "warmup_poll_s": 0.1,
            "heartbeat_s": 0.1,
            "step_base_s": 0.02 * TIMING_SCALE,
            "step_per_req_s": 0.001 * TIMING_SCALE,
            "prefill_tokens_per_s": 50000.0 / TIMING_SCALE,
            "idle_metrics_s": 2.0,
        },
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def argv_of(args: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value not in (None, False):
            out += [flag, str(value)]
    return out


class Server:
    """One simulated SGLang server (an instance) on one GPU of the host."""

    def __init__(self, host: SimHost, gpu: int, args: Mapping[str, Any]) -> None:
        self.host, self.gpu, self.args, self.port = host, gpu, dict(args), free_port()
        self.log = host.tmp / f"server-{gpu}-{self.port}.log"
        argv = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            "Qwen/Qwen3.6-27B",
            "--served-model-name",
            "qwen3.6-27b",
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--base-gpu-id",
            str(gpu),
            *argv_of(args),
        ]
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(
                argv, env=host.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.inst = {"name": f"gpu{gpu}", "port": self.port, "gpus": [gpu], "unit": f"sim-{gpu}.service"}

    def get(self, path: str) -> tuple[int | None, str]:
        return http_client.http_request(f"http://127.0.0.1:{self.port}{path}", 5.0)

    def wait_ready(self, timeout: float = 60.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"simulator exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if self.get("/health")[0] == 200:
                return self
            time.sleep(0.1)
        raise AssertionError(f"simulator on port {self.port} not healthy in {timeout}s")

    def metrics(self, _inst: Any = None) -> dict[str, Any]:
        status, body = self.get("/metrics")
        return {"values": parse_metrics(body)} if status == 200 else {"error": f"/metrics {status}"}

    def load(self, concurrency: int, prompt_tokens: int = 200, max_new_tokens: int = 4096) -> Load:
        """The Molecule scenario's steady load (tests/testbed/loadgen.py), as its own process."""
        load = Load(self, concurrency, prompt_tokens, max_new_tokens)
        self.host.loads.append(load)
        return load

    def wait_running(self, at_least: float, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self.metrics().get("values") or {}).get("num_running_reqs", 0) >= at_least:
                return
            time.sleep(0.1)
        raise AssertionError(f"{self.inst['name']}: fewer than {at_least} running after {timeout}s")

    def window(self, seconds: float, interval: float) -> list[dict[str, Any]]:
        """observe's samples: /metrics every ``interval`` seconds for ``seconds``."""
        samples, start = [], time.monotonic()
        while time.monotonic() - start <= seconds:
            got = self.metrics()
            if "values" in got:
                samples.append({"t": round(time.monotonic() - start, 3), **got["values"]})
            time.sleep(max(0.0, interval - (time.monotonic() - start) % interval))
        return samples

    def measure(self, spec: Mapping[str, Any], effective_max: int, window: list[dict[str, Any]]) -> dict[str, Any]:
        """The agent's stepped measurement as observe runs it after ``window`` (no generation client
        on this host: the test's own load was stopped first)."""
        shaped = {**workload_shape(window), **spec}
        return measure_instance(self.inst, self.host.agent, shaped, effective_max, [], self.metrics)

    def observation(self) -> dict[str, Any]:
        """What observe returns for the instance, but the samples: /server_info and the startup
        lines (the simulator's log is the unit's journal)."""
        status, body = self.get("/server_info")
        assert status == 200, body
        pattern = JOURNAL_PATTERN.split("|")
        journal = [line for line in self.log.read_text().splitlines() if any(p in line for p in pattern)]
        return {"server_info": json.loads(body), "journal": journal}

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


class Load:
    """tests/testbed/loadgen.py against one server: ``concurrency`` requests kept open."""

    def __init__(self, server: Server, concurrency: int, prompt_tokens: int, max_new_tokens: int) -> None:
        argv = [
            sys.executable,
            str(LOADGEN),
            "--port",
            str(server.port),
            "--concurrency",
            str(concurrency),
            "--prompt-tokens",
            str(prompt_tokens),
            "--max-new-tokens",
            str(max_new_tokens),
        ]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class SimHost:
    """One simulated GPU host: its config, state and device files; servers launched on it."""

    def __init__(self, tmp: Path, gpus: int, output_tokens: tuple[int, int] = (400, 800)) -> None:
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "config.json").write_text(json.dumps(sim_config(tmp, gpus, output_tokens)))
        self.env = dict(os.environ)
        self.env.update(
            GPUSIM_CONFIG=str(tmp / "config.json"),
            GPUSIM_STATE_DIR=str(tmp / "state"),
            PYTHONPATH=str(GPUSIM_SRC),
            PYTHONUNBUFFERED="1",
        )
        done = subprocess.run(
            [sys.executable, "-c", "from gpusim.admin import main; raise SystemExit(main())", "setup"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        self.agent = Host({"secrets_file": str(tmp / "no-secrets.env")})
        self.servers: list[Server] = []
        self.loads: list[Load] = []

    def launch(self, gpu: int, args: Mapping[str, Any]) -> Server:
        server = Server(self, gpu, args)
        self.servers.append(server)
        return server

    def gpu_used_mib(self, gpu: int) -> float:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                "from gpusim.nvsmi import main; raise SystemExit(main())",
                "--query-gpu=index,memory.used",
                "--format=csv,noheader,nounits",
            ],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        rows = dict(line.split(", ") for line in done.stdout.strip().splitlines())
        return float(rows[str(gpu)])

    def cleanup(self) -> None:
        for load in self.loads:
            if load.proc.poll() is None:
                load.stop()
        for server in self.servers:
            if server.proc.poll() is None:
                server.stop()


@contextlib.contextmanager
def sim_host(tmp: Path, gpus: int, output_tokens: tuple[int, int] = (400, 800)) -> Iterator[SimHost]:
    host = SimHost(tmp, gpus, output_tokens)
    try:
        yield host
    finally:
        host.cleanup()
