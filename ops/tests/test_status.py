"""status from recorded events of playbooks/status.yml: the table, the JSON and the exit status."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from sglang_fleet_ops import cli
from sglang_fleet_ops.status import build_status, parse_metrics, status_exit

CHECK_TASK = "Ask the retune whether each instance serves the inventory's settings (check mode)"


def run_cli(rec: Any, project: Path, argv: list[str], run: Any) -> tuple[int, str, str, Any]:
    runner = rec.FakeRunner([run])
    out, err = io.StringIO(), io.StringIO()
    code = cli.main([*argv, "--project-dir", str(project)], runner=runner, out=out, err=err)
    return code, out.getvalue(), err.getvalue(), runner


def all_desired(rec: Any) -> list[dict[str, Any]]:
    evts = rec.events("status_events")
    for inst in rec.find(evts, "gpu-a", CHECK_TASK)["event_data"]["res"]["instances"]:
        inst.update(action="unchanged", reasons=[], flag_diff={})
    return evts


def test_status_json_per_instance_and_client(rec: Any, project: Path) -> None:
    code, out, err, runner = run_cli(
        rec, project, ["status", "--json"], rec.run_of(rec.events("status_events"), ident="status")
    )
    assert code == 2, err  # gpu1 runs other settings than the inventory's
    assert runner.requests[0].playbook == "sglang_ops.fleet.status" and not runner.requests[0].check
    # stdout is the JSON alone (json.loads of all of it); the artifacts line is on stderr.
    status = json.loads(out)
    assert err.splitlines()[-1].startswith("artifacts: ")
    gpu0, gpu1 = status["hosts"]["gpu-a"]["instances"]
    assert (gpu0["running"], gpu0["main_pid"], gpu0["uptime_s"], gpu0["health"]) == (True, 4101, 93784, 200)
    assert gpu0["serves_desired"] and gpu0["installed_is_desired"] and gpu0["ok"]
    # From /metrics (it exports them).
    assert (gpu0["running_requests"], gpu0["queued_requests"], gpu0["effective_max_running_requests"]) == (
        38.0,
        5.0,
        40,
    )
    assert (gpu0["token_usage"], gpu0["mamba_usage"], gpu0["gen_throughput_tok_s"]) == (0.71, 0.95, 1234.5)
    assert gpu0["usage_source"] == "metrics"
    assert gpu0["gpus"] == {"0": {"used_mib": 171000, "total_mib": 183359}}
    # /metrics refused (API key): /server_info's internal_states instead.
    assert gpu1["usage_source"] == "server_info" and gpu1["gen_throughput_tok_s"] == 301.0
    assert gpu1["running_requests"] is None
    assert (
        gpu1["metrics_error"]
        == "/metrics answered 401: Status code was 401 and not [200]: HTTP Error 401: Unauthorized"
    )
    assert (gpu1["serves_desired"], gpu1["check"], gpu1["ok"]) == (False, "would_relaunch", False)
    assert gpu1["reasons"] == ["command line differs: mem_fraction_static 0.88→0.93"]
    (client,) = status["hosts"]["gpu-a"]["clients"]
    assert client == {
        "unit": "sglang-fleet-generate.service",
        "active_state": "active",
        "sub_state": "running",
        "state": "running",
        "done": 41200,
        "total": 62500,
        "requests_per_s": 3.41,
        "completion_tokens_per_s": 12800.0,
        "eta_s": 6246,
        "error": None,
        "stalled": {},
        "disabled": {},
    }
    assert status["not_ok"] == ["gpu-a/gpu1"]


def test_status_table_for_people(rec: Any, project: Path) -> None:
    code, out, _, _ = run_cli(rec, project, ["status"], rec.run_of(all_desired(rec), ident="status"))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "host/instance",
        "unit",
        "pid",
        "uptime",
        "health",
        "settings",
        "run/queue/max",
        "KV",
        "mamba",
        "gen",
        "tok/s",
        "GPU",
        "MiB",
    ]
    assert lines[1].split() == [
        "gpu-a/gpu0",
        "active/running",
        "4101",
        "1d02h",
        "200",
        "desired",
        "38/5/40",
        "0.71",
        "0.95",
        "1234.5",
        "171000/183359",
    ]
    assert lines[2].split() == [
        "gpu-a/gpu1",
        "active/running",
        "4102",
        "1:00:05",
        "200",
        "desired",
        "-/-/16",
        "-",
        "-",
        "301.0",
        "160000/183359",
    ]
    assert lines[3] == (
        "client gpu-a/sglang-fleet-generate.service: active/running state running progress 41200/62500 "
        "rate 3.41 req/s ETA 1:44:06"
    )
    assert lines[-1].startswith("artifacts: ")


def test_an_instance_down_or_unhealthy_is_not_ok(rec: Any) -> None:
    evts = all_desired(rec)
    facts = rec.find(evts, "gpu-a", "Inspect the running instances")["event_data"]["res"]["instances"]
    facts["gpu0"]["health_status"] = 503
    status = build_status(rec.run_of(evts, ident="status"))
    assert status["not_ok"] == ["gpu-a/gpu0"] and status_exit(status) == 2


def test_an_unreachable_host_is_an_error(rec: Any) -> None:
    evts = rec.events("status_events")[:1]
    evts.append(
        {
            "event": "runner_on_unreachable",
            "event_data": {
                "host": "gpu-b",
                "play": "Status",
                "task": "Inspect the running instances",
                "task_action": "sglang_ops.fleet.retune_phase",
                "res": {"unreachable": True, "msg": "ssh: connect to host gpu-b port 22: No route to host"},
            },
        }
    )
    status = build_status(rec.run_of(evts, rc=4, ident="status"))
    assert status_exit(status) == 1
    assert (
        "gpu-b: unreachable: Inspect the running instances: ssh: connect to host gpu-b port 22: No route to host"
        in (status["problems"])
    )


def test_no_inspection_is_an_error(rec: Any) -> None:
    evts = [e for e in all_desired(rec) if e["event_data"]["task"] != "Inspect the running instances"]
    status = build_status(rec.run_of(evts, ident="status"))
    assert status_exit(status) == 1 and status["problems"] == ["gpu-a: failed: no inspection result"]


def test_metrics_take_the_largest_series() -> None:
    text = 'sglang:token_usage{tp_rank="0"} 0.5\nsglang:token_usage{tp_rank="1"} 0.75\nsglang:other 3\n# comment\n'
    # 0.5.9: token_usage is the KV cache's usage.
    assert parse_metrics(text) == {"token_usage": 0.75, "kv_usage": 0.75}


class _ReaderGone(io.StringIO):
    """A stdout whose reader has gone (`sglang-fleet-ops status | head`): every write fails."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        raise io.UnsupportedOperation("no descriptor")


def test_a_reader_that_goes_away_costs_the_output_not_the_status_or_the_artifacts(rec: Any, project: Path) -> None:
    runner = rec.FakeRunner([rec.run_of(rec.events("status_events"), ident="status")])
    err = io.StringIO()
    code = cli.main(["status", "--project-dir", str(project)], runner=runner, out=_ReaderGone(), err=err)
    assert code == 2, err.getvalue()  # gpu1 runs other settings than the inventory's, as without the pipe
    assert "stdout was closed by its reader; the rest of the output is dropped" in err.getvalue()
    assert "Traceback" not in err.getvalue()
    summaries = list((project / ".sglang-fleet-ops" / "runs").glob("*-status/summary.json"))
    assert len(summaries) == 1 and json.loads(summaries[0].read_text())["exit"] == 2


def with_client_status(evts: list[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    """The recorded status file of the host's generation client, with ``fields`` changed."""
    import base64  # noqa: PLC0415

    files = [e for e in evts if e["event_data"]["task"] == "Read the status file of each generation client"]
    for e in files:
        for item in e["event_data"]["res"].get("results") or []:
            if item.get("content"):
                st = json.loads(base64.b64decode(item["content"]))
                st.update(fields)
                item["content"] = base64.b64encode(json.dumps(st).encode()).decode()
    return evts


def test_a_stalled_endpoint_of_a_client_is_named_and_not_ok(rec: Any, project: Path) -> None:
    why = "no completion for 412.0s with 40 request(s) in flight while other endpoints completed (threshold 400.0s)"
    evts = with_client_status(all_desired(rec), stalled={"http://127.0.0.1:30002": why})
    code, out, _, _ = run_cli(rec, project, ["status"], rec.run_of(evts, ident="status"))
    assert code == 2
    assert f"  STALLED http://127.0.0.1:30002: {why}" in out.splitlines()
    assert "NOT OK gpu-a/sglang-fleet-generate.service: endpoint http://127.0.0.1:30002 stalled" in out


def test_an_endpoint_a_client_took_out_of_service_is_named_and_not_ok(rec: Any, project: Path) -> None:
    why = "HTTP 401 (API key rejected)"
    evts = with_client_status(all_desired(rec), disabled={"http://127.0.0.1:30001": why})
    code, out, _, _ = run_cli(rec, project, ["status"], rec.run_of(evts, ident="status"))
    assert code == 2
    assert f"  OUT OF SERVICE http://127.0.0.1:30001: {why}" in out.splitlines()
    assert "NOT OK gpu-a/sglang-fleet-generate.service: endpoint http://127.0.0.1:30001 taken out of service" in out


def test_kv_usage_is_full_token_usage_from_0_5_14() -> None:
    """0.5.14+: token_usage is the fullest pool (here the Mamba pool), the KV cache is full_token_usage."""
    text = (
        'sglang:token_usage{tp_rank="0"} 0.97\n'
        'sglang:full_token_usage{tp_rank="0"} 0.03\n'
        'sglang:mamba_usage{tp_rank="0"} 0.97\n'
    )
    assert parse_metrics(text)["kv_usage"] == 0.03
