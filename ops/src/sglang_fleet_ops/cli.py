"""sglang-fleet-ops: plan, apply, drift, status and tuning advice of an sglang-fleet, as data.

It runs the playbooks of the installed collection sglang_ops.fleet by FQCN from the fleet
repository (the working directory, or --project-dir), which keeps each run's artifacts in
``.sglang-fleet-ops/runs/``. Every command writes ``summary.json`` and ``summary.md`` in its run
dir and prints ``artifacts: <run dir>`` as its last line (on stderr with --json, whose stdout is
only the JSON). Exit statuses: each command's --help. A reader of stdout
that goes away (``... | head``) drops the rest of the output, said once on stderr; the command
still ends and exits with its own status.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO, cast

from . import advise as advise_mod
from . import apply as apply_mod
from . import pictures, proposing
from . import trial as trial_mod
from .closedpipe import ReaderGoneGuard
from .collection import COLLECTION, collection_problem, own_version, playbook
from .events import RETUNE
from .plan import build_plan, drift, plan_exit, plan_markdown
from .proposal import ProposalError
from .proposal_git import GitError
from .runner import Request, Run, Runner, new_run_dir, run_playbook
from .status import build_status, status_exit, status_table

OK, ERROR, CHANGES, STALE, LOCKED = 0, 1, 2, 3, 4
RETUNE_PLAYBOOK = playbook("retune")
STATUS_PLAYBOOK = playbook("status")
PROGRAM = "sglang-fleet-ops"

# Each command's exit statuses, as its --help shows them.
EXITS: dict[str, dict[int, str]] = {
    "plan": {
        OK: "nothing to do",
        CHANGES: "changes pending (an instance to relaunch or start, or a unit file to update)",
        ERROR: "an error (a validation problem, a blocked or failed instance, an unreachable host; ansible's error)",
    },
    "apply": {
        OK: "every instance unchanged, relaunched or started, and proven",
        ERROR: "an instance failed, rolled back or skipped; a host with no result; ansible's error",
        STALE: "refused, nothing touched: the saved plan is stale (the inventory or the fleet changed)",
        LOCKED: "refused, nothing touched: another run holds the fleet lock (named)",
    },
    "drift": {OK: "no drift", CHANGES: "drift (the instances named)", ERROR: "an error"},
    "status": {
        OK: "every instance running, healthy, serving its desired settings",
        CHANGES: "an instance is not, or a generation client's endpoint stalled or taken out of service",
        ERROR: "an error",
    },
    "advise": {
        OK: "advice produced (hosts without evidence listed as problems); --trial: kept or reverted",
        ERROR: "no report; --trial: the trial failed or the canary could not be put back; "
        "--propose: a kept patch that could not be committed",
    },
    "propose": {
        proposing.OPENED: "the branch pushed and the merge request / pull request opened (its URL printed)",
        proposing.FAILED: "not opened: a push or the platform's API failed (the HTTP status named), or bad input",
        proposing.NOTHING: "nothing to propose: the trial was reverted or failed (proposal.json says why)",
    },
}


def exits_epilog(command: str) -> str:
    return "exit statuses:\n" + "".join(f"  {code}  {what}\n" for code, what in sorted(EXITS[command].items()))


class PlaybookError(Exception):
    """ansible-playbook ended before any task: its own error lines."""

    def __init__(self, playbook_name: str, rc: int, lines: list[str]) -> None:
        self.lines = lines or [f"ansible-playbook {playbook_name} ended with rc {rc} before any task (no error line)"]
        super().__init__("; ".join(self.lines))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--version", action="version", version=f"{PROGRAM} {own_version()} (drives the collection {COLLECTION})"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=exits_epilog(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("-i", "--inventory", help="inventory (default: the one the project's ansible.cfg names)")
        p.add_argument("-l", "--limit", help="limit to these hosts (an Ansible host pattern)")
        p.add_argument(
            "--project-dir",
            type=Path,
            default=None,
            help="the fleet repository: its ansible.cfg, and where runs are kept (default: the working directory)",
        )
        return p

    p = command("plan", f"what {RETUNE_PLAYBOOK} would change (check mode): plan.json, plan.md")
    p.add_argument("--out", type=Path, default=Path("."), help="where plan.json and plan.md go too (default: .)")
    p.add_argument("--json", action="store_true", help="the plan as JSON on stdout (nothing else there)")
    p = command("apply", f"run {RETUNE_PLAYBOOK} under the fleet lock; with --plan, only if it is still current")
    p.add_argument("--plan", type=Path, help="a plan.json: refuse (exit 3) if the inventory or the fleet changed")
    p.add_argument("--lock-wait", type=int, default=0, help="seconds to wait for another run's fleet lock")
    p = command("drift", "instances running other settings than the inventory's, or down")
    p.add_argument("--json", action="store_true", help="the drift and its plan as JSON on stdout (nothing else there)")
    p = command("status", "per instance and generation client: state, load, progress")
    p.add_argument("--json", action="store_true", help="JSON instead of a table (nothing else on stdout)")
    p = command("advise", "what limits each instance's throughput, and the change to make (read-only)")
    p.add_argument("--window", type=float, help="seconds to observe (default: the playbook's, 300)")
    p.add_argument("--interval", type=float, help="seconds between metrics samples (default: 5)")
    p.add_argument("--prometheus", help="Prometheus base URL: read the window from it instead of sampling")
    p.add_argument("--out", type=Path, help="where the inventory patch goes (default: the playbook's advice/)")
    p.add_argument("--json", action="store_true", help="the report as JSON instead of text")
    p.add_argument(
        "--measure",
        action="store_true",
        help="after the window, step each instance's concurrency for a few seconds (its clients drained) "
        "to fit its step time where the window did not vary it (docs/advisor.md)",
    )
    p.add_argument(
        "--trial",
        action="store_true",
        help="apply one group's proposal to ONE canary instance (retune.yml), measure it against the group's "
        "untouched instances over the window, keep it if the gain reaches --threshold, else put it back",
    )
    p.add_argument(
        "--group",
        type=int,
        help="--trial: the group to try (1-based, report order; default: the first with server settings to change)",
    )
    p.add_argument(
        "--canary",
        help="--trial: the canary, host/instance (default: the group's first; alone, it names the group too)",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=trial_mod.DEFAULT_THRESHOLD,
        help="--trial: the throughput gain kept (default 1.10: 10%% more than the untouched mean)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=60.0,
        help="--trial: seconds between the canary's relaunch and the measuring window (default 60)",
    )
    p.add_argument(
        "--propose",
        action="store_true",
        help="--trial, in a fleet repository: when kept, write the patch into the inventory files (the layer it "
        "names, comments kept) and commit it on a new branch (the current branch and checkout untouched); "
        "checked before the canary is touched; proposal.json in the run dir",
    )
    p = command("propose", "push a kept trial's branch and open its merge request / pull request (proposal.json)")
    p.add_argument("--proposal", type=Path, required=True, help="the proposal.json of advise --trial --propose")
    p.add_argument("--platform", choices=sorted(proposing.TOKEN_ENV), required=True, help="where the repository is")
    p.add_argument("--remote", default="origin", help="the git remote the branch is pushed to (default: origin)")
    p.add_argument("--base", help="the branch merged into (default: the branch the proposal was made from)")
    p.add_argument(
        "--token-env",
        help="the environment variable holding the token (default: GITHUB_TOKEN; GitLab: "
        f"{proposing.TOKEN_ENV['gitlab']}, a project access token: CI_JOB_TOKEN cannot open merge requests)",
    )
    return parser


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _runs(runs: Sequence[Run], run_dir: Path) -> list[dict[str, Any]]:
    return [
        {
            "ident": r.ident,
            "playbook": r.playbook,
            "rc": r.rc,
            "status": r.status,
            "artifacts": str(r.artifact_dir.relative_to(run_dir))
            if r.artifact_dir and r.artifact_dir.is_relative_to(run_dir)
            else str(r.artifact_dir),
        }
        for r in runs
    ]


class Command:
    def __init__(self, args: argparse.Namespace, runner: Runner, out: TextIO, err: TextIO):
        self.args = args
        self.runner = runner
        self.out = out
        self.err = err
        self.project = (args.project_dir or Path.cwd()).resolve()
        self.run_dir = new_run_dir(self.project, args.command)
        self.runs: list[Run] = []
        # --json: stdout is the JSON only; the text and the artifacts line go to stderr.
        self.json = bool(getattr(args, "json", False))

    def run(self, request: Request, limit: str | None = None) -> Run:
        """One playbook run, limited to ``limit`` (hosts; default: the command's --limit). A run that
        ended before any task (ansible could not start it) raises PlaybookError with ansible's lines."""
        limit = self.args.limit if limit is None else limit
        result = self.runner(self.run_dir, self.project, self.args.inventory, limit, request)
        self.runs.append(result)
        if result.rc != 0 and not result.reached_a_task():
            raise PlaybookError(request.playbook, result.rc, result.error_lines())
        return result

    def text(self, text: str) -> None:
        """What a person reads: stdout, or stderr under --json."""
        print(text, end="", file=self.err if self.json else self.out)

    def finish(self, code: int, summary: dict[str, Any], markdown: str, data: Any = None) -> int:
        """Write summary.json and summary.md; print ``data`` (default: the summary) under --json,
        and the artifacts line."""
        summary = {"command": self.args.command, "exit": code, **summary, "runs": _runs(self.runs, self.run_dir)}
        write_json(self.run_dir / "summary.json", summary)
        write_text(self.run_dir / "summary.md", markdown)
        if self.json:
            print(json.dumps(summary if data is None else data, indent=2, default=str), file=self.out)
        print(f"artifacts: {self.run_dir}", file=self.err if self.json else self.out)
        return code

    def patch_out(self) -> Path:
        """Where the advise playbook writes the inventory patch: --out, else the run dir (never
        beside the installed collection's playbook)."""
        return Path(self.args.out) if self.args.out is not None else self.run_dir / "sglang-fleet-advice.yml"

    def problems(self, problems: Sequence[str]) -> None:
        for problem in problems:
            print(f"error: {problem}", file=self.err)


def cmd_plan(c: Command) -> int:
    plan = build_plan(c.run(Request(RETUNE_PLAYBOOK, "plan", check=True, progress=True, done_action=RETUNE)))
    code = plan_exit(plan)
    markdown = plan_markdown(plan)
    for where in {c.run_dir, c.args.out.resolve()}:
        write_json(where / "plan.json", plan)
        write_text(where / "plan.md", markdown)
    c.problems(plan["problems"])
    c.text(markdown)
    summary = {"plan": "plan.json", "changes": plan["changes"], "problems": plan["problems"]}
    return c.finish(code, summary, markdown, data=plan)


def cmd_drift(c: Command) -> int:
    plan = build_plan(c.run(Request(RETUNE_PLAYBOOK, "drift", check=True, progress=True, done_action=RETUNE)))
    found = drift(plan)
    code = ERROR if plan["problems"] else (CHANGES if found else OK)
    write_json(c.run_dir / "plan.json", plan)
    write_text(c.run_dir / "plan.md", plan_markdown(plan))
    lines = [f"## Drift: {len(found)} instance(s)" if found else "## Drift: none", ""]
    lines += [f"- {d['host']}/{d['instance']} {d['drift']}: {d['why']}" for d in found]
    if plan["problems"]:
        lines += ["", "### Problems", ""] + [f"- {p}" for p in plan["problems"]]
    markdown = "\n".join(lines) + "\n"
    c.problems(plan["problems"])
    c.text(markdown)
    summary = {"drift": found, "problems": plan["problems"], "plan": "plan.json"}
    return c.finish(code, summary, markdown, data={**summary, "plan": plan})


def cmd_apply(c: Command) -> int:
    saved_fp: dict[str, Any] | None = None
    if c.args.plan is not None:
        try:
            saved = json.loads(c.args.plan.read_text(encoding="utf-8"))
            saved_fp = {k: saved[k] for k in ("inventory_fingerprint", "fleet_fingerprint")}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            msg = f"cannot read the plan {c.args.plan}: {exc}"
            c.problems([msg])
            return c.finish(ERROR, {"problems": [msg]}, f"## Apply: refused\n\n- {msg}\n")
        fresh = build_plan(c.run(Request(RETUNE_PLAYBOOK, "check", check=True, progress=True, done_action=RETUNE)))
        write_json(c.run_dir / "plan.json", fresh)
        write_text(c.run_dir / "plan.md", plan_markdown(fresh, "Plan now"))
        if fresh["problems"]:
            c.problems(fresh["problems"])
            md = "## Apply: refused, the plan now has errors; nothing was touched\n\n"
            md += "".join(f"- {p}\n" for p in fresh["problems"])
            return c.finish(ERROR, {"problems": fresh["problems"], "touched": False}, md)
        stale = [
            f"{k}: plan {saved_fp[k]}, now {fresh[k]}"
            for k in ("inventory_fingerprint", "fleet_fingerprint")
            if saved_fp[k] != fresh[k]
        ]
        if stale:
            msgs = [f"the plan is stale, nothing was touched: {s}" for s in stale]
            c.problems(msgs)
            md = "## Apply: refused, the plan is stale; nothing was touched\n\n" + "".join(f"- {m}\n" for m in msgs)
            return c.finish(STALE, {"problems": msgs, "stale": stale, "touched": False}, md)
    extravars = {"sglang_retune_fleet_lock": True, "sglang_retune_lock_wait": max(int(c.args.lock_wait), 0)}
    run = c.run(Request(RETUNE_PLAYBOOK, "apply", extravars=extravars, progress=True, done_action=RETUNE))
    conflicts = apply_mod.lock_conflicts(run)
    if conflicts:
        msgs = [f"the fleet lock is held, nothing was touched: {m}" for m in conflicts]
        c.problems(msgs)
        md = "## Apply: refused, another run holds the fleet lock\n\n" + "".join(f"- {m}\n" for m in msgs)
        return c.finish(LOCKED, {"problems": msgs, "touched": False}, md)
    unreachable = apply_mod.lock_unreachable(run)
    if unreachable:
        msgs = [f"the fleet lock could not be taken, nothing was touched: {m}" for m in unreachable]
        c.problems(msgs)
        md = "## Apply: refused, a host is unreachable\n\n" + "".join(f"- {m}\n" for m in msgs)
        return c.finish(ERROR, {"problems": msgs, "touched": False}, md)
    outcome = apply_mod.build_outcome(run)
    code = ERROR if outcome["problems"] else OK
    markdown = apply_mod.outcome_markdown(outcome)
    c.problems(outcome["problems"])
    c.text(markdown)
    return c.finish(code, outcome, markdown)


def cmd_status(c: Command) -> int:
    status = build_status(c.run(Request(STATUS_PLAYBOOK, "status", progress=True, done_action=RETUNE)))
    code = status_exit(status)
    table = status_table(status)
    if not c.json:
        c.text(table)
    c.problems(status["problems"])
    return c.finish(code, status, "## Status\n\n```\n" + table + "```\n", data=status)


def cmd_advise(c: Command) -> int:
    if c.args.trial:
        return cmd_trial(c)
    if c.args.propose:
        msg = "--propose proposes a kept trial: give --trial too; nothing was run"
        c.problems([msg])
        return c.finish(ERROR, {"problems": [msg]}, f"## Advise: refused\n\n- {msg}\n")
    extravars = advise_mod.advise_extravars(
        c.args.window, c.args.interval, c.args.prometheus, c.patch_out(), measure=c.args.measure
    )
    request = Request(
        advise_mod.ADVISE_PLAYBOOK, "advise", extravars=extravars, progress=True, done_action=advise_mod.ADVISE
    )
    advice = advise_mod.build_advice(c.run(request))
    code = advise_mod.advise_exit(advice)
    if advice["report"] is not None:
        write_json(c.run_dir / "advice.json", advice["report"])
    if advice["patch_yaml"]:
        write_text(c.run_dir / "sglang-fleet-advice.yml", advice["patch_yaml"])
    if advice["report"] is not None:
        advice["text"] += picture_lines(*pictures.advice_pictures(advice["report"], c.run_dir))
    if not c.json:
        c.text(advice["text"])
    c.problems(advice["problems"])
    markdown = "## Advice\n\n```\n" + advice["text"] + "```\n"
    if advice["problems"]:
        markdown += "\n### Problems\n\n" + "".join(f"- {p}\n" for p in advice["problems"])
    summary = {
        "advice": "advice.json" if advice["report"] is not None else None,
        "patch": advice["patch_path"],
        "diagnoses": (advice["report"] or {}).get("diagnoses"),
        "problems": advice["problems"],
    }
    return c.finish(code, summary, markdown, data=advice["report"])


def picture_lines(paths: Sequence[Path], missing: str | None) -> str:
    """``picture: PATH`` per PNG drawn, or why none was."""
    if missing:
        return f"{missing}\n"
    return "".join(f"picture: {p}\n" for p in paths)


def cmd_trial(c: Command) -> int:
    """advise --trial: the proposal of one group on one canary, kept or put back (trial.py)."""
    extravars = advise_mod.advise_extravars(
        c.args.window, c.args.interval, c.args.prometheus, c.patch_out(), measure=c.args.measure
    )
    count = {"advise": 0}
    reports: dict[str, dict[str, Any]] = {}

    def advise_run(limit: str | None, window: float | None) -> dict[str, Any]:
        count["advise"] += 1
        ident = "advise" if count["advise"] == 1 else "trial-observe"
        # The measurement and --out are the advice's; the trial's own observations measure the canary
        # as it runs, and their patches (the canary on an override) go to the run dir.
        ex = dict(extravars)
        if count["advise"] > 1:
            ex = {k: v for k, v in ex.items() if "measure" not in k}
            ex["sglang_advise_output"] = str((c.run_dir / f"{ident}-advice.yml").resolve())
        request = Request(advise_mod.ADVISE_PLAYBOOK, ident, extravars=ex, progress=True, done_action=advise_mod.ADVISE)
        advice = advise_mod.build_advice(c.run(request, limit))
        if advice["report"] is not None:
            write_json(c.run_dir / f"{ident}.json", advice["report"])
            reports[ident] = advice["report"]
        return advice

    def retune_run(limit: str, extra: dict[str, Any], ident: str) -> dict[str, Any]:
        request = Request(RETUNE_PLAYBOOK, ident, extravars=extra, progress=True, done_action=RETUNE)
        outcome = apply_mod.build_outcome(c.run(request, limit))
        write_json(c.run_dir / f"{ident}.json", outcome)
        return outcome

    proposer = None
    if c.args.propose:
        try:
            proposer = proposing.TrialProposal(c.project, proposing.inventory_path(c.project, c.args.inventory))
        except trial_mod.TrialError as exc:
            c.problems([str(exc)])
            return c.finish(ERROR, {"problems": [str(exc)]}, f"## Trial: refused\n\n- {exc}\n")
    trial = trial_mod.run_trial(
        advise_run,
        retune_run,
        window=c.args.window,
        group=c.args.group,
        canary=c.args.canary,
        threshold=c.args.threshold,
        settle=max(0.0, c.args.settle),
        before_touch=proposer.before_touch if proposer else None,
    )
    drawn, missing = pictures.trial_picture(reports.get("advise"), reports.get("trial-observe"), trial, c.run_dir)
    trial["picture"] = str(drawn) if drawn else missing
    write_json(c.run_dir / "trial.json", trial)
    drawn_advice: list[Path] = []
    if reports.get("advise") is not None:
        drawn_advice, _none = pictures.advice_pictures(reports["advise"], c.run_dir)
    text = trial_mod.trial_text(trial) + picture_lines([*drawn_advice, *([drawn] if drawn else [])], missing)
    code = trial_mod.trial_exit(trial)
    found = None
    if proposer is not None:
        found = proposer.finish(trial)
        write_json(c.run_dir / "proposal.json", found)
        text += proposing.proposal_text(found)
        if trial["decision"] == "kept" and not found["proposed"]:
            trial["problems"].append(str(found["why"]))
            code = ERROR
    if not c.json:
        c.text(text)
    c.problems(trial["problems"])
    summary = {
        "trial": "trial.json",
        "decision": trial["decision"],
        "gain": trial["gain"],
        "proposal": None if found is None else "proposal.json",
        "proposed": None if found is None else found["proposed"],
        "problems": trial["problems"],
    }
    return c.finish(code, summary, "## Trial\n\n```\n" + text + "```\n", data=trial)


def cmd_propose(c: Command) -> int:
    """propose: the branch of a kept trial pushed and its merge request / pull request opened."""
    try:
        found = proposing.read_proposal(c.args.proposal)
        if not found.get("proposed"):
            msg = f"nothing to propose: {found.get('why')}"
            c.text(msg + "\n")
            return c.finish(proposing.NOTHING, {"proposed": False, "why": found.get("why")}, f"## Proposal\n\n{msg}\n")
        platform = proposing.platform_from_env(c.args.platform, c.args.token_env)
        token = os.environ.get(c.args.token_env or proposing.TOKEN_ENV[c.args.platform], "")
        opened = proposing.open_proposal(found, platform, c.project, c.args.remote, c.args.base, token)
    except (ProposalError, GitError) as exc:
        msg = f"the merge request / pull request was not opened: {exc}"
        c.problems([msg])
        return c.finish(proposing.FAILED, {"problems": [msg]}, f"## Proposal: not opened\n\n- {msg}\n")
    text = f"opened on {opened['platform']}: {opened['url']} ({opened['branch']} -> {opened['base']})\n"
    c.text(text)
    return c.finish(proposing.OPENED, {"proposed": True, **opened}, "## Proposal\n\n" + text)


COMMANDS = {
    "plan": cmd_plan,
    "apply": cmd_apply,
    "drift": cmd_drift,
    "status": cmd_status,
    "advise": cmd_advise,
    "propose": cmd_propose,
}


def main(
    argv: Sequence[str] | None = None,
    runner: Runner = run_playbook,
    out: TextIO | None = None,
    err: TextIO | None = None,
    check_collection: Callable[[Path], str | None] = collection_problem,
) -> int:
    """The CLI. ``check_collection`` says why the installed collection cannot be driven (None: it can)."""
    args = _parser().parse_args(argv)
    err_stream: TextIO = err or sys.stderr
    # A reader of stdout that goes away (`... | head`) costs the rest of the output, never the
    # command's artifacts or its exit status.
    out_stream = cast(TextIO, ReaderGoneGuard(out or sys.stdout, err_stream, "sglang-fleet-ops"))
    try:
        return _main(args, runner, out_stream, err_stream, check_collection)
    finally:
        # Flushed here, where a reader that went is caught, not by the interpreter at exit.
        out_stream.flush()
        err_stream.flush()


def _main(
    args: argparse.Namespace,
    runner: Runner,
    out_stream: TextIO,
    err_stream: TextIO,
    check_collection: Callable[[Path], str | None],
) -> int:
    problem = check_collection((args.project_dir or Path.cwd()).resolve())
    if problem is not None:
        # Nothing was run and nothing is written: the project may be the wrong directory.
        print(f"error: {problem}", file=err_stream)
        return ERROR
    try:
        command = Command(args, runner, out_stream, err_stream)
    except OSError as exc:
        print(f"error: cannot make the run dir: {exc}", file=err_stream)
        return ERROR
    try:
        return COMMANDS[args.command](command)
    except PlaybookError as exc:
        for line in exc.lines:
            print(f"error: {line}", file=err_stream)
        md = f"## {args.command}: ansible-playbook ended before any task\n\n" + "".join(f"- {x}\n" for x in exc.lines)
        return command.finish(ERROR, {"problems": exc.lines}, md)
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}"
        print(f"error: {msg}", file=err_stream)
        return command.finish(ERROR, {"problems": [msg]}, f"## {args.command}: error\n\n- {msg}\n")


if __name__ == "__main__":
    sys.exit(main())
