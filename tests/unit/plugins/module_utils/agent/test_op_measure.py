"""The advisor's stepped measurement (agent op_measure): the levels, the window's request shape,
and that the clients drained for it are always resumed, with nothing measured on a busy instance."""

from __future__ import annotations

from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent import op_measure
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.host import Host


class Clock:
    def __init__(self) -> None:
        self.now = 0.0


class FakeLoad:
    def __init__(self, host: FakeHost, concurrency: int) -> None:
        self.host, self.concurrency, self.errors = host, concurrency, []
        host.running = concurrency

    def stop(self) -> None:
        self.host.running = 0


class FakeHost(Host):
    """An instance that runs what it is sent (after ``busy`` requests of others drain, if ever)."""

    def __init__(self, busy: int = 0) -> None:
        self.clock, self.running, self.busy = Clock(), 0, busy
        self.request = {"poll_interval": 0.25}
        self.calls: list[tuple[str, Any]] = []
        self.bodies: list[dict[str, Any]] = []

    def monotonic(self) -> float:
        return self.clock.now

    def sleep(self, seconds: float) -> None:
        self.clock.now += max(seconds, 0.01)

    def client_call(self, unit: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.calls.append((unit, request["op"]))
        return {}

    def load(self, url: str, body: dict[str, Any], concurrency: int, stream: bool = True) -> Any:
        self.bodies.append(body)
        return FakeLoad(self, concurrency)

    def metrics(self, _inst: Any) -> dict[str, Any]:
        running = self.running + self.busy
        # 20 ms + 1 ms per request and step, one token per request and step.
        tput = running / (0.020 + 0.001 * running) if running else 0.0
        return {"values": {"num_running_reqs": running, "num_queue_reqs": 0, "gen_throughput": tput}}


INST = {"name": "gpu0", "port": 30000}
CLIENTS = [{"unit": "gen.service", "url": "http://127.0.0.1:30000"}]


def test_the_levels_are_shares_of_the_effective_max() -> None:
    assert op_measure.concurrencies([0.25, 0.5, 1.0], 16) == [4, 8, 16]
    assert op_measure.concurrencies([0.01, 0.5, 2.0], 3) == [1, 2, 3]


def test_the_requests_take_the_windows_shape() -> None:
    window = [
        {
            "num_requests_total": 10,
            "prompt_tokens_total": 2000,
            "generation_tokens_total": 6000,
            "num_running_reqs": 16,
            "gen_throughput": 1600,
        },
        {
            "num_requests_total": 20,
            "prompt_tokens_total": 4000,
            "generation_tokens_total": 12000,
            "num_running_reqs": 16,
            "gen_throughput": 1600,
        },
    ]
    assert op_measure.workload_shape(window) == {
        "prompt_tokens": 200,
        "max_new_tokens": 600,
        "request_tokens_per_s": 100.0,
    }
    assert op_measure.workload_shape(window[:1]) == {}


def test_each_level_is_sampled_after_it_settles_and_the_clients_are_resumed() -> None:
    host = FakeHost()
    spec = {
        "step_s": 2.0,
        "interval": 0.5,
        "settle": 0.5,
        "prompt_tokens": 200,
        "max_new_tokens": 600,
        "request_tokens_per_s": 100.0,
    }
    out = op_measure.measure_instance(INST, host, spec, 16, CLIENTS, host.metrics)
    assert "measure_error" not in out
    assert host.calls == [("gen.service", "drain"), ("gen.service", "resume")]
    assert sorted({s["level"] for s in out["measure_samples"]}) == [4, 8, 16]
    assert all(s["num_running_reqs"] == s["level"] for s in out["measure_samples"])
    # The window's prompt, as many tokens as a request got in a step's time (100 tok/s x 2 s).
    assert len(host.bodies[0]["input_ids"]) == 200
    assert host.bodies[0]["sampling_params"] == {"max_new_tokens": 200, "ignore_eos": True}
    assert out["measure"]["levels"] == [4, 8, 16] and out["measure"]["drained"] == ["gen.service"]


def test_a_busy_instance_is_not_measured_and_its_clients_are_resumed() -> None:
    host = FakeHost(busy=3)
    out = op_measure.measure_instance(INST, host, {"drain_timeout": 1.0}, 16, CLIENTS, host.metrics)
    assert out["measure_samples"] == []
    assert out["measure_error"].startswith("the instance still ran 3 requests (0 queued) after its clients")
    assert host.calls == [("gen.service", "drain"), ("gen.service", "resume")]
    assert host.bodies == []


class StaleGaugeHost(FakeHost):
    """As 0.5.9 reports: the gauges keep the last running count for 30 s after the server went
    idle (managers/scheduler_runtime_checker_mixin.py:253-258); the token counter moves only while
    requests run (one token per request every 25 ms)."""

    def __init__(self, last_running: int, working: bool = False) -> None:
        super().__init__()
        self.last_running, self.working, self.tokens, self.at = last_running, working, 5000.0, 0.0

    def metrics(self, inst: Any) -> dict[str, Any]:
        got = super().metrics(inst)
        running = self.running + (self.last_running if self.working else 0)
        self.tokens += running * (self.clock.now - self.at) / 0.025
        self.at = self.clock.now
        shown = self.running or self.last_running  # the scheduler's last report
        return {"values": {**got["values"], "num_running_reqs": shown, "realtime_tokens_total": self.tokens}}


def test_a_server_just_gone_idle_is_measured_though_its_gauges_still_show_requests() -> None:
    host = StaleGaugeHost(last_running=12)
    out = op_measure.measure_instance(INST, host, {"step_s": 1.0, "interval": 0.25}, 16, CLIENTS, host.metrics)
    assert "measure_error" not in out
    assert sorted({s["level"] for s in out["measure_samples"]}) == [4, 8, 16]


def test_requests_that_still_produce_tokens_are_not_taken_for_idle() -> None:
    host = StaleGaugeHost(last_running=3, working=True)
    out = op_measure.measure_instance(INST, host, {"drain_timeout": 1.0}, 16, CLIENTS, host.metrics)
    assert out["measure_error"].startswith("the instance still ran 3 requests (0 queued)")
    assert host.bodies == []
