"""The agent's ``observe`` operation on a fake host: /metrics sampled on a fake clock, /server_info
read once, the startup lines of the current run, nvidia-smi's memory; and its /metrics parser on
the exposition of the SGLang reference (§4)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from agent_requests import REQUEST, run_op

from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent import op_observe, systemd
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.clients import ClientError
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.evidence import EvidenceError
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.host import Host
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.ops import run as op_observe_run
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.model_facts import JOURNAL_PATTERN

# SGLang reference §4, "Exposition sample (v23)" (the long label sets split over string literals).
EXPOSITION = "\n".join(
    [
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        'sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",'
        'tp_rank="0"} 3.0',
        'sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",'
        'tp_rank="0"} 0.05',
        'sglang:max_total_num_tokens{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",'
        'tp_rank="0"} 1.5e+06',
        'sglang:num_retracted_reqs{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pid="27898",'
        'pp_rank="0",tp_rank="0"} 0.0',
        "# TYPE sglang:prompt_tokens_total counter",
        'sglang:prompt_tokens_total{engine_type="unified",is_streaming="false",model_name="Qwen/Qwen3-8B"} 7.0',
        'sglang:cached_tokens_total{cache_source="device",engine_type="unified",model_name="Qwen/Qwen3-8B"} 0.0',
        "# TYPE sglang:time_to_first_token_seconds histogram",
        'sglang:time_to_first_token_seconds_sum{engine_type="unified",is_streaming="false",'
        'model_name="Qwen/Qwen3-8B"} 0.5',
        "",
    ]
)

UNIT = "sglang-gpu0.service"


def test_parse_metrics_on_the_reference_exposition() -> None:
    assert op_observe.parse_metrics(EXPOSITION) == {
        "num_running_reqs": 3.0,
        "token_usage": 0.05,
        "max_total_num_tokens": 1.5e6,
        "prompt_tokens_total": 7.0,  # the measurement's requests take the window's shape
    }
    # Gauges: the largest over the ranks; counters: the sum over their series (is_streaming).
    text = (
        'sglang:num_running_reqs{tp_rank="0"} 16.0\nsglang:num_running_reqs{tp_rank="1"} 15.0\n'
        'sglang:generation_tokens_total{is_streaming="true"} 1.5e+06\n'
        'sglang:generation_tokens_total{is_streaming="false"} 250.0\nsglang:mamba_usage NaN\n'
    )
    assert op_observe.parse_metrics(text) == {"num_running_reqs": 16.0, "generation_tokens_total": 1500250.0}


def test_the_agent_asks_for_the_lines_the_controller_names_and_has_none_of_its_own(tmp_path: Path) -> None:
    """The lines to read are the controller's parser's (one expression, sent with the request): an
    observe that would read the journal without it fails naming the key."""
    re.compile(JOURNAL_PATTERN)
    assert not hasattr(op_observe, "JOURNAL_PATTERN")
    request = {k: v for k, v in REQUEST.items() if k != "journal_pattern"}
    out = op_observe_run({**request, "op": "observe", "instances": [instance()]}, ObserveHost(tmp_path))
    assert out == {
        "failed": True,
        "msg": "the request to the host agent has no 'journal_pattern' (its sender must give every key it reads)",
    }


class ObserveHost(Host):
    """A host whose instance answers /metrics with a new sample per call, on a fake clock."""

    def __init__(self, tmp_path: Path, running: bool = True):
        super().__init__({**REQUEST, "secrets_file": str(tmp_path / "secrets.env"), "http_timeout": 30})
        self.clock = 1000.0
        self.running = running
        self.metrics_calls = 0
        self.server_info_calls = 0
        self.journal_asks: list[tuple[str, str, str]] = []
        self.gpu_used = iter([150000, 158989, 151000] + [152000] * 100)
        self.gpu_error: Exception | None = None

    def monotonic(self) -> float:
        return self.clock

    def sleep(self, seconds: float) -> None:
        self.clock += seconds

    def units(self, names: list[str]) -> dict[str, dict[str, str]]:
        if not self.running:
            return {n: {"ActiveState": "inactive", "SubState": "dead", "MainPID": "0"} for n in names}
        return {
            n: {"ActiveState": "active", "SubState": "running", "MainPID": "4242", "InvocationID": "inv-1"}
            for n in names
        }

    def startup_journal(self, invocation_id: str, unit: str, pattern: str) -> list[str]:
        self.journal_asks.append((invocation_id, unit, pattern))
        return ["[2026-01-05 10:00:03] KV Cache is allocated. #tokens: 941074, K size: 30.51 GB, V size: 30.51 GB"]

    def gpus(self) -> dict[int, dict[str, Any]]:
        if self.gpu_error is not None:
            raise self.gpu_error
        return {0: {"index": 0, "uuid": "GPU-0", "used_mib": next(self.gpu_used), "total_mib": 183359}}

    def http(
        self, url: str, timeout: float, api_key: str = "", body: dict[str, Any] | None = None
    ) -> tuple[int | None, str]:
        if url.endswith("/server_info"):
            self.server_info_calls += 1
            return 200, json.dumps(
                {"api_key": "s3cret", "internal_states": [{"effective_max_running_requests_per_dp": 16}]}
            )
        if url.endswith("/metrics"):
            self.metrics_calls += 1
            if self.metrics_calls == 3:
                return None, "TimeoutError: timed out"
            return 200, (
                f"sglang:num_running_reqs 16.0\nsglang:num_queue_reqs {200 + self.metrics_calls}.0\n"
                "sglang:mamba_usage 1.0\nsglang:token_usage 0.03\n"
                f'sglang:generation_tokens_total{{is_streaming="false"}} {1000 * self.metrics_calls}.0\n'
            )
        return None, "ConnectionRefusedError: refused"


def instance() -> dict[str, Any]:
    return {"name": "gpu0", "unit": UNIT, "gpus": [0], "port": 30000, "container": None}


def test_observe_samples_the_window_and_reads_the_rest_once(tmp_path: Path) -> None:
    host = ObserveHost(tmp_path)
    result = run_op({"op": "observe", "instances": [instance()], "window": 20, "interval": 5}, host)
    assert result["agent_version"] == 1 and result["sampled"] is True
    obs = result["instances"]["gpu0"]
    # Ticks at 0, 5, 10, 15, 20 s; the third /metrics timed out.
    assert host.metrics_calls == 5 and host.server_info_calls == 1
    assert [s["t"] for s in obs["samples"]] == [0.0, 5.0, 15.0, 20.0]
    assert obs["samples"][0] == {
        "t": 0.0,
        "num_running_reqs": 16.0,
        "num_queue_reqs": 201.0,
        "mamba_usage": 1.0,
        "token_usage": 0.03,
        "generation_tokens_total": 1000.0,
    }
    assert obs["metrics_errors"] == ["/metrics answered None: TimeoutError: timed out"]
    assert obs["server_info"]["api_key"] == "********"
    assert (obs["invocation_id"], obs["main_pid"], obs["running"]) == ("inv-1", 4242, True)
    assert host.journal_asks == [("inv-1", UNIT, JOURNAL_PATTERN)]
    assert (
        obs["journal"][0].startswith("[2026-01-05 10:00:03] KV Cache is allocated.") and obs["journal_source"] == "host"
    )
    assert result["gpus"] == {
        "0": {
            "total_mib": 183359,
            "used_mib_min": 150000,
            "used_mib_max": 158989,
            "used_mib_last": 152000,
            "samples": 5,
        }
    }
    assert result["window_s"] == 20.0 and result["gpu_error"] is None


def test_observe_asks_the_generation_clients_what_they_send(tmp_path: Path) -> None:
    host = ObserveHost(tmp_path)
    asked: list[tuple[str, dict[str, Any]]] = []
    endpoints = [
        {"url": "http://127.0.0.1:30000", "capacity": 20, "in_flight": 19, "follows_server": True, "factor": 1.25},
        {"url": "http://127.0.0.1:30001", "capacity": 8, "in_flight": 8, "follows_server": False, "factor": 1.25},
    ]

    def client_call(unit: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        asked.append((unit, request))
        if unit == "silent.service":
            raise ClientError("no answer")
        return {"ok": True, "pid": 7, "unit": unit, "endpoints": endpoints}

    host.client_call = client_call  # type: ignore[method-assign]
    host.is_local_host = lambda name: name == "127.0.0.1"  # type: ignore[method-assign]
    req = {
        "op": "observe",
        "instances": [instance()],
        "window": 5,
        "interval": 5,
        "client_units": ["gen.service", "silent.service"],
    }
    result = run_op(req, host)
    assert [unit for unit, _unused in asked] == ["gen.service", "silent.service"]
    # Only the endpoint that reaches this host's gpu0 (port 30000) counts for it.
    assert result["instances"]["gpu0"]["clients"] == [
        {
            "unit": "gen.service",
            "url": "http://127.0.0.1:30000",
            "follows_server": True,
            "factor": 1.25,
            "capacity": 20,
            "in_flight": 19,
        }
    ]
    assert result["clients_problems"] == [
        "generation client silent.service runs but did not answer on its control socket: no answer"
    ]
    # Without client_units, no client is asked.
    asked.clear()
    plain = run_op({**req, "client_units": []}, host)
    assert asked == [] and "clients" not in plain["instances"]["gpu0"]


def test_observe_without_sampling_for_prometheus(tmp_path: Path) -> None:
    host = ObserveHost(tmp_path)
    result = run_op(
        {"op": "observe", "instances": [instance()], "window": 300, "interval": 5, "sample_metrics": False}, host
    )
    assert host.metrics_calls == 0 and host.server_info_calls == 1
    assert result["instances"]["gpu0"]["samples"] == [] and result["window_s"] == 0.0
    assert result["gpus"]["0"]["samples"] == 1


def test_observe_a_stopped_instance_and_a_broken_nvidia_smi(tmp_path: Path) -> None:
    host = ObserveHost(tmp_path, running=False)
    host.gpu_error = EvidenceError("GPU memory", ["nvidia-smi"], 9, "", "NVIDIA-SMI has failed")
    result = run_op({"op": "observe", "instances": [instance()], "window": 10, "interval": 5}, host)
    obs = result["instances"]["gpu0"]
    assert obs["running"] is False and obs["server_info_error"] == "the unit is not running"
    assert obs["samples"] == [] and host.server_info_calls == 0
    assert result["gpu_error"]["what"] == "GPU memory" and result["gpus"] == {}


def test_the_real_host_reads_the_current_runs_journal_with_grep(tmp_path: Path, monkeypatch: Any) -> None:
    calls: list[list[str]] = []

    def fake_run(argv: list[str], timeout: float = 30.0, input_text: str | None = None) -> tuple[int, str, str]:
        calls.append(argv)
        return 0, "Load weight end. avail mem=125.91 GB, mem usage=52.65 GB.\nsecret s3cretvalue\n", ""

    monkeypatch.setattr(systemd, "run_cmd", fake_run)
    host = Host({"secrets_file": str(tmp_path / "none.env")})
    host.redactor.secrets = ["s3cretvalue"]
    lines, source, error = op_observe.startup_journal(host, "inv-9", UNIT, JOURNAL_PATTERN)
    assert calls == [
        ["journalctl", "--no-pager", "-o", "cat", "_SYSTEMD_INVOCATION_ID=inv-9", "--grep", JOURNAL_PATTERN]
    ]
    assert lines == ["Load weight end. avail mem=125.91 GB, mem usage=52.65 GB.", "secret ********"]
    assert (source, error) == ("journalctl --grep", None)


def test_without_pattern_support_the_journal_is_read_from_the_start(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(
        systemd, "run_cmd", lambda argv, timeout=30.0: (1, "", "Compiled without pattern matching support")
    )
    script = tmp_path / "journalctl"
    script.write_text(
        "#!/bin/sh\necho 'Load weight end. avail mem=125.91 GB, mem usage=52.65 GB.'\necho 'noise'\n"
        "echo 'max_total_num_tokens=941074, chunked_prefill_size=16384'\necho 'never read'\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    host = Host({"secrets_file": str(tmp_path / "none.env")})
    lines, source, error = op_observe.startup_journal(host, "inv-9", UNIT, JOURNAL_PATTERN)
    assert lines == [
        "Load weight end. avail mem=125.91 GB, mem usage=52.65 GB.",
        "max_total_num_tokens=941074, chunked_prefill_size=16384",
    ]
    assert (source, error) == ("journalctl (from the start of the run)", None)
