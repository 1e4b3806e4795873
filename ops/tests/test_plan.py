"""plan and drift from recorded events of retune.yml in check mode: exit statuses, plan.json,
plan.md, fingerprints."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from sglang_fleet_ops import cli
from sglang_fleet_ops.plan import build_plan, plan_exit, plan_markdown

TASK_RETUNE = "Relaunch the instances whose running settings differ"
TASK_UNITS = "Install units, records and helpers; start the instances that are not running"


def nothing_to_do(rec: Any) -> list[dict[str, Any]]:
    evts = rec.events("plan_events")
    inst = rec.retune_instance(evts, "gpu-a", "gpu1")
    inst.update(action="unchanged", reasons=[], flag_diff={})
    units = rec.find(evts, "gpu-a", TASK_UNITS)["event_data"]["res"]
    units.update(changed=False, diff=[])
    return evts


def run_cli(rec: Any, project: Path, argv: list[str], *runs: Any) -> tuple[int, str, str, Any]:
    runner = rec.FakeRunner(list(runs))
    out, err = io.StringIO(), io.StringIO()
    code = cli.main([*argv, "--project-dir", str(project)], runner=runner, out=out, err=err)
    return code, out.getvalue(), err.getvalue(), runner


def test_a_plan_with_changes_exits_2_and_writes_plan_json_and_md(rec: Any, project: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "mr"
    code, out, err, runner = run_cli(
        rec, project, ["plan", "-i", "inv/prod", "--out", str(out_dir)], rec.run_of(rec.events("plan_events"))
    )
    assert code == 2, err
    (request,) = runner.requests
    assert request.playbook == "sglang_ops.fleet.retune" and request.check and request.extravars == {}
    assert runner.calls[0]["inventory"] == "inv/prod"
    plan = json.loads((out_dir / "plan.json").read_text())
    run_dir = Path(out.splitlines()[-1].removeprefix("artifacts: "))
    assert out.splitlines()[-1].startswith("artifacts: ") and run_dir.parent == project / ".sglang-fleet-ops" / "runs"
    assert json.loads((run_dir / "plan.json").read_text()) == plan
    assert (run_dir / "plan.md").read_text() == (out_dir / "plan.md").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["exit"] == 2
    assert plan["format"] == 1 and plan["changes"] == 1 and plan["problems"] == []
    assert set(plan["hosts"]) == {"gpu-a", "gpu-b"}
    gpu0, gpu1 = plan["hosts"]["gpu-a"]["instances"]
    assert (gpu0["action"], gpu0["unit_diff"], gpu0["effective_max_running_requests_now"]) == ("unchanged", None, 40)
    assert gpu1["action"] == "relaunch" and gpu1["blocked"] is False and gpu1["predicted_after"] is None
    assert gpu1["flag_diff"]["changed"] == {"mem_fraction_static": [0.88, 0.93]}
    assert gpu1["reasons"] == ["command line differs: mem_fraction_static 0.88→0.93"]
    # The unit file's diff only: not the desired-settings record beside it.
    assert gpu1["unit_diff"].startswith("--- /etc/systemd/system/sglang-gpu1.service\n+++ ")
    assert "-  --mem-fraction-static 0.88\n+  --mem-fraction-static 0.93\n" in gpu1["unit_diff"]
    assert "fingerprint" not in gpu1["unit_diff"]


def test_plan_md_is_a_table_a_reviewer_reads(rec: Any) -> None:
    md = plan_markdown(build_plan(rec.run_of(rec.events("plan_events"))))
    assert md.startswith("## Plan: 1 instance(s) to relaunch or start\n")
    assert "| host/instance | action | flag changes | capacity now → after |" in md
    assert "| gpu-a/gpu1 | relaunch | mem_fraction_static 0.88→0.93 | 16 → - |" in md
    assert "| gpu-a/gpu0 | unchanged |  | 40 |" in md
    assert "| gpu-b/gpu0 | unchanged |  | 40 |" in md
    assert "Problems" not in md


def test_nothing_to_do_exits_0(rec: Any, project: Path) -> None:
    code, out, err, _ = run_cli(rec, project, ["plan", "--out", str(project / "o")], rec.run_of(nothing_to_do(rec)))
    assert (code, err) == (0, "")
    assert "## Plan: nothing to do" in out


def test_a_unit_file_to_update_alone_is_a_change(rec: Any) -> None:
    evts = rec.events("plan_events")
    rec.retune_instance(evts, "gpu-a", "gpu1").update(action="unchanged", reasons=[], flag_diff={})
    plan = build_plan(rec.run_of(evts))
    assert plan["changes"] == 0 and plan["units_changed"] and plan_exit(plan) == 2


def test_a_blocked_instance_exits_1_naming_it_on_stderr_and_in_plan_md(rec: Any, project: Path) -> None:
    evts = rec.events("plan_events")
    retune = rec.find(evts, "gpu-b", TASK_RETUNE)
    retune["event"] = "runner_on_failed"
    why = "a process that is not this instance's holds its GPU or port: PID 777 (python train.py) holds GPU 0"
    retune["event_data"]["res"].update(failed=True, msg=f"failed closed, nothing changed on this host: gpu0: {why}")
    retune["event_data"]["res"]["instances"][0].update(action="failed", reasons=[why])
    code, _out, err, _ = run_cli(rec, project, ["plan", "--out", str(project / "o")], rec.run_of(evts))
    assert code == 1
    plan = json.loads((project / "o" / "plan.json").read_text())
    inst = plan["hosts"]["gpu-b"]["instances"][0]
    assert (inst["action"], inst["blocked"], inst["why"]) == ("blocked", True, why)
    assert plan["hosts"]["gpu-b"]["status"] == "failed"
    assert f"gpu-b/gpu0: blocked: {why}" in plan["problems"]
    assert f"error: gpu-b/gpu0: blocked: {why}" in err
    assert "### Problems" in (project / "o" / "plan.md").read_text()


def test_an_unreachable_host_exits_1(rec: Any) -> None:
    evts = [
        e
        for e in rec.events("plan_events")
        if e["event_data"]["host"] != "gpu-b" or e["event_data"]["play"].startswith("Validate")
    ]
    evts.append(
        {
            "event": "runner_on_unreachable",
            "event_data": {
                "host": "gpu-b",
                "play": "Retune the other hosts, if every canary host succeeded",
                "task": "Take the host lock",
                "task_action": "sglang_ops.fleet.host_lock",
                "res": {
                    "unreachable": True,
                    "msg": "Failed to connect to the host via ssh: timed out",
                    "changed": False,
                },
            },
        }
    )
    plan = build_plan(rec.run_of(evts, rc=4))
    assert plan_exit(plan) == 1
    assert plan["hosts"]["gpu-b"]["status"] == "unreachable"
    assert plan["hosts"]["gpu-b"]["instances"][0]["action"] == "failed"
    assert (
        "gpu-b: unreachable: Take the host lock: Failed to connect to the host via ssh: timed out" in plan["problems"]
    )


def test_a_validation_problem_exits_1(rec: Any) -> None:
    evts = rec.events("plan_events")
    first = evts[0]
    assert first["event_data"]["host"] == "gpu-a"
    problem = "gpu-a: instance gpu1: sglang_server_args.mem_fraction_static: 1.5 is not in (0, 1]"
    first["event"] = "runner_on_failed"
    first["event_data"]["res"] = {
        "failed": True,
        "msg": f"SGLang settings of host gpu-a: {problem}",
        "problems": [problem],
    }
    # any_errors_fatal: the run ends after the validation play.
    evts = [evts[0], evts[1]]
    plan = build_plan(rec.run_of(evts))
    assert plan_exit(plan) == 1
    assert f"gpu-a: {problem}" in plan["problems"]
    assert plan["hosts"]["gpu-b"]["status"] == "failed"  # validated, but never planned: no result is an error


def test_a_host_without_a_retune_result_is_an_error(rec: Any) -> None:
    evts = [
        e
        for e in rec.events("plan_events")
        if not (e["event_data"]["host"] == "gpu-b" and e["event_data"]["task"] == TASK_RETUNE)
    ]
    plan = build_plan(rec.run_of(evts, rc=0))
    assert plan_exit(plan) == 1
    assert plan["hosts"]["gpu-b"]["status"] == "failed"
    assert "no retune result" in plan["hosts"]["gpu-b"]["msg"]


def test_a_failed_run_with_no_failed_task_is_an_error(rec: Any) -> None:
    plan = build_plan(rec.run_of(nothing_to_do(rec), rc=4))
    assert plan_exit(plan) == 1
    assert plan["problems"] == ["ansible-playbook ended with rc 4 (failed) and no failed task was recorded"]


def test_a_run_that_reached_no_host_is_an_error(rec: Any) -> None:
    plan = build_plan(rec.run_of([], rc=0))
    assert plan_exit(plan) == 1 and plan["hosts"] == {}


def test_fingerprints_are_stable_and_sensitive(rec: Any) -> None:
    base = build_plan(rec.run_of(rec.events("plan_events")))
    reordered = rec.events("plan_events")
    reordered.reverse()
    again = build_plan(rec.run_of(reordered))
    assert (again["inventory_fingerprint"], again["fleet_fingerprint"]) == (
        base["inventory_fingerprint"],
        base["fleet_fingerprint"],
    )
    assert (
        base["inventory_fingerprint"].startswith("sha256:")
        and base["inventory_fingerprint"] != base["fleet_fingerprint"]
    )

    # The desired settings change: the inventory fingerprint does, the fleet's does not.
    edited = rec.events("plan_events")
    for e in edited:
        if e["event_data"]["task_action"] == "sglang_ops.fleet.server_validate" and e["event_data"]["host"] == "gpu-b":
            e["event_data"]["res"]["instances"][0]["fingerprint"] = "fp-b0-new"
    changed = build_plan(rec.run_of(edited))
    assert changed["inventory_fingerprint"] != base["inventory_fingerprint"]
    assert changed["fleet_fingerprint"] == base["fleet_fingerprint"]

    # Something restarted on a host (a new main PID, a new invocation): the fleet fingerprint changes.
    for field, value in (("old_main_pid", 9999), ("old_invocation_id", "inv-new"), ("state", "stopped")):
        restarted = rec.events("plan_events")
        rec.retune_instance(restarted, "gpu-b", "gpu0")[field] = value
        moved = build_plan(rec.run_of(restarted))
        assert moved["fleet_fingerprint"] != base["fleet_fingerprint"], field
        assert moved["inventory_fingerprint"] == base["inventory_fingerprint"]
    # Edited by hand on the host (its command line).
    edited_argv = rec.events("plan_events")
    rec.retune_instance(edited_argv, "gpu-b", "gpu0")["running_argv"].append("--log-level=debug")
    assert build_plan(rec.run_of(edited_argv))["fleet_fingerprint"] != base["fleet_fingerprint"]


def test_drift_names_each_instance_and_exits_2(rec: Any, project: Path) -> None:
    evts = rec.events("plan_events")
    rec.retune_instance(evts, "gpu-b", "gpu0").update(
        action="would_start", reasons=["not running (unit failed/failed)"], state="stopped", old_main_pid=None
    )
    code, out, err, runner = run_cli(rec, project, ["drift"], rec.run_of(evts))
    assert code == 2, err
    assert runner.requests[0].check and runner.requests[0].playbook == "sglang_ops.fleet.retune"
    run_dir = Path(out.splitlines()[-1].removeprefix("artifacts: "))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["drift"] == [
        {
            "host": "gpu-a",
            "instance": "gpu1",
            "drift": "runs other settings",
            "why": "command line differs: mem_fraction_static 0.88→0.93",
        },
        {"host": "gpu-b", "instance": "gpu0", "drift": "is down", "why": "not running (unit failed/failed)"},
    ]
    md = (run_dir / "summary.md").read_text()
    assert "- gpu-a/gpu1 runs other settings" in md and "- gpu-b/gpu0 is down" in md
    assert (run_dir / "plan.md").is_file()


def test_no_drift_exits_0(rec: Any, project: Path) -> None:
    code, out, _, _ = run_cli(rec, project, ["drift"], rec.run_of(nothing_to_do(rec)))
    assert code == 0 and "## Drift: none" in out


def test_the_plan_shows_the_predicted_capacity_after_or_why_not(rec: Any) -> None:
    """The retune's check mode predicts the effective max running requests after the relaunch
    (from the running instance's model facts); the plan carries it, or why there is none."""
    evts = rec.events("plan_events")
    inst = rec.retune_instance(evts, "gpu-a", "gpu1")
    inst.update(predicted_effective_max_running_requests=52, prediction_missing=None)
    plan = build_plan(rec.run_of(evts))
    gpu1 = plan["hosts"]["gpu-a"]["instances"][1]
    assert (gpu1["predicted_after"], gpu1["predicted_why"]) == (52, None)
    assert "| gpu-a/gpu1 | relaunch | mem_fraction_static 0.88→0.93 | 16 → 52 |" in plan_markdown(plan)
    inst.update(predicted_effective_max_running_requests=None, prediction_missing="journal")
    plan = build_plan(rec.run_of(evts))
    assert plan["hosts"]["gpu-a"]["instances"][1]["predicted_why"] == "journal"
    assert "| gpu-a/gpu1 | relaunch | mem_fraction_static 0.88→0.93 | 16 → - (journal) |" in plan_markdown(plan)
