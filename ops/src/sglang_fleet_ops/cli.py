"""sglang-fleet-ops: plan, apply, drift, status and tuning advice of an sglang-fleet, as data.

Exit statuses: 0 nothing to do / done / all good; 2 changes pending (plan), drift found (drift),
an instance not running its desired settings healthy, or a client's endpoint stalled (status); 1 error;
3 apply refused: the saved plan is stale (its inventory or fleet fingerprint differs from now); 4 apply refused: another
run holds the fleet lock. advise: 0 advice produced, 1 error. Every command writes ``summary.json``
and ``summary.md`` in its run dir and prints ``artifacts: <run dir>`` as its last line. A reader of
stdout that goes away (``... | head``) drops the rest of the output, said once on stderr; the command
still ends and exits with its own status.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO, cast

from . import advise as advise_mod
from . import apply as apply_mod
from . import trial as trial_mod
from .closedpipe import ReaderGoneGuard
from .plan import build_plan, drift, plan_exit, plan_markdown
from .runner import Request, Run, Runner, new_run_dir, run_playbook
from .status import build_status, status_exit, status_table

OK, ERROR, CHANGES, STALE, LOCKED = 0, 1, 2, 3, 4
RETUNE_PLAYBOOK = "retune.yml"
STATUS_PLAYBOOK = "playbooks/status.yml"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang-fleet-ops", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("-i", "--inventory", help="inventory (default: the one the project's ansible.cfg names)")
        p.add_argument("-l", "--limit", help="limit to these hosts (an Ansible host pattern)")
        p.add_argument(
            "--project-dir", type=Path, default=None, help="the repository with retune.yml (default: this one)"
        )

    p = sub.add_parser("plan", help="what retune.yml would change (check mode): plan.json, plan.md")
    common(p)
    p.add_argument("--out", type=Path, default=Path("."), help="where plan.json and plan.md go too (default: .)")
    p = sub.add_parser("apply", help="run retune.yml under the fleet lock; with --plan, only if it is still current")
    common(p)
    p.add_argument("--plan", type=Path, help="a plan.json: refuse (exit 3) if the inventory or the fleet changed")
    p.add_argument("--lock-wait", type=int, default=0, help="seconds to wait for another run's fleet lock")
    p = sub.add_parser("drift", help="instances running other settings than the inventory's, or down")
    common(p)
    p = sub.add_parser("status", help="per instance and generation client: state, load, progress")
    common(p)
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    p = sub.add_parser("advise", help="what limits each instance's throughput, and the change to make (read-only)")
    common(p)
    p.add_argument("--window", type=float, help="seconds to observe (default: the playbook's, 300)")
    p.add_argument("--interval", type=float, help="seconds between metrics samples (default: 5)")
    p.add_argument("--prometheus", help="Prometheus base URL: read the window from it instead of sampling")
    p.add_argument("--out", type=Path, help="where the inventory patch goes (default: the playbook's advice/)")
    p.add_argument("--json", action="store_true", help="the report as JSON instead of text")
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
    return parser


def default_project() -> Path:
    """The repository this package lives in (ops/src/sglang_fleet_ops/cli.py), else the current dir."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / RETUNE_PLAYBOOK).is_file() and (parent / "galaxy.yml").is_file():
            return parent
    return Path.cwd()


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
        self.project = (args.project_dir or default_project()).resolve()
        self.run_dir = new_run_dir(self.project, args.command)
        self.runs: list[Run] = []

    def run(self, request: Request, limit: str | None = None) -> Run:
        """One playbook run, limited to ``limit`` (hosts; default: the command's --limit)."""
        limit = self.args.limit if limit is None else limit
        result = self.runner(self.run_dir, self.project, self.args.inventory, limit, request)
        self.runs.append(result)
        return result

    def finish(self, code: int, summary: dict[str, Any], markdown: str) -> int:
        summary = {"command": self.args.command, "exit": code, **summary, "runs": _runs(self.runs, self.run_dir)}
        write_json(self.run_dir / "summary.json", summary)
        write_text(self.run_dir / "summary.md", markdown)
        print(f"artifacts: {self.run_dir}", file=self.out)
        return code

    def problems(self, problems: Sequence[str]) -> None:
        for problem in problems:
            print(f"error: {problem}", file=self.err)


def cmd_plan(c: Command) -> int:
    plan = build_plan(c.run(Request(RETUNE_PLAYBOOK, "plan", check=True)))
    code = plan_exit(plan)
    markdown = plan_markdown(plan)
    for where in {c.run_dir, c.args.out.resolve()}:
        write_json(where / "plan.json", plan)
        write_text(where / "plan.md", markdown)
    c.problems(plan["problems"])
    print(markdown, end="", file=c.out)
    return c.finish(code, {"plan": "plan.json", "changes": plan["changes"], "problems": plan["problems"]}, markdown)


def cmd_drift(c: Command) -> int:
    plan = build_plan(c.run(Request(RETUNE_PLAYBOOK, "drift", check=True)))
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
    print(markdown, end="", file=c.out)
    return c.finish(code, {"drift": found, "problems": plan["problems"], "plan": "plan.json"}, markdown)


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
        fresh = build_plan(c.run(Request(RETUNE_PLAYBOOK, "check", check=True)))
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
    run = c.run(Request(RETUNE_PLAYBOOK, "apply", extravars=extravars, progress=True))
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
    print(markdown, end="", file=c.out)
    return c.finish(code, outcome, markdown)


def cmd_status(c: Command) -> int:
    status = build_status(c.run(Request(STATUS_PLAYBOOK, "status")))
    code = status_exit(status)
    table = status_table(status)
    print(
        json.dumps(status, indent=2, default=str) if c.args.json else table, end="\n" if c.args.json else "", file=c.out
    )
    c.problems(status["problems"])
    return c.finish(code, status, "## Status\n\n```\n" + table + "```\n")


def cmd_advise(c: Command) -> int:
    if c.args.trial:
        return cmd_trial(c)
    extravars = advise_mod.advise_extravars(c.args.window, c.args.interval, c.args.prometheus, c.args.out)
    request = Request(advise_mod.ADVISE_PLAYBOOK, "advise", extravars=extravars, progress=True)
    advice = advise_mod.build_advice(c.run(request))
    code = advise_mod.advise_exit(advice)
    if advice["report"] is not None:
        write_json(c.run_dir / "advice.json", advice["report"])
    if advice["patch_yaml"]:
        write_text(c.run_dir / "sglang-fleet-advice.yml", advice["patch_yaml"])
    if c.args.json:
        print(json.dumps(advice["report"], indent=2, default=str), file=c.out)
    else:
        print(advice["text"], end="", file=c.out)
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
    return c.finish(code, summary, markdown)


def cmd_trial(c: Command) -> int:
    """advise --trial: the proposal of one group on one canary, kept or put back (trial.py)."""
    extravars = advise_mod.advise_extravars(c.args.window, c.args.interval, c.args.prometheus, c.args.out)
    count = {"advise": 0}

    def advise_run(limit: str | None, window: float | None) -> dict[str, Any]:
        count["advise"] += 1
        ident = "advise" if count["advise"] == 1 else "trial-observe"
        request = Request(advise_mod.ADVISE_PLAYBOOK, ident, extravars=dict(extravars), progress=True)
        advice = advise_mod.build_advice(c.run(request, limit))
        if advice["report"] is not None:
            write_json(c.run_dir / f"{ident}.json", advice["report"])
        return advice

    def retune_run(limit: str, extra: dict[str, Any], ident: str) -> dict[str, Any]:
        outcome = apply_mod.build_outcome(c.run(Request(RETUNE_PLAYBOOK, ident, extravars=extra, progress=True), limit))
        write_json(c.run_dir / f"{ident}.json", outcome)
        return outcome

    trial = trial_mod.run_trial(
        advise_run,
        retune_run,
        window=c.args.window,
        group=c.args.group,
        canary=c.args.canary,
        threshold=c.args.threshold,
        settle=max(0.0, c.args.settle),
    )
    write_json(c.run_dir / "trial.json", trial)
    text = trial_mod.trial_text(trial)
    print(
        json.dumps(trial, indent=2, default=str) if c.args.json else text, end="\n" if c.args.json else "", file=c.out
    )
    c.problems(trial["problems"])
    code = trial_mod.trial_exit(trial)
    summary = {
        "trial": "trial.json",
        "decision": trial["decision"],
        "gain": trial["gain"],
        "problems": trial["problems"],
    }
    return c.finish(code, summary, "## Trial\n\n```\n" + text + "```\n")


COMMANDS = {"plan": cmd_plan, "apply": cmd_apply, "drift": cmd_drift, "status": cmd_status, "advise": cmd_advise}


def main(
    argv: Sequence[str] | None = None,
    runner: Runner = run_playbook,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    args = _parser().parse_args(argv)
    err = err or sys.stderr
    # A reader of stdout that goes away (`... | head`) costs the rest of the output, never the
    # command's artifacts or its exit status.
    guard = ReaderGoneGuard(out or sys.stdout, err, "sglang-fleet-ops")
    out = cast(TextIO, guard)
    try:
        command = Command(args, runner, out, err)
    except OSError as exc:
        print(f"error: cannot make the run dir: {exc}", file=err)
        return ERROR
    try:
        return COMMANDS[args.command](command)
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}"
        print(f"error: {msg}", file=err)
        return command.finish(ERROR, {"problems": [msg]}, f"## {args.command}: error\n\n- {msg}\n")
    finally:
        guard.flush()


if __name__ == "__main__":
    sys.exit(main())
