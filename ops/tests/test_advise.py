"""advise from recorded-shape events of playbooks/advise.yml: the text and JSON it prints, what it
asks the playbook for, what it keeps in the run dir, and its exit status."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import yaml
from sglang_fleet_ops import advise, cli

REPO = Path(__file__).resolve().parents[2]
PLAY = "Advise on the tuning of the SGLang instances (read-only)"
TEXT = (
    "sglang-fleet advice (sampled /metrics, window 300 s, every 5 s); nothing was changed\n\n"
    "b200-node/gpu0,gpu1 (2 instances, SGLang 0.5.23): MAMBA-BOUND\n"
    "  why: sglang:num_running_reqs = 16 = effective max 16 for 98% of the window\n"
)
PATCH = "---\nhost_vars:\n  b200-node:\n    sglang_server_host_args:\n      max_mamba_cache_size: 200  # was 80\n"


def event(kind: str, host: str, task: str, action: str, res: dict[str, Any], **data: Any) -> dict[str, Any]:
    return {
        "event": kind,
        "event_data": {"host": host, "task": task, "play": PLAY, "task_action": action, "res": res, **data},
    }


def advise_events(report: bool = True) -> list[dict[str, Any]]:
    evts = [
        event(
            "runner_on_ok",
            "b200-node",
            "Resolve the instances of the host (on the controller)",
            "sglang_ops.fleet.server_validate",
            {"instances": []},
        ),
        event(
            "runner_on_failed",
            "pve-rtx",
            "Resolve the instances of the host (on the controller)",
            "sglang_ops.fleet.server_validate",
            {"failed": True, "msg": "SGLang settings of host pve-rtx: 1 problem"},
        ),
        event("runner_on_ok", "b200-node", advise.OBSERVE_TASK, advise.ADVISE, {"instances": [{"name": "gpu0"}]}),
    ]
    if report:
        evts.append(
            event(
                "runner_on_ok",
                "b200-node",
                advise.REPORT_TASK,
                advise.REPORT,
                {
                    "report": {
                        "format": 1,
                        "diagnoses": {"mamba-bound": 2},
                        "groups": [],
                        "host_problems": {"pve-rtx": "no result: the host failed or was unreachable"},
                    },
                    "text": TEXT,
                    "patch_path": "/repo/playbooks/advice/sglang-fleet-advice.yml",
                    "patch_yaml": PATCH,
                    "advice_produced": True,
                },
                delegated_host="localhost",
            )
        )
    return evts


def run_cli(rec: Any, project: Path, argv: list[str], evts: list[dict[str, Any]]) -> tuple[int, str, str, Any]:
    runner = rec.FakeRunner([rec.run_of(evts, ident="advise")])
    out, err = io.StringIO(), io.StringIO()
    code = cli.main([*argv, "--project-dir", str(project)], runner=runner, out=out, err=err)
    return code, out.getvalue(), err.getvalue(), runner


def test_advise_prints_the_report_and_keeps_it(rec: Any, project: Path, tmp_path: Path) -> None:
    out_file = tmp_path / "patch.yml"
    code, out, err, runner = run_cli(
        rec,
        project,
        ["advise", "-i", "inv", "--window", "120", "--prometheus", "http://prom:9090", "--out", str(out_file)],
        advise_events(),
    )
    assert code == 0
    (request,) = runner.requests
    assert request.playbook == "sglang_ops.fleet.advise" and not request.check and request.progress
    assert request.extravars == {
        "sglang_advise_window": 120.0,
        "sglang_advise_prometheus_url": "http://prom:9090",
        "sglang_advise_output": str(out_file.resolve()),
    }
    assert runner.calls[0]["inventory"] == "inv"
    *body, last = out.splitlines()
    assert "\n".join(body) + "\n" == TEXT
    assert last.startswith("artifacts: ")
    run_dir = Path(last.split(": ", 1)[1])
    assert json.loads((run_dir / "advice.json").read_text())["diagnoses"] == {"mamba-bound": 2}
    assert (run_dir / "sglang-fleet-advice.yml").read_text() == PATCH
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["command"] == "advise" and summary["exit"] == 0
    assert summary["patch"] == "/repo/playbooks/advice/sglang-fleet-advice.yml"
    # A host that could not be advised is a problem, on stderr; the advice still counts.
    assert summary["problems"] == ["pve-rtx: invalid settings: SGLang settings of host pve-rtx: 1 problem"]
    assert err == "error: pve-rtx: invalid settings: SGLang settings of host pve-rtx: 1 problem\n"


def test_advise_json(rec: Any, project: Path) -> None:
    code, out, err, runner = run_cli(rec, project, ["advise", "--json"], advise_events())
    # The patch goes into the run dir (never beside the installed collection's playbook).
    (run_dir,) = (project / ".sglang-fleet-ops" / "runs").iterdir()
    assert code == 0 and runner.requests[0].extravars == {
        "sglang_advise_output": str(run_dir / "sglang-fleet-advice.yml")
    }
    # stdout is the JSON alone; the artifacts line is on stderr.
    assert json.loads(out)["diagnoses"] == {"mamba-bound": 2}
    assert err.splitlines()[-1] == f"artifacts: {run_dir}"


def test_advise_without_a_report_is_an_error(rec: Any, project: Path) -> None:
    code, out, err, _ = run_cli(rec, project, ["advise"], advise_events(report=False))
    assert code == 1
    assert out.splitlines()[-1].startswith("artifacts: ")
    assert (
        "error: no advice: the task 'Write the fleet report and the inventory patch (on the controller)' gave no "
        "report (rc=2)"
    ) in err


def test_the_report_task_the_cli_reads_exists() -> None:
    (play,) = yaml.safe_load((REPO / "playbooks" / "advise.yml").read_text())
    assert play["name"] == PLAY
    names = {t["name"]: t for t in play["tasks"]}
    assert advise.REPORT in names[advise.REPORT_TASK] and advise.ADVISE in names[advise.OBSERVE_TASK]
    for var in (
        "sglang_advise_window",
        "sglang_advise_interval",
        "sglang_advise_prometheus_url",
        "sglang_advise_output",
    ):
        assert var in play["vars"], var
