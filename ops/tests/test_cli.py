"""The CLI's conventions: exit statuses in each command's --help, --json whose stdout is only
JSON, progress on stderr (hosts done of the total), and no traceback when stdout's reader goes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from sglang_fleet_ops import cli
from sglang_fleet_ops.runner import Progress

FIXTURES = Path(__file__).parent / "fixtures"


def run_cli(rec: Any, project: Path, argv: list[str], run: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main([*argv, "--project-dir", str(project)], runner=rec.FakeRunner([run]), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("command", sorted(cli.EXITS))
def test_each_commands_help_lists_its_exit_statuses(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = capsys.readouterr().out
    assert "exit statuses:" in text
    for code, what in cli.EXITS[command].items():
        assert f"\n  {code}  {what}\n" in text, text
    assert set(cli.EXITS["apply"]) == {0, 1, 3, 4} and set(cli.EXITS["plan"]) == {0, 1, 2}


@pytest.mark.parametrize(
    ("argv", "fixture", "key"),
    [(["plan", "--json"], "plan_events", "hosts"), (["drift", "--json"], "plan_events", "drift")],
    ids=["plan", "drift"],
)
def test_json_is_all_of_stdout(
    rec: Any, project: Path, tmp_path: Path, argv: list[str], fixture: str, key: str
) -> None:
    out_dir = ["--out", str(tmp_path / "out")] if argv[0] == "plan" else []
    code, out, err = run_cli(rec, project, [*argv, *out_dir], rec.run_of(rec.events(fixture)))
    assert code == 2, err
    data = json.loads(out)
    assert key in data
    # The text a person reads and the artifacts line went to stderr.
    assert err.splitlines()[-1].startswith("artifacts: ")
    if argv[0] == "plan":
        assert data["changes"] >= 1 and data["format"] == 1
    else:
        assert data["drift"] and data["plan"]["hosts"]


def test_progress_counts_hosts_done(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress("sglang_ops.fleet.retune")

    def event(kind: str, host: str, action: str, task: str = "t", **data: Any) -> dict[str, Any]:
        return {"event": kind, "event_data": {"host": host, "task": task, "resolved_action": action, **data}}

    for e in (
        event("runner_on_ok", "a", "sglang_ops.fleet.server_validate"),
        event("runner_on_ok", "b", "sglang_ops.fleet.server_validate"),
        event("runner_on_ok", "c", "sglang_ops.fleet.server_validate"),
        event("runner_on_ok", "a", "sglang_ops.fleet.retune"),
        event("runner_on_failed", "b", "ansible.builtin.fail", task="ignored", ignore_errors=True),
        event("runner_on_failed", "b", "sglang_ops.fleet.retune", task="Relaunch"),
        event("runner_on_unreachable", "c", "sglang_ops.fleet.host_lock", task="Lock"),
    ):
        assert progress(e) is True
    assert capsys.readouterr().err.splitlines() == [
        "[a] done (1/3 hosts)",
        "[b] FAILED: Relaunch",
        "[b] done (2/3 hosts)",
        "[c] UNREACHABLE: Lock",
        "[c] done (3/3 hosts)",
    ]


def test_a_closed_pipe_ends_without_a_traceback(tmp_path: Path) -> None:
    """`status --json | head -1`: the reader goes after one line; the command still writes its
    summary and exits with its own status, with nothing on stderr but its own lines."""
    script = textwrap.dedent(
        f"""
        import json, sys
        from pathlib import Path
        from sglang_fleet_ops import cli
        from sglang_fleet_ops.runner import Run

        events = json.loads(Path({str(FIXTURES / "status_events.json")!r}).read_text())

        def runner(run_dir, project, inventory, limit, request):
            return Run(ident=request.ident, playbook=request.playbook, rc=0, status="successful", events=events)

        sys.exit(cli.main(["status", "--json", "--project-dir", {str(tmp_path)!r}], runner=runner,
                          check_collection=lambda project: None))
        """
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, bufsize=0
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes before the command writes anything
    err = proc.stderr.read().decode()
    code = proc.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert code == 2  # gpu1 of the recorded fleet runs other settings: status's own exit
    (run_dir,) = (tmp_path / ".sglang-fleet-ops" / "runs").iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["exit"] == 2
