"""The example pipelines (examples/ci/): valid for their CI (the vendored schemas of
check-jsonschema, offline), running exactly the sglang-fleet-ops commands of its interface, each
on its trigger, with secrets kept out of commands, logs and artifacts."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CI = REPO / "examples" / "ci"
GITHUB = CI / "github" / "sglang-fleet.yml"
GITHUB_ACTION = CI / "github" / "actions" / "sglang-fleet-setup" / "action.yml"
GITLAB = CI / "gitlab" / ".gitlab-ci.yml"

# The interface of sglang-fleet-ops: each command and the options it takes (True: with a value).
INTERFACE: dict[str, dict[str, bool]] = {
    "plan": {"-i": True, "--limit": True, "--out": True},
    "apply": {"-i": True, "--limit": True, "--plan": True, "--lock-wait": True},
    "drift": {"-i": True, "--limit": True},
    "status": {"-i": True, "--json": False},
    "advise": {"-i": True, "--trial": False, "--propose": False},
    "propose": {"--platform": True, "--proposal": True, "--base": True},
}
ARTIFACTS = {"plan.json", "plan.md", "summary.json", "summary.md", "trial.json", "proposal.json"}
SECRET_VARS = (
    "SSH_PRIVATE_KEY",
    "SSH_KNOWN_HOSTS",
    "VAULT_PASSWORD",
    "S3_ACCESS_KEY_ID",
    "S3_SECRET_ACCESS_KEY",
    "GITLAB_TOKEN",
    "GITLAB_PROPOSE_TOKEN",
)


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def github_on(workflow: dict[str, Any]) -> dict[str, Any]:
    # PyYAML reads the key `on` as the boolean True (YAML 1.1).
    return workflow.get("on", workflow.get(True))


def github_scripts() -> dict[str, list[str]]:
    """Every `run:` of the workflow, by job; the setup action's under `setup-action`."""
    workflow = load(GITHUB)
    out = {name: [s["run"] for s in job["steps"] if "run" in s] for name, job in workflow["jobs"].items()}
    out["setup-action"] = [s["run"] for s in load(GITHUB_ACTION)["runs"]["steps"] if "run" in s]
    return out


def gitlab_jobs() -> dict[str, dict[str, Any]]:
    reserved = {"workflow", "stages", "variables", "default", "include"}
    return {k: v for k, v in load(GITLAB).items() if k not in reserved and isinstance(v, dict)}


def gitlab_scripts() -> dict[str, list[str]]:
    return {name: [*job.get("before_script", []), *job.get("script", [])] for name, job in gitlab_jobs().items()}


def logical_lines(script: str) -> list[str]:
    """Shell lines with backslash continuations joined."""
    return [line.strip() for line in script.replace("\\\n", " ").splitlines() if line.strip()]


def invocations(scripts: dict[str, list[str]]) -> list[tuple[str, str, dict[str, str | None]]]:
    """(job, command, options) of every sglang-fleet-ops invocation; an unknown command or
    option fails here."""
    found = []
    for job, items in scripts.items():
        for item in items:
            for line in logical_lines(item):
                if line.startswith("#") or "sglang-fleet-ops " not in line:
                    continue
                words = shlex.split(line.split("sglang-fleet-ops ", 1)[1].split("|", 1)[0].split("2>&1", 1)[0])
                command, rest = words[0], words[1:]
                if command == "--version":  # the install's check that it runs
                    continue
                if command not in INTERFACE:  # a mention in prose (an echo): not an invocation
                    assert line.startswith("echo"), line
                    continue
                options: dict[str, str | None] = {}
                while rest:
                    opt = rest.pop(0)
                    assert opt in INTERFACE[command], f"{job}: {command} has no option {opt}: {line}"
                    options[opt] = rest.pop(0) if INTERFACE[command][opt] else None
                assert "|| true" not in line and "||true" not in line, f"{job}: exit status swallowed: {line}"
                found.append((job, command, options))
    return found


@pytest.mark.parametrize(
    ("schema", "path"),
    [
        ("vendor.github-workflows", GITHUB),
        ("vendor.github-actions", GITHUB_ACTION),
        ("vendor.gitlab-ci", GITLAB),
    ],
    ids=["github-workflow", "github-action", "gitlab-ci"],
)
def test_pipeline_is_valid_for_its_ci(schema: str, path: Path, tmp_path: Path) -> None:
    pytest.importorskip("check_jsonschema", reason="check-jsonschema is not installed (make setup installs it)")
    tool = str(Path(sys.executable).parent / "check-jsonschema")
    good = subprocess.run([tool, "--builtin-schema", schema, str(path)], capture_output=True, text=True, check=False)
    assert good.returncode == 0, good.stdout + good.stderr
    # The same check refuses a broken copy: the schema is really applied.
    broken = tmp_path / path.name
    data = load(path)
    if schema == "vendor.github-workflows":
        del data["jobs"]["apply"]["runs-on"]
    elif schema == "vendor.github-actions":
        data["runs"]["using"] = "no-such-runtime"
    else:
        data["apply"]["when"] = "sometimes"
    broken.write_text(yaml.safe_dump(data), encoding="utf-8")
    bad = subprocess.run([tool, "--builtin-schema", schema, str(broken)], capture_output=True, text=True, check=False)
    assert bad.returncode != 0, bad.stdout


@pytest.mark.parametrize("scripts", [github_scripts, gitlab_scripts], ids=["github", "gitlab"])
def test_pipelines_run_exactly_the_cli_commands(scripts: Any) -> None:
    found = invocations(scripts())
    by_job = {(job, command) for job, command, _unused in found}
    assert by_job == {
        ("plan", "plan"),
        ("apply", "plan"),
        ("apply", "apply"),
        ("drift", "drift"),
        ("propose", "advise"),
        ("propose", "propose"),
    }
    applies = [opts for job, command, opts in found if command == "apply"]
    assert applies and all(o.get("--plan", "").endswith("plan.json") for o in applies), applies
    for _job, command, opts in found:
        assert opts.get("-i") == "$INVENTORY" or command == "propose"
    trials = [opts for job, command, opts in found if command == "advise"]
    assert trials and all("--trial" in o and "--propose" in o for o in trials), trials
    proposes = [opts for job, command, opts in found if command == "propose"]
    assert proposes and all(o["--proposal"] == "$OUT_DIR/proposal.json" for o in proposes), proposes


def test_github_triggers_protection_and_summaries() -> None:
    workflow = load(GITHUB)
    on = github_on(workflow)
    assert {"pull_request", "push", "schedule"} <= set(on)
    jobs = workflow["jobs"]
    assert "pull_request" in jobs["plan"]["if"]
    assert "push" in jobs["apply"]["if"] and "refs/heads/main" in jobs["apply"]["if"]
    assert "schedule" in jobs["drift"]["if"]
    # Two crons: the drift's, and the advise trial's that the propose job (only) runs on.
    trial_cron = on["schedule"][1]["cron"]
    assert jobs["propose"]["if"] == f"github.event_name == 'schedule' && github.event.schedule == '{trial_cron}'"
    assert f"github.event.schedule != '{trial_cron}'" in jobs["drift"]["if"]
    assert jobs["propose"]["permissions"] == {"contents": "write", "pull-requests": "write", "actions": "write"}
    assert jobs["propose"]["environment"] == "production"
    assert jobs["propose"]["concurrency"] == jobs["apply"]["concurrency"]
    # The token reaches propose as its step's environment only.
    steps = {s.get("name"): s for s in jobs["propose"]["steps"]}
    assert steps["Open the pull request"]["env"] == {"GITHUB_TOKEN": "${{ github.token }}"}
    assert not any("GITHUB_TOKEN" in r or "github.token" in r for r in github_scripts()["propose"])
    # A pull request opened with GITHUB_TOKEN starts no workflow: the plan runs on the branch by dispatch.
    assert "workflow_dispatch" in jobs["plan"]["if"] and "refs/heads/main" in jobs["plan"]["if"]
    assert jobs["apply"]["environment"] == "production"
    assert jobs["apply"]["concurrency"]["cancel-in-progress"] is False
    runs = github_scripts()
    assert any("ansible-lint" in r for r in runs["plan"])
    for job in ("plan", "drift"):
        assert any("$GITHUB_STEP_SUMMARY" in r for r in runs[job] if "sglang-fleet-ops" in r), job
    # Every job installs through the setup action, at the ref pinned once in the workflow.
    for name, job in jobs.items():
        uses = [s for s in job["steps"] if s.get("uses") == "./.github/actions/sglang-fleet-setup"]
        assert len(uses) == 1, name
        assert uses[0]["with"]["ref"] == "${{ env.SGLANG_FLEET_REF }}"


def test_gitlab_triggers_protection_and_note() -> None:
    jobs = gitlab_jobs()
    rules = {name: " ".join(r["if"] for r in job.get("rules", [])) for name, job in jobs.items()}
    assert "merge_request_event" in rules["plan"]
    assert "$CI_DEFAULT_BRANCH" in rules["apply"] and "merge_request_event" not in rules["apply"]
    assert rules["drift"] == '$CI_PIPELINE_SOURCE == "schedule" && $SGLANG_FLEET_SCHEDULE != "propose"'
    assert rules["propose"] == '$CI_PIPELINE_SOURCE == "schedule" && $SGLANG_FLEET_SCHEDULE == "propose"'
    assert jobs["propose"]["resource_group"] == jobs["apply"]["resource_group"]
    # The propose token is read by the CLI from the environment: no script names it.
    assert not any("PROPOSE_TOKEN" in line for line in "\n".join(gitlab_scripts()["propose"]).splitlines())
    assert jobs["apply"]["resource_group"]
    assert jobs["apply"]["environment"]["name"] == "production"
    plan = "\n".join(gitlab_scripts()["plan"])
    assert "ansible-lint" in plan
    assert "merge_requests/$CI_MERGE_REQUEST_IID/notes" in plan
    assert '--header "@$SECRETS_DIR/gitlab_header"' in plan


def github_artifact_paths() -> list[str]:
    paths = []
    for job in load(GITHUB)["jobs"].values():
        for step in job["steps"]:
            if str(step.get("uses", "")).startswith("actions/upload-artifact"):
                paths += [p for p in step["with"]["path"].splitlines() if p.strip()]
    return paths


def gitlab_artifact_paths() -> list[str]:
    return [p for job in gitlab_jobs().values() for p in job.get("artifacts", {}).get("paths", [])]


@pytest.mark.parametrize("paths", [github_artifact_paths, gitlab_artifact_paths], ids=["github", "gitlab"])
def test_artifacts_hold_only_plans_and_summaries(paths: Any) -> None:
    found = paths()
    assert found
    assert {p.rsplit("/", 1)[-1] for p in found} == ARTIFACTS
    assert not any("*" in p or ".sglang-fleet-ops" in p for p in found), found


@pytest.mark.parametrize("scripts", [github_scripts, gitlab_scripts], ids=["github", "gitlab"])
def test_secrets_only_reach_files_of_mode_0600(scripts: Any) -> None:
    text = "\n".join(item for items in scripts().values() for item in items)
    assert "set -x" not in text and "${{ secrets." not in text
    secret = re.compile(r"\$\{?\w*(" + "|".join(SECRET_VARS) + r")\b")
    lines = [line for line in logical_lines(text) if secret.search(line)]
    assert lines
    for line in lines:
        written = re.match(r'^(printf \'[^\']*\' "\$\w+"|cat "\$\w+") > "\$(dir|SECRETS_DIR)/\w+"$', line)
        tested = re.match(r'^if \[ -n "\$\{\w+:-\}" \]; then$', line)
        assert written or tested, line
    # The files are written under umask 077, in a directory of its own outside the workspace.
    assert "umask 077" in text


def test_both_pipelines_and_the_execution_environment_pin_one_ref() -> None:
    refs = {
        load(GITHUB)["env"]["SGLANG_FLEET_REF"],
        load(GITLAB)["variables"]["SGLANG_FLEET_REF"],
    }
    ee = load(REPO / "execution-environment.yml")
    refs.add(ee["dependencies"]["galaxy"]["collections"][0]["version"])
    assert len(refs) == 1, refs


# ---------------------------------------------------------------------------------------------
# Pipelines a maintainer copies as they are


USES = re.compile(r"^\s*-?\s*uses:\s*(?P<action>[\w.-]+/[\w.-]+)@(?P<ref>\S+)(?:\s+#\s*(?P<tag>\S+))?\s*$")
# The first major of each action that runs on Node 24 (Node 20 is retired on GitHub's runners).
NODE24 = {"actions/checkout": 5, "actions/upload-artifact": 5, "actions/setup-python": 6}


def uses_lines() -> list[re.Match[str]]:
    lines = [line for path in (GITHUB, GITHUB_ACTION) for line in path.read_text().splitlines() if "uses:" in line]
    remote = [line for line in lines if "uses: ./" not in line]
    matches = [USES.match(line) for line in remote]
    assert all(matches), remote
    return [m for m in matches if m]


def test_actions_are_pinned_by_commit_with_their_tag_on_node24() -> None:
    found = uses_lines()
    assert {m["action"] for m in found} == set(NODE24)
    for m in found:
        assert re.fullmatch(r"[0-9a-f]{40}", m["ref"]), m.group(0)
        assert m["tag"] and re.fullmatch(r"v\d+\.\d+\.\d+", m["tag"]), m.group(0)
        assert int(m["tag"][1:].split(".")[0]) >= NODE24[m["action"]], m.group(0)


def test_every_job_has_a_time_limit_and_no_checkout_keeps_credentials() -> None:
    jobs = load(GITHUB)["jobs"]
    for name, job in jobs.items():
        assert isinstance(job.get("timeout-minutes"), int), name
        checkouts = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/checkout@")]
        assert len(checkouts) == 1 and checkouts[0]["with"]["persist-credentials"] is False, name
    for name, job in gitlab_jobs().items():
        extends = gitlab_jobs().get(job.get("extends", ""), {})
        assert job.get("timeout") or extends.get("timeout"), name


def test_gitlab_plan_is_interruptible_and_the_image_pinned_by_digest() -> None:
    jobs = gitlab_jobs()
    assert jobs["plan"]["interruptible"] is True
    assert jobs["apply"]["interruptible"] is False
    assert re.fullmatch(r"python:[\w.-]+@sha256:[0-9a-f]{64}", jobs[".sglang-fleet"]["image"])


def test_zizmor_offline_passes_and_refuses_an_unpinned_action(tmp_path: Path) -> None:
    """make lint's audit (tools/lint_pipelines.sh) on the pipelines, then on a copy whose checkout
    is unpinned and keeps its credentials: the audit really applies."""
    zizmor = Path(sys.executable).parent / "zizmor"
    if not zizmor.is_file():
        pytest.skip("zizmor is not installed (make venv installs it)")
    config = CI / "zizmor.yml"
    good = subprocess.run(
        [str(zizmor), "--offline", "--config", str(config), str(GITHUB), str(GITHUB_ACTION)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert good.returncode == 0, good.stdout + good.stderr
    broken = tmp_path / GITHUB.name
    text = GITHUB.read_text()
    text = re.sub(
        r"actions/checkout@[0-9a-f]{40} # \S+\n\s+with:\n\s+persist-credentials: false", "actions/checkout@v4", text
    )
    assert "actions/checkout@v4" in text
    broken.write_text(text)
    bad = subprocess.run(
        [str(zizmor), "--offline", "--config", str(config), str(broken)], capture_output=True, text=True, check=False
    )
    assert bad.returncode != 0
    assert "unpinned-uses" in bad.stdout + bad.stderr and "artipacked" in bad.stdout + bad.stderr
