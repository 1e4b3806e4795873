"""apply from recorded events: the saved plan's fingerprints, the fleet lock, every instance proven."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from sglang_fleet_ops import cli
from sglang_fleet_ops.plan import build_plan

TASK_RETUNE = "Relaunch the instances whose running settings differ"


def run_cli(rec: Any, project: Path, argv: list[str], *runs: Any) -> tuple[int, str, str, Any]:
    runner = rec.FakeRunner(list(runs))
    out, err = io.StringIO(), io.StringIO()
    code = cli.main([*argv, "--project-dir", str(project)], runner=runner, out=out, err=err)
    return code, out.getvalue(), err.getvalue(), runner


def saved_plan(rec: Any, tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(build_plan(rec.run_of(rec.events("plan_events")))))
    return path


def summary(out: str) -> dict[str, Any]:
    run_dir = Path(out.splitlines()[-1].removeprefix("artifacts: "))
    loaded: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return loaded


def test_apply_with_a_current_plan_runs_under_the_fleet_lock_and_exits_0(
    rec: Any, project: Path, tmp_path: Path
) -> None:
    plan = saved_plan(rec, tmp_path)
    code, out, err, runner = run_cli(
        rec, project, ["apply", "--plan", str(plan), "--lock-wait", "120"],
        rec.run_of(rec.events("plan_events")), rec.run_of(rec.events("apply_events"), ident="apply"),
    )  # fmt: skip
    assert code == 0, err
    check, apply = runner.requests
    assert (check.check, check.ident) == (True, "check")
    assert (apply.check, apply.playbook) == (False, "sglang_ops.fleet.retune")
    assert apply.extravars == {"sglang_retune_fleet_lock": True, "sglang_retune_lock_wait": 120}
    result = summary(out)
    assert result["exit"] == 0 and result["problems"] == []
    (_gpu0, gpu1) = result["hosts"]["gpu-a"]["instances"]
    assert (gpu1["action"], gpu1["new_main_pid"], gpu1["effective_max_running_requests_after"]) == (
        "relaunched",
        4200,
        40,
    )
    assert result["counts"] == {"unchanged": 2, "relaunched": 1}
    assert [r["ident"] for r in result["runs"]] == ["check", "apply"]
    assert "| gpu-a/gpu1 | relaunched | running | 16 → 40 |" in out


def test_apply_refuses_a_stale_plan_naming_both_fingerprints_and_touches_nothing(
    rec: Any, project: Path, tmp_path: Path
) -> None:
    plan = saved_plan(rec, tmp_path)
    saved = json.loads(plan.read_text())
    now = rec.events("plan_events")
    rec.retune_instance(now, "gpu-b", "gpu0")["old_main_pid"] = 5999  # restarted since the plan
    code, out, err, runner = run_cli(rec, project, ["apply", "--plan", str(plan)], rec.run_of(now))
    assert code == 3
    assert len(runner.requests) == 1 and runner.requests[0].check  # the real run was never asked for
    fresh = build_plan(rec.run_of(now))
    assert f"fleet_fingerprint: plan {saved['fleet_fingerprint']}, now {fresh['fleet_fingerprint']}" in err
    assert "inventory_fingerprint" not in err  # that one still matches
    result = summary(out)
    assert result["exit"] == 3 and result["touched"] is False


def test_apply_refuses_when_the_inventory_changed_since_the_plan(rec: Any, project: Path, tmp_path: Path) -> None:
    plan = saved_plan(rec, tmp_path)
    now = rec.events("plan_events")
    for e in now:
        if e["event_data"]["task_action"] == "sglang_ops.fleet.server_validate" and e["event_data"]["host"] == "gpu-a":
            e["event_data"]["res"]["instances"][1]["fingerprint"] = "fp-a1-other"
    code, _, err, runner = run_cli(rec, project, ["apply", "--plan", str(plan)], rec.run_of(now))
    assert code == 3 and len(runner.requests) == 1
    assert "inventory_fingerprint: plan sha256:" in err


def test_apply_refuses_when_the_plan_now_has_errors(rec: Any, project: Path, tmp_path: Path) -> None:
    plan = saved_plan(rec, tmp_path)
    code, _, err, runner = run_cli(rec, project, ["apply", "--plan", str(plan)], rec.run_of([], rc=4))
    assert code == 1 and len(runner.requests) == 1
    assert "error: ansible-playbook sglang_ops.fleet.retune ended with rc 4 before any task" in err


def test_a_second_apply_fails_with_4_naming_the_holder(rec: Any, project: Path) -> None:
    code, out, err, runner = run_cli(
        rec, project, ["apply"], rec.run_of(rec.events("apply_locked_events"), ident="apply")
    )
    assert code == 4
    assert runner.requests[0].extravars == {"sglang_retune_fleet_lock": True, "sglang_retune_lock_wait": 0}
    assert "gpu-b: the host is locked by run 3f9a0c1d2e4b5a6c (user ci on controller runner-7" in err
    result = summary(out)
    assert result["exit"] == 4 and result["touched"] is False


def test_the_clients_lines_of_each_host_are_in_the_summary(rec: Any, project: Path) -> None:
    evts = rec.events("apply_events")
    retune = rec.find(evts, "gpu-a", TASK_RETUNE)
    note = "client sglang-fleet-generate.service: drained per wave, never stopped (gpu1: 0.4 s, 0 abandoned)"
    retune["event_data"]["res"]["notes"] = [note]
    code, out, err, _ = run_cli(rec, project, ["apply"], rec.run_of(evts, ident="apply"))
    assert code == 0, err
    assert summary(out)["hosts"]["gpu-a"]["notes"] == [note]
    assert f"### Generation clients and notes\n\n- gpu-a: {note}" in out


def test_a_rolled_back_instance_fails_the_apply(rec: Any, project: Path) -> None:
    evts = rec.events("apply_events")
    retune = rec.find(evts, "gpu-a", TASK_RETUNE)
    retune["event"] = "runner_on_failed"
    inst = rec.retune_instance(evts, "gpu-a", "gpu1")
    msg = "new settings failed (crashed at start); rolled back to the last good settings, which are healthy"
    inst.update(action="rolled_back", msg=msg)
    retune["event_data"]["res"].update(failed=True, msg=f"gpu1: {msg}")
    code, out, err, _ = run_cli(rec, project, ["apply"], rec.run_of(evts, ident="apply"))
    assert code == 1
    assert f"gpu-a/gpu1: rolled_back: {msg}" in err
    result = summary(out)
    assert result["hosts"]["gpu-a"]["status"] == "failed"
    assert "## Apply: FAILED" in out


def test_a_host_the_apply_never_reached_fails_it(rec: Any, project: Path) -> None:
    evts = [
        e
        for e in rec.events("apply_events")
        if not (e["event_data"]["host"] == "gpu-b" and e["event_data"]["task"] == TASK_RETUNE)
    ]
    code, _, err, _ = run_cli(rec, project, ["apply"], rec.run_of(evts, rc=0, ident="apply"))
    assert code == 1
    assert "gpu-b: failed: no retune result for this host" in err


def test_hosts_skipped_after_a_failed_canary_fail_the_apply(rec: Any, project: Path) -> None:
    evts = [
        e
        for e in rec.events("apply_events")
        if not (e["event_data"]["host"] == "gpu-b" and e["event_data"]["play"].startswith("Retune"))
    ]
    evts.append(
        {
            "event": "runner_on_ok",
            "event_data": {
                "host": "gpu-b",
                "play": "Retune the other hosts, if every canary host succeeded",
                "task": "Record why these hosts are left as they are (a canary host failed)",
                "task_action": "ansible.builtin.set_fact",
                "res": {
                    "ansible_facts": {
                        "sglang_retune_result": {
                            "changed": False,
                            "skipped": True,
                            "msg": "not retuned: canary host(s) gpu-a failed",
                        }
                    }
                },
            },
        }
    )
    code, out, _err, _ = run_cli(rec, project, ["apply"], rec.run_of(evts, rc=2, ident="apply"))
    assert code == 1
    result = summary(out)
    assert result["hosts"]["gpu-b"]["status"] == "skipped"
    assert result["hosts"]["gpu-b"]["instances"] == [
        {"name": "gpu0", "action": "skipped", "msg": "not retuned: canary host(s) gpu-a failed"}
    ]


def test_an_unreadable_plan_is_an_error(rec: Any, project: Path, tmp_path: Path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text("{}")
    code, _, err, runner = run_cli(rec, project, ["apply", "--plan", str(bad)])
    assert code == 1 and runner.requests == []
    assert "cannot read the plan" in err
