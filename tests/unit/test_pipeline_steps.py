"""tools/pipeline_steps.py, the step runner the gitops scenario runs the example pipelines with:
its expressions, the steps it takes from a workflow (the setup action's in place), the
substitution of `${{ ... }}`, the job's files (GITHUB_ENV, GITHUB_PATH, GITHUB_OUTPUT), the
GitLab job as one shell session with `extends` and `rules`; tiny pipelines, no hosts."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CI = REPO / "examples" / "ci"


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pipeline_steps", REPO / "tools" / "pipeline_steps.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["pipeline_steps"] = module
    spec.loader.exec_module(module)
    return module


steps = load_tool()


def lookup(values: dict[str, Any]) -> Any:
    return lambda name: steps.path_lookup(values, name)


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("github.event_name == 'pull_request'", False),
        ("github.event_name != 'pull_request'", True),
        ("github.ref == 'refs/heads/main' && (github.event_name == 'push' || github.event_name == 'x')", True),
        ("github.ref == 'refs/heads/dev' && github.event_name == 'push'", False),
        ("!(github.event_name == 'push')", False),
        ("steps.fetch.outputs.fetched != 'true'", True),
        ("'it''s'", "it's"),
        ('$CI_PIPELINE_SOURCE == "merge_request_event"', False),
    ],
)
def test_expressions(expr: str, expected: Any) -> None:
    values = {"github": {"event_name": "push", "ref": "refs/heads/main"}, "$CI_PIPELINE_SOURCE": "push"}
    assert steps.evaluate(expr, lookup(values)) == expected


def test_an_expression_it_cannot_read_is_an_error() -> None:
    with pytest.raises(steps.PipelineError):
        steps.evaluate("github.x == 'a' &&", lookup({}))
    with pytest.raises(steps.PipelineError):
        steps.evaluate("contains(github.x, 'a')", lookup({}))


def test_substitution() -> None:
    values = {"env": {"OUT_DIR": "out"}, "github": {"event": {"pull_request": {"number": 7}}}}
    text = "path: ${{ env.OUT_DIR }}/plan.json group-${{ github.event.pull_request.number }} ${{ env.NONE }}."
    assert steps.substitute(text, lookup(values)) == "path: out/plan.json group-7 ."


def test_the_workflows_steps_with_the_setup_action_in_place(tmp_path: Path) -> None:
    """The plan job of the real workflow, from a fleet repository laid out as the workflow says."""
    repo = tmp_path / "fleet"
    (repo / ".github" / "actions" / "sglang-fleet-setup").mkdir(parents=True)
    shutil.copy(
        CI / "github" / "actions" / "sglang-fleet-setup" / "action.yml", repo / ".github/actions/sglang-fleet-setup"
    )
    workflow = yaml.safe_load((CI / "github" / "sglang-fleet.yml").read_text())
    found = steps.github_steps(workflow, "plan", repo)
    names = [s.get("name") or s.get("uses", "").split("@")[0] for s in found]
    assert names == [
        "actions/checkout",
        "actions/setup-python",
        "Install the collection and sglang-fleet-ops at the pinned ref",
        "Secrets into files (0600)",
        "Lint the inventory and playbooks",
        "Plan",
        "Keep the plan",
    ]
    install = found[2]
    assert install["_inputs"]["lint"] == "true" and install["_inputs"]["ref"] == "${{ env.SGLANG_FLEET_REF }}"


def test_a_job_not_on_its_event_does_not_run(tmp_path: Path) -> None:
    context = {"event": "push", "temp": str(tmp_path / "t")}
    code, job = steps.github_job(CI / "github" / "sglang-fleet.yml", "plan", tmp_path, context)
    assert code == steps.NOT_RUN and job.steps == []
    context = {"event": "merge_request_event", "temp": str(tmp_path / "t")}
    code, _unused = steps.gitlab_job(CI / "gitlab" / ".gitlab-ci.yml", "drift", tmp_path, context)
    assert code == steps.NOT_RUN


def test_the_trial_schedule_runs_propose_and_the_other_runs_drift(tmp_path: Path) -> None:
    workflow = CI / "github" / "sglang-fleet.yml"
    crons = [c["cron"] for c in yaml.safe_load(workflow.read_text())["on"]["schedule"]]
    drift_cron, trial_cron = crons
    for cron, job in ((trial_cron, "drift"), (drift_cron, "propose")):
        context = {"event": "schedule", "schedule": cron, "temp": str(tmp_path / "t")}
        assert steps.github_job(workflow, job, tmp_path, context)[0] == steps.NOT_RUN, (cron, job)
    gitlab = CI / "gitlab" / ".gitlab-ci.yml"
    for env, job in (({"SGLANG_FLEET_SCHEDULE": "propose"}, "drift"), ({}, "propose")):
        context = {"event": "schedule", "env": env, "temp": str(tmp_path / "t")}
        assert steps.gitlab_job(gitlab, job, tmp_path, context)[0] == steps.NOT_RUN, (env, job)
    # Without the trial's cron or variable (the gitops scenario's scheduled jobs), drift still runs.
    drift_if = yaml.safe_load(workflow.read_text())["jobs"]["drift"]["if"]
    github = {"github": {"event_name": "schedule", "event": {"schedule": ""}}}
    assert steps.evaluate(drift_if, lambda name: steps.path_lookup(github, name)) is True
    drift_rules = yaml.safe_load(gitlab.read_text())["drift"]["rules"]
    assert steps.gitlab_rules_run(drift_rules, {"CI_PIPELINE_SOURCE": "schedule"}) is True


TINY_WORKFLOW = """
on: push
env:
  GREETING: hello
jobs:
  one:
    if: github.event_name == 'push'
    runs-on: ubuntu-24.04
    steps:
      - uses: actions/checkout@0123456789012345678901234567890123456789 # v5.0.0
        with:
          persist-credentials: false
      - name: Write env, path and an output
        id: first
        shell: bash
        env:
          TOKEN: ${{ secrets.TOKEN }}
        run: |
          echo "said=${{ env.GREETING }} from $GITHUB_REPOSITORY, token $TOKEN"
          mkdir -p "$RUNNER_TEMP/bin" && printf '#!/bin/sh\\necho tool ran\\n' > "$RUNNER_TEMP/bin/tool"
          chmod +x "$RUNNER_TEMP/bin/tool"
          echo "$RUNNER_TEMP/bin" >> "$GITHUB_PATH"
          echo "LATER=set-by-env-file" >> "$GITHUB_ENV"
          echo "fetched=true" >> "$GITHUB_OUTPUT"
      - name: Skipped on the output
        if: steps.first.outputs.fetched != 'true'
        shell: bash
        run: exit 9
      - name: Use them, then fail
        shell: bash
        run: |
          tool; echo "later=$LATER"
          false
          echo never
      - name: Not after a failure
        shell: bash
        run: echo not-run
      - name: Always
        if: always()
        uses: actions/upload-artifact@0123456789012345678901234567890123456789 # v5.0.0
        with:
          name: kept
          path: |
            out.txt
"""


def test_a_github_job_runs_its_steps_in_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "wf.yml").write_text(TINY_WORKFLOW)
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "TOKEN").write_text("sekrit-value")
    work = tmp_path / "work"
    work.mkdir()
    (work / "out.txt").write_text("kept")
    context = {
        "event": "push",
        "repository": "o/fleet",
        "secrets_dir": str(tmp_path / "secrets"),
        "temp": str(tmp_path / "t"),
    }
    code, job = steps.github_job(tmp_path / "wf.yml", "one", work, context)
    out = capsys.readouterr().out
    assert code == steps.FAILED and job.status == "failure"
    assert list(job.steps) == [
        ("actions/checkout", 0),
        ("Write env, path and an output", 0),
        ("Skipped on the output", None),
        ("Use them, then fail", 1),
        ("Not after a failure", None),
        ("Always", 0),
    ]
    assert "said=hello from o/fleet, token ***" in out and "sekrit-value" not in out
    assert "tool ran" in out and "later=set-by-env-file" in out and "never" not in out
    assert job.outputs["first"] == {"fetched": "true"}
    # Each step that ran says how long it took; a skipped one does not.
    for name in ("actions/checkout", "Write env, path and an output", "Use them, then fail", "Always"):
        assert re.search(rf"^::: step {re.escape(name)}: \d+\.\ds$", out, re.M), name
    assert "::: step Skipped on the output" not in out
    assert (tmp_path / "t" / "artifacts" / "kept" / "out.txt").read_text() == "kept"


def test_a_checkout_that_keeps_its_credentials_fails(tmp_path: Path) -> None:
    (tmp_path / "wf.yml").write_text(TINY_WORKFLOW.replace("persist-credentials: false", "fetch-depth: 1"))
    code, job = steps.github_job(tmp_path / "wf.yml", "one", tmp_path, {"event": "push", "temp": str(tmp_path / "t")})
    assert code == steps.FAILED and job.steps[0] == ("actions/checkout", 1)


TINY_GITLAB = """
workflow:
  rules:
    - if: $CI_PIPELINE_SOURCE == "merge_request_event"
variables:
  OUT_DIR: out
.base:
  variables:
    WHO: base
  before_script:
    - |
      set -euo pipefail
      greet() { echo "hello $1 from $WHO"; }
      mkdir -p "$OUT_DIR"
  artifacts:
    paths:
      - $OUT_DIR/kept.txt
job:
  extends: .base
  rules:
    - if: $CI_PIPELINE_SOURCE == "merge_request_event"
  variables:
    WHO: job
  script:
    - greet "mr $CI_MERGE_REQUEST_IID"
    - echo "key file $(cat "$KEY_FILE"), password $PASSWORD"
    - echo kept > "$OUT_DIR/kept.txt"
"""


def test_a_gitlab_job_is_one_session_with_extends_and_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ci.yml").write_text(TINY_GITLAB)
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "KEY_FILE").write_text("key-content")
    (secrets / "PASSWORD").write_text("pass-value")
    work = tmp_path / "work"
    work.mkdir()
    context = {
        "event": "merge_request_event",
        "pull_request": 4,
        "secrets_dir": str(secrets),
        "file_variables": ["KEY_FILE"],
        "temp": str(tmp_path / "t"),
    }
    code, _unused = steps.gitlab_job(tmp_path / "ci.yml", "job", work, context)
    out = capsys.readouterr().out
    assert code == steps.RAN, out
    assert "hello mr 4 from job" in out
    assert re.search(r"^::: job job: \d+\.\ds$", out, re.M)
    # A File variable is its file's path (its content read through it); a masked one its value.
    assert "key file ***, password ***" in out
    assert (tmp_path / "t" / "artifacts" / "job" / "kept.txt").read_text() == "kept\n"
    context["event"] = "push"
    assert steps.gitlab_job(tmp_path / "ci.yml", "job", work, context)[0] == steps.NOT_RUN


def test_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ci.yml").write_text(TINY_GITLAB.replace('$(cat "$KEY_FILE"), password $PASSWORD', "none"))
    (tmp_path / "context.json").write_text(json.dumps({"event": "merge_request_event", "temp": str(tmp_path / "t")}))
    (tmp_path / "work").mkdir()
    argv = ["gitlab", str(tmp_path / "ci.yml"), "job", "--workspace", str(tmp_path / "work")]
    assert steps.main([*argv, "--context", str(tmp_path / "context.json")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "::: job job: success"
    assert steps.main([*argv[:2], "nope", *argv[3:], "--context", str(tmp_path / "context.json")]) == steps.UNUSABLE
