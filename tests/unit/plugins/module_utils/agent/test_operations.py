"""The operations' decisions on a fake host: systemd, /proc, nvidia-smi and the servers answer
from data, the clock is fake; the records are real files in a temporary directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from agent_requests import REQUEST, run_op

from ansible_collections.sglang_ops.fleet.plugins.filter.retune_agent_options import retune_agent_options
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent import ops
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.evidence import EvidenceError
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.host import Host
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.request import RequestError

UNIT = "sglang-gpu0.service"
CGROUP = f"/system.slice/{UNIT}"
PORT = 30000
ARGV = ["/opt/sglang/venv/bin/python", "-m", "sglang.launch_server", "--port", str(PORT)]
SMI_HANGS = EvidenceError("GPU memory", ["nvidia-smi", "--query-gpu=index"], None, "", "")


class FakeHost(Host):
    def __init__(self, tmp_path: Path, **request: Any):
        super().__init__(
            {
                **REQUEST,
                "secrets_file": str(tmp_path / "secrets.env"),
                "state_dir": str(tmp_path / "state"),
                "desired_dir": str(tmp_path / "desired"),
                "poll_interval": 1.0,
                **request,
            }
        )
        self.service.definitions_dir = str(tmp_path / "units")
        Path(self.service.definitions_dir).mkdir()
        self.clock = 1000.0
        self.unit_state: dict[str, dict[str, str]] = {}
        self.procs: dict[int, dict[str, Any]] = {}
        self.gone_at: dict[int, float] = {}  # pid -> when the kernel has finished tearing it down
        self.gpu_answer: Any = {0: {"index": 0, "uuid": "GPU-0", "used_mib": 3, "total_mib": 143771}}
        self.answers: dict[str, tuple[int | None, str]] = {}
        self.systemctl_calls: list[list[str]] = []
        self.kills: list[list[dict[str, Any]]] = []
        self.on_systemctl: dict[str, Any] = {}

    def monotonic(self) -> float:
        return self.clock

    def sleep(self, seconds: float) -> None:
        self.clock += seconds

    def units(self, names: list[str]) -> dict[str, dict[str, str]]:
        return {n: dict(self.unit_state.get(n, {"ActiveState": "inactive", "SubState": "dead"})) for n in names}

    def systemctl(self, args: list[str], timeout: float = 60.0) -> dict[str, Any]:
        self.systemctl_calls.append(args)
        if args[0] in self.on_systemctl:
            self.on_systemctl[args[0]](args)
        return {"cmd": "systemctl " + " ".join(args), "rc": 0, "stdout": "", "stderr": ""}

    def journal(self, invocation_id: str, unit: str, lines: int) -> list[str]:
        return []

    def processes(self) -> dict[int, dict[str, Any]]:
        return {
            pid: dict(p) for pid, p in self.procs.items() if pid not in self.gone_at or self.clock < self.gone_at[pid]
        }

    def listening_ports(self) -> set[int]:
        return {port for p in self.processes().values() for port in p["ports"]}

    def cmdline(self, pid: int) -> list[str]:
        return list(self.procs[pid]["cmdline"])

    def environ(self, pid: int) -> dict[str, str] | None:
        return dict(self.procs[pid].get("environ", {}))

    def cgroup(self, pid: int) -> str:
        return self.procs[pid]["cgroup"]

    def user(self, pid: int) -> str | None:
        return "sglang"

    def fds_readable(self, pid: int) -> bool:
        return True

    def kill(self, targets: list[dict[str, Any]], grace: float) -> list[dict[str, Any]]:
        self.kills.append(targets)
        return []

    def gpus(self) -> dict[int, dict[str, Any]]:
        if isinstance(self.gpu_answer, Exception):
            raise self.gpu_answer
        return self.gpu_answer

    def compute_apps(self, uuid_to_index: dict[str, int]) -> list[dict[str, Any]]:
        self.gpus()
        return []

    def http(
        self, url: str, timeout: float, api_key: str = "", body: dict[str, Any] | None = None
    ) -> tuple[int | None, str]:
        return self.answers.get(url.split(str(PORT), 1)[1], (None, "ConnectionRefusedError: refused"))

    # -- set-up -------------------------------------------------------------------------------

    def process(self, pid: int, cmdline: list[str], cgroup: str = CGROUP, gpus=(0,), ports=(), **more: Any) -> None:
        self.procs[pid] = {
            "pid": pid,
            "ppid": 1,
            "state": "S",
            "starttime": 5000 + pid,
            "cmdline": cmdline,
            "cgroup": cgroup,
            "gpus": list(gpus),
            "ports": list(ports),
            **more,
        }

    def serving(self, pid: int, invocation: str, server_info: dict[str, Any]) -> None:
        """The unit active with ``pid`` as its main process, answering as ``server_info`` says."""
        self.unit_state[UNIT] = {
            "ActiveState": "active",
            "SubState": "running",
            "MainPID": str(pid),
            "InvocationID": invocation,
            "ControlGroup": CGROUP,
            "NRestarts": "0",
        }
        self.process(pid, ARGV, ports=[PORT], environ={"CUDA_VISIBLE_DEVICES": "0"})
        self.answers["/health"] = (200, "")
        self.answers["/server_info"] = (200, json.dumps(server_info))
        self.answers["/v1/completions"] = (200, json.dumps({"choices": [{"text": " Paris"}]}))


def instance(**more: Any) -> dict[str, Any]:
    return {
        "name": "gpu0",
        "unit": UNIT,
        "gpus": [0],
        "port": PORT,
        "argv": ARGV,
        "env": {"CUDA_VISIBLE_DEVICES": "0"},
        "expected_server_info": {"max_running_requests": 48},
        "fingerprint": "f1",
        **more,
    }


def install_desired(host: FakeHost, fingerprint: str = "f1") -> None:
    path = Path(host.state.desired_path("gpu0"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"name": "gpu0", "fingerprint": fingerprint}))


# -- inspect ---------------------------------------------------------------------------------


def test_inspect_on_a_host_whose_nvidia_smi_fails_reports_evidence_errors(tmp_path: Path) -> None:
    host = FakeHost(tmp_path)
    host.serving(100, "inv-1", {"max_running_requests": 48})
    host.gpu_answer = SMI_HANGS
    out = run_op({"op": "inspect", "instances": [instance()]}, host)
    facts = out["instances"]["gpu0"]
    # Quoted once: the compute-apps query of the same broken tool is not a second error.
    assert [e["msg"] for e in facts["evidence_errors"]] == [SMI_HANGS.describe()]
    assert "timed out" in facts["evidence_errors"][0]["msg"]
    assert out["gpu_error"]["rc"] is None
    # The rest of the evidence is still gathered: the decision shows what it would have done.
    assert facts["running"] is True and facts["argv_matches"] is True and facts["env_mismatches"] == {}
    assert facts["server_info_status"] == 200 and "gpu_used_mib" not in facts


def test_inspect_reports_the_settings_evidence_and_the_records(tmp_path: Path) -> None:
    host = FakeHost(tmp_path, secrets_file=str(tmp_path / "secrets.env"))
    (tmp_path / "secrets.env").write_text("SGLANG_API_KEY=sk-secret-1\n")
    host.load_secrets()
    host.serving(100, "inv-1", {"max_running_requests": 48, "api_key": "sk-secret-1"})
    host.procs[100]["cmdline"] = [*ARGV, "--api-key", "sk-secret-1"]
    install_desired(host, "f0")
    out = run_op({"op": "inspect", "instances": [instance()]}, host)
    facts = out["instances"]["gpu0"]
    assert facts["evidence_errors"] == []
    assert facts["argv_matches"] is False and facts["argv"][-1] == "********"
    assert facts["server_info"]["api_key"] == "********"
    assert (facts["installed_fingerprint"], facts["has_last_good"], facts["gpu_used_mib"]) == ("f0", False, {"0": 3})


# -- inspect: a stalled instance (answers /health and /server_info, produces nothing) --------


def metrics(running: int, waiting: int, tokens: int) -> tuple[int, str]:
    """/metrics as SGLang exports it: the gauges per rank, the token counter per mode."""
    lab = 'model_name="qwen3.6-27b",engine_type="unified",tp_rank="0",pp_rank="0"'
    return 200, "\n".join(
        [
            "# TYPE sglang:num_running_reqs gauge",
            f"sglang:num_running_reqs{{{lab}}} {running}.0",
            f"sglang:num_queue_reqs{{{lab}}} {waiting}.0",
            "# TYPE sglang:realtime_tokens_total counter",
            f'sglang:realtime_tokens_total{{{lab},mode="prefill_compute"}} 100.0',
            f'sglang:realtime_tokens_total{{{lab},mode="decode"}} {tokens}.0',
        ]
    )


class MetricsHost(FakeHost):
    """/metrics answers each read with the next of ``reads`` (the last one again after them)."""

    def __init__(self, tmp_path: Path, reads: list[tuple[int | None, str]], **request: Any):
        super().__init__(tmp_path, **request)
        self.reads = list(reads)
        self.metrics_read_at: list[float] = []

    def http(
        self, url: str, timeout: float, api_key: str = "", body: dict[str, Any] | None = None
    ) -> tuple[int | None, str]:
        if url.endswith("/metrics"):
            self.metrics_read_at.append(self.clock)
            return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]
        return super().http(url, timeout, api_key, body)


def inspect_stall(host: MetricsHost, **req: Any) -> dict[str, Any]:
    host.serving(100, "inv-1", {"max_running_requests": 48})
    install_desired(host)
    return run_op({"op": "inspect", "instances": [instance()], **req}, host)["instances"]["gpu0"]


def test_an_instance_that_holds_requests_and_processes_no_token_is_stalled(tmp_path: Path) -> None:
    """/health 200 and /server_info answer, but across the probe interval the requests stay and the
    per-step token counter does not move: the instance is named stalled, with what was seen."""
    host = MetricsHost(tmp_path, [metrics(3, 5, 1000)])
    facts = inspect_stall(host)
    assert facts["health_status"] == 200 and facts["unanswered"] == []
    assert facts["stalled"] == (
        "stalled: 3 running and 5 waiting requests and no token processed in 32s "
        "(sglang:realtime_tokens_total stayed at 1100)"
    )
    # The default probe interval, 5 s; then once the idle scheduler's report is due.
    assert host.metrics_read_at == [1000.0, 1005.0, 1032.0]
    assert facts["evidence_errors"] == []  # the host's evidence answers: unhealthy, not blocked


def test_an_instance_whose_token_counter_moves_is_not_stalled(tmp_path: Path) -> None:
    host = MetricsHost(tmp_path, [metrics(3, 5, 1000), metrics(3, 5, 1004)])
    facts = inspect_stall(host, stall_probe_s=2)
    assert "stalled" not in facts and "stall_check" not in facts
    assert host.metrics_read_at == [1000.0, 1002.0]


def test_the_last_report_of_a_server_just_gone_idle_is_not_a_stall(tmp_path: Path) -> None:
    """0.5.9 keeps its last running count for up to 30 s after going idle, its token counter flat
    (managers/scheduler_runtime_checker_mixin.py:253-258): the report due then says 0 requests."""
    host = MetricsHost(tmp_path, [metrics(4, 0, 1000), metrics(4, 0, 1000), metrics(0, 0, 1000)])
    facts = inspect_stall(host)
    assert "stalled" not in facts and "stall_check" not in facts
    assert host.metrics_read_at == [1000.0, 1005.0, 1032.0]


def test_a_counter_that_moves_by_the_third_read_is_not_a_stall(tmp_path: Path) -> None:
    host = MetricsHost(tmp_path, [metrics(2, 0, 1000), metrics(2, 0, 1000), metrics(2, 0, 1010)])
    assert "stalled" not in inspect_stall(host, stall_probe_s=40)
    # A probe interval longer than the report's due time: the third read follows at once.
    assert host.metrics_read_at == [1000.0, 1040.0, 1040.0]


def test_an_idle_instance_is_read_once_and_not_stalled(tmp_path: Path) -> None:
    host = MetricsHost(tmp_path, [metrics(0, 0, 1000)])
    facts = inspect_stall(host)
    assert "stalled" not in facts and host.metrics_read_at == [1000.0]


def test_without_metrics_the_stall_is_not_checked_and_nothing_is_concluded(tmp_path: Path) -> None:
    host = MetricsHost(tmp_path, [(404, '{"detail":"Not Found"}')])
    facts = inspect_stall(host)
    assert "stalled" not in facts
    assert facts["stall_check"] == "not checked: /metrics answered 404"
    (tmp_path / "b").mkdir()
    host = MetricsHost(tmp_path / "b", [metrics(3, 0, 7)])
    assert "stalled" not in inspect_stall(host, stall_probe_s=0) and host.metrics_read_at == []


def test_a_wedged_instance_is_not_probed_for_a_stall(tmp_path: Path) -> None:
    host = MetricsHost(tmp_path, [metrics(3, 5, 1000)])
    host.serving(100, "inv-1", {})
    host.answers["/server_info"] = (None, "TimeoutError: timed out")
    facts = run_op({"op": "inspect", "instances": [instance()]}, host)["instances"]["gpu0"]
    assert facts["unanswered"] and "stalled" not in facts and host.metrics_read_at == []


# -- stop ------------------------------------------------------------------------------------


def stopping_host(tmp_path: Path, teardown_s: float) -> FakeHost:
    """The main process ignores SIGTERM past the stop deadline; after the unit's SIGKILL the
    kernel takes ``teardown_s`` to tear it down (GPU context, handles, socket)."""
    host = FakeHost(tmp_path)
    host.serving(100, "inv-1", {})

    def stop(args: list[str]) -> None:
        host.unit_state[UNIT].update(ActiveState="deactivating", SubState="stop-sigterm")

    def kill(args: list[str]) -> None:
        host.unit_state[UNIT].update(ActiveState="failed", SubState="failed", MainPID="0")
        host.gone_at[100] = host.clock + teardown_s

    def reset_failed(args: list[str]) -> None:
        host.unit_state[UNIT].update(ActiveState="inactive", SubState="dead")

    host.on_systemctl.update({"stop": stop, "kill": kill, "reset-failed": reset_failed})
    return host


def test_stop_waits_for_a_process_in_teardown_after_sigkill(tmp_path: Path) -> None:
    host = stopping_host(tmp_path, teardown_s=40)
    req = {"op": "stop", "instances": [instance()], "stop_timeout": 30, "kill_timeout": 10, "release_timeout": 300}
    entry = run_op(req, host)["instances"]["gpu0"]
    assert entry["escalated"] is True
    assert entry["dead"] is True and entry["survivors"] == [] and "msg" not in entry
    assert 40 <= entry["teardown_s"] <= 41
    assert host.kills == []  # never signalled again, never taken for a survivor
    assert ["reset-failed", "--", UNIT] in host.systemctl_calls


def test_stop_names_a_process_still_in_teardown_at_the_release_deadline(tmp_path: Path) -> None:
    host = stopping_host(tmp_path, teardown_s=1000)
    req = {"op": "stop", "instances": [instance()], "stop_timeout": 30, "kill_timeout": 10, "release_timeout": 60}
    entry = run_op(req, host)["instances"]["gpu0"]
    assert entry["dead"] is False
    assert entry["msg"].startswith("still in teardown 60s after SIGKILL (the release deadline): PID 100")
    assert host.kills == []


def test_a_wedged_instance_is_sigkilled_after_one_signal_deadline_not_the_drain_deadline(tmp_path: Path) -> None:
    """Its scheduler answers nothing, so there is no drain to wait for: the SIGKILL of its cgroup
    comes after kill_timeout (10 s), not after the 300 s stop deadline."""
    host = stopping_host(tmp_path, teardown_s=2)
    req = {
        "op": "stop",
        "instances": [{**instance(), "wedged": True}],
        "stop_timeout": 300,
        "kill_timeout": 10,
        "release_timeout": 300,
    }
    entry = run_op(req, host)["instances"]["gpu0"]
    assert entry["escalated"] is True and entry["dead"] is True
    assert entry["time_to_dead_s"] < 20
    assert (
        "stop deadline 10s passed (wedged: no drain to wait for): systemctl kill --kill-whom=all --signal=SIGKILL"
        in " ".join(entry["actions"])
    )


def test_an_instance_that_is_not_wedged_gets_the_whole_drain_deadline(tmp_path: Path) -> None:
    host = stopping_host(tmp_path, teardown_s=2)
    req = {"op": "stop", "instances": [instance()], "stop_timeout": 300, "kill_timeout": 10, "release_timeout": 300}
    entry = run_op(req, host)["instances"]["gpu0"]
    assert entry["escalated"] is True and entry["time_to_dead_s"] >= 300


def test_stop_fails_closed_on_a_foreign_holder_and_never_kills_it(tmp_path: Path) -> None:
    host = stopping_host(tmp_path, teardown_s=0)
    host.process(300, ["python3", "trainer.py"], cgroup="/user.slice", gpus=[0])
    req = {"op": "stop", "instances": [instance()], "stop_timeout": 30, "kill_timeout": 10}
    entry = run_op(req, host)["instances"]["gpu0"]
    assert entry["dead"] is False
    assert entry["msg"] == "PID 300 (python3 trainer.py) not an SGLang process, holding GPU [0]"
    assert host.kills == []


# -- start and record ------------------------------------------------------------------------


def starting_host(tmp_path: Path, server_info: dict[str, Any]) -> FakeHost:
    """The unit is stopped; a start runs a new main process 200 answering with ``server_info``."""
    host = FakeHost(tmp_path)
    install_desired(host)
    (Path(host.service.definitions_dir) / UNIT).write_text("[Service]\nExecStart=new\n")
    host.on_systemctl["start"] = lambda args: host.serving(200, "inv-2", server_info)
    return host


def test_start_refuses_when_the_port_is_held(tmp_path: Path) -> None:
    host = starting_host(tmp_path, {})
    host.process(555, ["python3", "-m", "http.server", str(PORT)], cgroup="/user.slice", gpus=(), ports=[PORT])
    entry = run_op({"op": "start", "instances": [instance()]}, host)["instances"]["gpu0"]
    assert entry["msg"] == f"port {PORT} is already in use by PID 555 (python3 -m http.server {PORT})"
    assert entry["started"] is False
    assert not any(call[0] == "start" for call in host.systemctl_calls)


def test_start_refuses_desired_settings_the_host_does_not_have(tmp_path: Path) -> None:
    host = starting_host(tmp_path, {})
    install_desired(host, "f0")
    entry = run_op({"op": "start", "instances": [instance()]}, host)["instances"]["gpu0"]
    assert "is not the inventory's (f1)" in entry["msg"]
    assert host.systemctl_calls == []


def test_start_proves_the_settings_and_records_them_as_last_good(tmp_path: Path) -> None:
    host = starting_host(tmp_path, {"max_running_requests": 48, "version": "0.5.23"})
    req = {"op": "start", "instances": [instance(old_main_pid=100, old_invocation_id="inv-1")]}
    entry = run_op(req, host)["instances"]["gpu0"]
    assert entry["healthy"] is True, entry.get("msg")
    assert (entry["new_main_pid"], entry["version"], entry["smoke"]["ok"]) == (200, "0.5.23", 2)
    record = json.loads(Path(host.state.last_good_path("gpu0")).read_text())
    assert (record["argv"], record["unit_text"]) == (ARGV, "[Service]\nExecStart=new\n")


def test_start_fails_a_server_reporting_other_settings(tmp_path: Path) -> None:
    host = starting_host(tmp_path, {"max_running_requests": 99})
    entry = run_op({"op": "start", "instances": [instance()]}, host)["instances"]["gpu0"]
    assert entry["healthy"] is False
    assert entry["msg"] == "/server_info reports other settings: max_running_requests=99 (expected 48)"
    assert entry["server_info_mismatches"] == [{"arg": "max_running_requests", "expected": 48, "reported": 99}]
    assert not host.state.has_last_good("gpu0")


def test_start_reports_a_crash(tmp_path: Path) -> None:
    host = starting_host(tmp_path, {})
    host.on_systemctl["start"] = lambda args: host.unit_state.update(
        {UNIT: {"ActiveState": "failed", "SubState": "failed", "Result": "exit-code", "MainPID": "0"}}
    )
    entry = run_op({"op": "start", "instances": [instance()]}, host)["instances"]["gpu0"]
    assert entry["crashed"] is True
    assert entry["msg"] == "crashed while starting: unit failed/failed (result exit-code)"


def test_start_gives_up_at_its_deadline(tmp_path: Path) -> None:
    host = starting_host(tmp_path, {})
    host.on_systemctl["start"] = lambda args: host.unit_state.update(
        {UNIT: {"ActiveState": "activating", "SubState": "start-pre", "MainPID": "0"}}
    )
    entry = run_op({"op": "start", "instances": [instance()], "start_timeout": 120}, host)["instances"]["gpu0"]
    assert entry["msg"] == "not healthy within the start deadline of 120s (unit activating/start-pre)"
    assert host.clock >= 1120


def test_record_writes_the_last_good_file(tmp_path: Path) -> None:
    host = FakeHost(tmp_path)
    (Path(host.service.definitions_dir) / UNIT).write_text("[Service]\nExecStart=x\n")
    out = run_op({"op": "record", "instances": [instance()]}, host)
    assert out["recorded"] == ["gpu0"]
    record = json.loads(Path(tmp_path / "state/instances/gpu0/last-good.json").read_text())
    assert record["unit_path"] == str(Path(host.service.definitions_dir) / UNIT)
    assert record["unit_text"] == "[Service]\nExecStart=x\n"
    assert (record["argv"], record["expected_server_info"], record["fingerprint"]) == (
        ARGV,
        {"max_running_requests": 48},
        "f1",
    )


def test_inspect_in_check_mode_reads_the_startup_journal_as_observe_does(tmp_path: Path) -> None:
    """retune.yml --check asks inspect for the startup lines of each running instance's current
    run (op_observe's reader): the model facts of the predicted capacity after a relaunch."""
    host = FakeHost(tmp_path)
    asked: list[tuple[str, str, str]] = []
    lines = ["Load weight end. elapsed=2.00 s, avail mem=100.00 GB, mem usage=50.00 GB."]

    def startup_journal(invocation_id: str, unit: str, pattern: str) -> list[str]:
        asked.append((invocation_id, unit, pattern))
        return lines

    host.startup_journal = startup_journal  # type: ignore[attr-defined]
    host.serving(100, "inv-1", {"max_running_requests": 48})
    install_desired(host, "f0")
    plain = run_op({"op": "inspect", "instances": [instance()]}, host)["instances"]["gpu0"]
    assert "journal" not in plain and asked == []
    facts = run_op({"op": "inspect", "instances": [instance()], "startup_journal": True}, host)["instances"]["gpu0"]
    assert facts["journal"] == lines and facts["journal_source"] == "host"
    assert asked[0][:2] == ("inv-1", UNIT) and "Mamba Cache is allocated" in asked[0][2]


def test_a_real_run_reads_the_startup_journal_only_of_instances_whose_settings_change(tmp_path: Path) -> None:
    """Outside check mode the retune asks for the journal of the instances it may relaunch with new
    settings (the fit pre-flight): an unchanged instance costs no journal read; a command line or
    an environment that differs does."""
    host = FakeHost(tmp_path)
    asked: list[str] = []

    def startup_journal(invocation_id: str, unit: str, pattern: str) -> list[str]:
        asked.append(invocation_id)
        return ["Load weight end. elapsed=2.00 s, avail mem=100.00 GB, mem usage=50.00 GB."]

    host.startup_journal = startup_journal  # type: ignore[attr-defined]
    host.serving(100, "inv-1", {"max_running_requests": 48})
    install_desired(host, "f1")
    same = run_op({"op": "inspect", "instances": [instance()], "startup_journal": "changed"}, host)["instances"]
    assert "journal" not in same["gpu0"] and asked == []
    flags = instance(argv=[*ARGV, "--max-running-requests", "64"])
    changed = run_op({"op": "inspect", "instances": [flags], "startup_journal": "changed"}, host)["instances"]
    assert changed["gpu0"]["journal"] and asked == ["inv-1"]
    env = instance(env={"CUDA_VISIBLE_DEVICES": "0", "SGLANG_X": "1"})
    run_op({"op": "inspect", "instances": [env], "startup_journal": "changed"}, host)
    assert asked == ["inv-1", "inv-1"]
    run_op({"op": "inspect", "instances": [instance()], "startup_journal": "all"}, host)
    assert asked == ["inv-1", "inv-1", "inv-1"]


def _recording_clients(host: Any) -> list[tuple[str, dict[str, Any]]]:
    calls: list[tuple[str, dict[str, Any]]] = []

    def client_call(unit: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        calls.append((unit, request))
        return {"resumed": request["endpoints"], "capacity": {url: 64 for url in request["endpoints"]}}

    host.client_call = client_call
    return calls


def test_start_hands_the_wave_back_to_the_clients_once_every_instance_is_healthy(tmp_path: Path) -> None:
    host = starting_host(tmp_path, {"max_running_requests": 48})
    calls = _recording_clients(host)
    url = "http://127.0.0.1:30000"
    req = {"op": "start", "instances": [instance()], "resume_clients": {"gen.service": [url]}}
    result = run_op(req, host)
    assert result["instances"]["gpu0"]["healthy"] is True
    assert calls == [("gen.service", {"op": "resume", "endpoints": [url], "by": "sglang-fleet retune", "confirm": 0.0})]
    assert result["resumed"] == {"gen.service": {"resumed": [url], "capacity": {url: 64}, "ok": True}}


def test_start_leaves_the_resume_to_the_retune_when_an_instance_is_not_healthy(tmp_path: Path) -> None:
    host = starting_host(tmp_path, {"max_running_requests": 99})
    calls = _recording_clients(host)
    req = {"op": "start", "instances": [instance()], "resume_clients": {"gen.service": ["http://127.0.0.1:30000"]}}
    result = run_op(req, host)
    assert result["instances"]["gpu0"]["healthy"] is False
    assert calls == [] and "resumed" not in result


# -- the request ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "key"),
    [
        ("stop", "stop_timeout"),
        ("stop", "release_timeout"),
        ("release", "threshold_mib"),
        ("start", "health_timeout"),
        ("start", "smoke_requests"),
    ],
)
def test_a_request_without_a_key_it_reads_fails_naming_it_before_touching_anything(
    tmp_path: Path, op: str, key: str
) -> None:
    """The agent keeps no fallbacks: a value the controller did not send is never guessed."""
    host = FakeHost(tmp_path)
    host.unit_state[UNIT] = {"ActiveState": "active", "SubState": "running", "MainPID": "100"}
    request = {k: v for k, v in REQUEST.items() if k != key}
    out = ops.run({**request, "op": op, "instances": [instance()]}, host)
    assert out == {
        "failed": True,
        "msg": f"the request to the host agent has no {key!r} (its sender must give every key it reads)",
    }
    assert host.systemctl_calls == []
    assert host.kills == []


def test_the_host_requires_the_secrets_file_and_reads_the_rest_when_first_used(tmp_path: Path) -> None:
    with pytest.raises(RequestError, match="'secrets_file'"):
        Host({})
    host = Host({"secrets_file": str(tmp_path / "none.env")})
    with pytest.raises(RequestError, match="'poll_interval'"):
        host.wait(lambda: True, 0.0)
    with pytest.raises(RequestError, match="'state_dir'"):
        host.state.desired_path("gpu0")


def test_the_status_playbooks_inspect_request_is_complete(tmp_path: Path) -> None:
    """playbooks/status.yml runs retune_phase op=inspect itself: its options (the filter
    retune_agent_options over the role's values) are every key the agent reads."""
    host = FakeHost(tmp_path)
    host.serving(100, "inv-1", {"max_running_requests": 48})
    install_desired(host, "f1")
    options = retune_agent_options({"http_timeout": "30", "poll_interval": "0.5", "stall_probe_s": "5"})
    got = ops.run({"op": "inspect", "instances": [instance()], **options}, host)
    assert not got.get("failed"), got
    assert got["instances"]["gpu0"]["running"] is True
