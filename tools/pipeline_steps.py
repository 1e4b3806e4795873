#!/usr/bin/env python3
"""Run one job of the example pipelines (examples/ci/) on this machine, from the pipeline files
themselves: the `run:` steps of a GitHub Actions job (the composite setup action's steps in
place) or the `before_script:` + `script:` of a GitLab CI job, in a fleet repository.

    pipeline_steps.py github WORKFLOW JOB --workspace DIR --context CONTEXT.json
    pipeline_steps.py gitlab GITLAB_CI JOB --workspace DIR --context CONTEXT.json

It prints the job's log and exits 0 when the job succeeded, 1 when it failed, 3 when the job's
`if:`/`rules:` do not run it on the context's event, 2 on a pipeline it cannot run.

The context (JSON), the runner's part of what a CI service gives a job:

    event          GitHub: event_name (pull_request, push, schedule, workflow_dispatch);
                   GitLab: CI_PIPELINE_SOURCE (merge_request_event, push, schedule, web)
    ref, sha       the commit the job runs on (GitHub github.ref/github.sha; GitLab
                   CI_COMMIT_BRANCH is the ref's last part, CI_COMMIT_SHA the sha)
    repository     owner/name of the fleet repository (github.repository, CI_PROJECT_PATH)
    default_branch GitLab CI_DEFAULT_BRANCH (default: main)
    pull_request   GitHub github.event.pull_request.number, GitLab CI_MERGE_REQUEST_IID (default 1)
    env            overrides of the pipeline's own env/variables (e.g. SGLANG_FLEET_REPO and
                   SGLANG_FLEET_REF naming a local clone and its commit)
    secrets_dir    a directory with one file per secret (name: the secret's name); GitHub: the
                   `secrets` context; GitLab: CI/CD variables, those in file_variables of type File
                   (the variable is the file's path), the others their content
    file_variables GitLab: the names of the File variables
    runner_env     the runner machine's environment besides PATH, HOME, LANG (e.g. the collections
                   path of other collections, a container engine's configuration)
    temp           the runner's temporary directory (RUNNER_TEMP; GitLab: TMPDIR), made if missing
    schedule       GitHub github.event.schedule of a scheduled run (the cron that started it)
    api_url        the platform's API (a local stand-in): GitHub GITHUB_API_URL, GitLab
                   CI_API_V4_URL (<api_url>/api/v4); default http://127.0.0.1:9, where every call fails

The expressions `${{ ... }}` of GitHub are evaluated from these contexts: github (event_name, ref,
sha, repository, token: empty, event.pull_request.number, event.schedule, workspace, api_url), env,
secrets, inputs (of the composite action), steps.<id>.outputs, runner.temp, with ==, !=, &&, ||,
!, parentheses and always(), success(), failure(). Remote actions are stood in for: actions/checkout (the workspace
is the fleet repository's checkout already), actions/setup-python (a `python` on PATH: this
machine's python3), actions/upload-artifact (the paths copied into <temp>/artifacts/<name>). A
GitLab job's `extends` and `rules: - if:` (==, !=, &&, || on $VARIABLES and strings) are read;
its `artifacts: paths` are copied into <temp>/artifacts/<job>. Secrets' values are masked in the log.
What belongs to the service (concurrency, environments and their approvals, permissions, time
limits, resource groups) is not enforced here; the pipelines' unit tests check those settings.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

RAN, FAILED, NOT_RUN, UNUSABLE = 0, 1, 3, 2
BASE_PATH = "/usr/local/bin:/usr/bin:/bin"
GITHUB_SHELL = ["bash", "--noprofile", "--norc", "-eo", "pipefail"]
GITLAB_SHELL = ["bash", "--noprofile", "--norc"]
# The platform's API when the context names none: no forge here, every API call fails.
NO_FORGE = "http://127.0.0.1:9"


class PipelineError(Exception):
    """Something in the pipeline this runner cannot run (named)."""


# ---------------------------------------------------------------------------------------------
# Expressions


TOKEN = re.compile(r"\s*(?:(?P<str>'(?:[^']|'')*'|\"[^\"]*\")|(?P<op>==|!=|&&|\|\||!|\(|\))|(?P<word>[\w.$-]+))")


def tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise PipelineError(f"cannot read the expression {text!r} at {text[pos:]!r}")
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def evaluate(text: str, lookup: Callable[[str], Any]) -> Any:
    """An expression of ==, !=, &&, ||, !, parentheses, strings, names (``lookup``) and calls
    (``lookup('always()')``), GitHub's and GitLab's alike; && and || give an operand, as in GitHub."""
    toks = tokens(text)
    pos = 0

    def peek() -> str | None:
        return toks[pos][1] if pos < len(toks) else None

    def take() -> tuple[str, str]:
        nonlocal pos
        if pos >= len(toks):
            raise PipelineError(f"the expression {text!r} ends too early")
        pos += 1
        return toks[pos - 1]

    def primary() -> Any:
        kind, value = take()
        if value == "(" and kind == "op":
            inner = either()
            if take()[1] != ")":
                raise PipelineError(f"unbalanced parentheses in {text!r}")
            return inner
        if value == "!" and kind == "op":
            return not primary()
        if kind == "str":
            return value[1:-1].replace("''", "'") if value.startswith("'") else value[1:-1]
        if peek() == "(" and pos + 1 < len(toks) and toks[pos + 1][1] == ")":
            take(), take()
            return lookup(value + "()")
        return lookup(value)

    def comparison() -> Any:
        left = primary()
        while peek() in ("==", "!="):
            op = take()[1]
            right = primary()
            same = str(left if left is not None else "") == str(right if right is not None else "")
            left = same if op == "==" else not same
        return left

    def both() -> Any:
        left = comparison()
        while peek() == "&&":
            take()
            right = comparison()
            left = right if left else left
        return left

    def either() -> Any:
        left = both()
        while peek() == "||":
            take()
            right = both()
            left = left if left else right
        return left

    result = either()
    if pos != len(toks):
        raise PipelineError(f"cannot read the expression {text!r}")
    return result


def path_lookup(contexts: dict[str, Any], name: str) -> Any:
    value: Any = contexts
    for part in name.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def substitute(text: str, lookup: Callable[[str], Any]) -> str:
    """``${{ expr }}`` in ``text`` replaced by the expression's value."""

    def one(m: re.Match[str]) -> str:
        value = evaluate(m.group(1), lookup)
        return "" if value is None else (str(value).lower() if isinstance(value, bool) else str(value))

    return re.sub(r"\$\{\{\s*(.*?)\s*\}\}", one, text)


# ---------------------------------------------------------------------------------------------
# Running shell steps


@dataclass
class Job:
    """What a job did: each step's (name, exit status or None when skipped), its outputs, its log."""

    status: str = "success"
    steps: list[tuple[str, int | None]] = field(default_factory=list)
    outputs: dict[str, dict[str, str]] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)


class Masker:
    def __init__(self, secrets: dict[str, str]) -> None:
        self.values = sorted({v.strip() for v in secrets.values() if len(v.strip()) >= 4}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for value in self.values:
            text = text.replace(value, "***")
        return text


def run_shell(argv: list[str], script: str, env: dict[str, str], cwd: Path, mask: Masker, job: Job) -> int:
    done = subprocess.run(
        [*argv, "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False
    )
    text = mask(done.stdout.decode(errors="replace"))
    job.log.append(text)
    sys.stdout.write(text)
    sys.stdout.flush()
    return done.returncode


def base_env(context: dict[str, Any], temp: Path, tools: Path) -> dict[str, str]:
    env = {
        "PATH": f"{tools}:{BASE_PATH}",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "CI": "true",
    }
    env.update({k: str(v) for k, v in (context.get("runner_env") or {}).items()})
    env["TMPDIR"] = str(temp)
    return env


def tools_dir(temp: Path) -> Path:
    """A `python` for the steps (actions/setup-python, or the python image of a GitLab job)."""
    tools = temp / "runner-tools"
    tools.mkdir(parents=True, exist_ok=True)
    python = shutil.which("python3", path=BASE_PATH)
    if python is None:
        raise PipelineError("no python3 on " + BASE_PATH)
    link = tools / "python"
    if not link.exists():
        link.symlink_to(python)
    return tools


def read_secrets(context: dict[str, Any]) -> dict[str, str]:
    folder = context.get("secrets_dir")
    if not folder:
        return {}
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(Path(folder).iterdir()) if p.is_file()}


# ---------------------------------------------------------------------------------------------
# GitHub Actions


def github_steps(workflow: dict[str, Any], job_name: str, workspace: Path) -> list[dict[str, Any]]:
    """The job's steps in order, a local composite action's steps in place (each with the
    `with:` of its use as ``_inputs``, and the action's declared inputs as defaults)."""
    job = (workflow.get("jobs") or {}).get(job_name)
    if not isinstance(job, dict):
        raise PipelineError(f"the workflow has no job {job_name!r}")
    steps: list[dict[str, Any]] = []
    for step in job.get("steps") or []:
        uses = str(step.get("uses") or "")
        if uses.startswith("./"):
            action = yaml.safe_load((workspace / uses / "action.yml").read_text(encoding="utf-8"))
            if (action.get("runs") or {}).get("using") != "composite":
                raise PipelineError(f"{uses}: only composite actions run here")
            defaults = {k: str(v.get("default", "")) for k, v in (action.get("inputs") or {}).items()}
            for inner in action["runs"]["steps"]:
                steps.append({**inner, "_inputs": {**defaults, **(step.get("with") or {})}, "_outer": step})
        else:
            steps.append(step)
    return steps


def github_job(path: Path, job_name: str, workspace: Path, context: dict[str, Any]) -> tuple[int, Job]:
    workflow = yaml.safe_load(path.read_text(encoding="utf-8"))
    job_def = (workflow.get("jobs") or {}).get(job_name) or {}
    temp = Path(context.get("temp") or workspace.parent / "runner-temp").resolve()
    temp.mkdir(parents=True, exist_ok=True)
    secrets = read_secrets(context)
    mask = Masker(secrets)
    files = {n: temp / f"github-{n.lower()}" for n in ("ENV", "PATH", "OUTPUT", "STEP_SUMMARY")}
    for f in files.values():
        f.write_text("")
    job = Job()
    pr = {"number": context.get("pull_request", 1)}
    github = {
        "event_name": context["event"],
        "ref": context.get("ref", "refs/heads/main"),
        "sha": context.get("sha", ""),
        "repository": context.get("repository", "fleet/fleet"),
        "token": "",
        "api_url": context.get("api_url", NO_FORGE),
        "workspace": str(workspace),
        "event": {"pull_request": pr} if context["event"] == "pull_request" else {},
    }
    if context["event"] == "schedule":
        github["event"] = {"schedule": context.get("schedule", "")}
    env = {**{k: str(v) for k, v in (workflow.get("env") or {}).items()}}
    env.update({k: str(v) for k, v in (job_def.get("env") or {}).items()})
    env.update({k: str(v) for k, v in (context.get("env") or {}).items()})
    contexts: dict[str, Any] = {"github": github, "env": env, "secrets": secrets, "runner": {"temp": str(temp)}}
    runner_context = {"runner_env": context.get("runner_env") or {}}

    def lookup_for(inputs: dict[str, Any] | None) -> Callable[[str], Any]:
        def lookup(name: str) -> Any:
            if name in ("always()",):
                return True
            if name == "success()":
                return job.status == "success"
            if name == "failure()":
                return job.status == "failure"
            if name.startswith("inputs."):
                return (inputs or {}).get(name.split(".", 1)[1])
            if name.startswith("steps."):
                _, sid, what, *rest = [*name.split("."), ""]
                return job.outputs.get(sid, {}).get(rest[0]) if what == "outputs" else None
            if name in ("true", "false"):
                return name == "true"
            return path_lookup(contexts, name)

        return lookup

    if "if" in job_def and not evaluate(str(job_def["if"]), lookup_for(None)):
        return NOT_RUN, job
    tools = tools_dir(temp)
    for step in github_steps(workflow, job_name, workspace):
        inputs = {k: substitute(str(v), lookup_for(None)) for k, v in (step.get("_inputs") or {}).items()}
        lookup = lookup_for(inputs)
        name = str(step.get("name") or str(step.get("uses", "")).split("@", 1)[0] or step.get("run", ""))
        condition = str(step.get("if", "success()"))
        if not re.search(r"\b(always|success|failure|cancelled)\(\)", condition):
            condition = f"success() && ({condition})"  # as GitHub: a status check unless one is named
        if not evaluate(condition, lookup):
            job.steps.append((name, None))
            continue
        print(f"::: step {name}", flush=True)
        rc = github_step(step, lookup, {**contexts, **runner_context}, files, workspace, temp, tools, mask, job)
        job.steps.append((name, rc))
        if rc != 0:
            job.status = "failure"
            print(f"::: step {name} failed (exit {rc})", flush=True)
    return (RAN if job.status == "success" else FAILED), job


def github_step(
    step: dict[str, Any],
    lookup: Callable[[str], Any],
    contexts: dict[str, Any],
    files: dict[str, Path],
    workspace: Path,
    temp: Path,
    tools: Path,
    mask: Masker,
    job: Job,
) -> int:
    uses = str(step.get("uses") or "")
    if uses:
        return stand_in(uses.split("@", maxsplit=1)[0], step, lookup, workspace, temp)
    env = base_env(contexts, temp, tools)
    env.update(contexts["env"])
    env.update(read_env_file(files["ENV"]))
    env.update({k: substitute(str(v), lookup) for k, v in (step.get("env") or {}).items()})
    extra = [p for p in files["PATH"].read_text().splitlines() if p.strip()]
    env["PATH"] = ":".join([*reversed(extra), str(tools), env.get("PATH", BASE_PATH)])
    env.update(
        {
            "GITHUB_ENV": str(files["ENV"]),
            "GITHUB_PATH": str(files["PATH"]),
            "GITHUB_OUTPUT": str(files["OUTPUT"]),
            "GITHUB_STEP_SUMMARY": str(files["STEP_SUMMARY"]),
            "GITHUB_WORKSPACE": str(workspace),
            "GITHUB_REPOSITORY": str(contexts["github"]["repository"]),
            "GITHUB_SHA": str(contexts["github"]["sha"]),
            "GITHUB_REF": str(contexts["github"]["ref"]),
            "GITHUB_EVENT_NAME": str(contexts["github"]["event_name"]),
            "GITHUB_API_URL": str(contexts["github"]["api_url"]),
            "RUNNER_TEMP": str(temp),
        }
    )
    files["OUTPUT"].write_text("")
    if str(step.get("shell", "bash")) != "bash":
        raise PipelineError(f"step {step.get('name')!r}: only bash steps run here")
    rc = run_shell(GITHUB_SHELL, substitute(str(step["run"]), lookup), env, workspace, mask, job)
    if step.get("id"):
        job.outputs[str(step["id"])] = read_env_file(files["OUTPUT"])
    return rc


def read_env_file(path: Path) -> dict[str, str]:
    """GITHUB_ENV / GITHUB_OUTPUT lines ``name=value`` (the heredoc form is not used here)."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if "=" in line:
            key, value = line.split("=", 1)
            out[key] = value
    return out


def stand_in(action: str, step: dict[str, Any], lookup: Callable[[str], Any], workspace: Path, temp: Path) -> int:
    """The remote actions the pipelines use, as the step runner stands in for them."""
    given = {k: substitute(str(v), lookup) for k, v in (step.get("with") or {}).items()}
    if action == "actions/checkout":
        # The workspace is the fleet repository's checkout; the pipeline must not keep a token.
        return 0 if str(given.get("persist-credentials")).lower() == "false" else 1
    if action == "actions/setup-python":
        return 0
    if action == "actions/upload-artifact":
        dest = temp / "artifacts" / given["name"]
        dest.mkdir(parents=True, exist_ok=True)
        for pattern in (p.strip() for p in given.get("path", "").splitlines() if p.strip()):
            for found in workspace.glob(pattern):
                shutil.copy(found, dest / found.name)
        return 0
    raise PipelineError(f"no stand-in for the action {action}")


# ---------------------------------------------------------------------------------------------
# GitLab CI


GITLAB_RESERVED = {"workflow", "stages", "variables", "default", "include", "image", "services", "cache"}


def gitlab_job_def(pipeline: dict[str, Any], name: str) -> dict[str, Any]:
    """The job with its `extends` merged in (a hash merges deeply; anything else is replaced)."""
    job = pipeline.get(name)
    if not isinstance(job, dict) or name in GITLAB_RESERVED:
        raise PipelineError(f"the pipeline has no job {name!r}")
    parents = job.get("extends") or []
    merged: dict[str, Any] = {}
    for parent in [parents] if isinstance(parents, str) else parents:
        merged = deep_merge(merged, gitlab_job_def(pipeline, parent))
    return deep_merge(merged, {k: v for k, v in job.items() if k != "extends"})


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def gitlab_script(job: dict[str, Any]) -> str:
    """before_script then script, one shell session (GitLab's shell executor: set -eo pipefail)."""
    lines = [*(job.get("before_script") or []), *(job.get("script") or [])]
    return "set -eo pipefail\n" + "\n".join(str(line) for line in lines) + "\n"


def gitlab_rules_run(rules: list[dict[str, Any]] | None, variables: dict[str, str]) -> bool:
    if rules is None:
        return True

    def lookup(name: str) -> Any:
        return variables.get(name[1:]) if name.startswith("$") else name

    return any("if" not in r or evaluate(str(r["if"]), lookup) for r in rules if r.get("when") != "never")


def gitlab_job(path: Path, name: str, workspace: Path, context: dict[str, Any]) -> tuple[int, Job]:
    pipeline = yaml.safe_load(path.read_text(encoding="utf-8"))
    job_def = gitlab_job_def(pipeline, name)
    temp = Path(context.get("temp") or workspace.parent / "runner-temp").resolve()
    temp.mkdir(parents=True, exist_ok=True)
    secrets = read_secrets(context)
    default_branch = str(context.get("default_branch", "main"))
    ref = str(context.get("ref", f"refs/heads/{default_branch}"))
    variables = {
        "CI": "true",
        "CI_PIPELINE_SOURCE": str(context["event"]),
        "CI_DEFAULT_BRANCH": default_branch,
        "CI_COMMIT_SHA": str(context.get("sha", "")),
        "CI_PROJECT_DIR": str(workspace),
        "CI_PROJECT_PATH": str(context.get("repository", "fleet/fleet")),
        "CI_PROJECT_ID": "1",
        "CI_API_V4_URL": f"{context.get('api_url', NO_FORGE)}/api/v4",
        "CI_JOB_NAME": name,
    }
    if context["event"] == "merge_request_event":
        variables["CI_MERGE_REQUEST_IID"] = str(context.get("pull_request", 1))
    else:
        variables["CI_COMMIT_BRANCH"] = ref.rsplit("/", 1)[-1]
    variables.update({k: str(v) for k, v in (pipeline.get("variables") or {}).items()})
    variables.update({k: str(v) for k, v in (job_def.get("variables") or {}).items()})
    variables.update({k: str(v) for k, v in (context.get("env") or {}).items()})
    file_vars = set(context.get("file_variables") or [])
    folder = Path(context.get("secrets_dir") or ".")
    for key, value in secrets.items():
        variables[key] = str(folder / key) if key in file_vars else value
    job = Job()
    workflow = (pipeline.get("workflow") or {}).get("rules")
    if not gitlab_rules_run(workflow, variables) or not gitlab_rules_run(job_def.get("rules"), variables):
        return NOT_RUN, job
    tools = tools_dir(temp)
    env = base_env(context, temp, tools)
    env.update(variables)
    print(f"::: job {name}", flush=True)
    rc = run_shell(GITLAB_SHELL, gitlab_script(job_def), env, workspace, Masker(secrets), job)
    job.steps.append((name, rc))
    dest = temp / "artifacts" / name
    dest.mkdir(parents=True, exist_ok=True)
    for pattern in (job_def.get("artifacts") or {}).get("paths") or []:
        for found in workspace.glob(re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), ""), str(pattern))):
            shutil.copy(found, dest / found.name)
    job.status = "success" if rc == 0 else "failure"
    return (RAN if rc == 0 else FAILED), job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("ci", choices=["github", "gitlab"])
    parser.add_argument("pipeline", type=Path, help="the workflow file or .gitlab-ci.yml")
    parser.add_argument("job")
    parser.add_argument("--workspace", type=Path, required=True, help="the fleet repository")
    parser.add_argument("--context", type=Path, required=True, help="the context, JSON (see above)")
    args = parser.parse_args(argv)
    context = json.loads(args.context.read_text(encoding="utf-8"))
    run = github_job if args.ci == "github" else gitlab_job
    try:
        code, job = run(args.pipeline.resolve(), args.job, args.workspace.resolve(), context)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return UNUSABLE
    if code == NOT_RUN:
        print(f"::: job {args.job} does not run on {context['event']}")
    else:
        for name, rc in job.steps:
            print(f"::: {'skipped' if rc is None else f'exit {rc}'}: {name}")
        print(f"::: job {args.job}: {job.status}")
    return code


if __name__ == "__main__":
    sys.exit(main())
