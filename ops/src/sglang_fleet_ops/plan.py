"""A plan: what ``retune.yml`` would do, from the events of its run in check mode with diff.

Per host the validation (``sglang_ops.fleet.server_validate``: the desired instances and their
settings fingerprints), the server role's unit check (``sglang_ops.fleet.server_units`` in
check mode with diff) and the retune's check (``sglang_ops.fleet.retune``: per instance
unchanged, would_relaunch, would_start, unhealthy (wedged while serving the desired settings), or
failed when it is blocked).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import time
from collections.abc import Iterable
from typing import Any

from .events import FLEET_LOCK_PLAY, RETUNE, SUMMARY_PLAY, UNITS, VALIDATE, HostView, by_host, play_failures
from .runner import Run

FORMAT = 1

# The retune's per-instance action in check mode -> the plan's action.
# "unhealthy": wedged while serving the desired settings; named, not touched (the retune fails).
PLAN_ACTIONS = {
    "unchanged": "unchanged",
    "would_relaunch": "relaunch",
    "would_start": "start",
    "failed": "blocked",
    "unhealthy": "unhealthy",
}
CHANGES = ("relaunch", "start")


def fingerprint(records: Iterable[Any]) -> str:
    """sha256 over the records in a canonical form (sorted, compact JSON)."""
    rows = sorted(json.dumps(r, sort_keys=True, separators=(",", ":")) for r in records)
    return "sha256:" + hashlib.sha256("\n".join(rows).encode()).hexdigest()


def unit_diff(diffs: list[dict[str, Any]], instance: dict[str, Any]) -> str | None:
    """The unit file's diff for ``instance`` (unified), from the server role's check-mode diff."""
    unit = str(instance.get("unit") or "")
    container = instance.get("container")
    for diff in diffs:
        header = str(diff.get("after_header") or diff.get("before_header") or "")
        if container is not None:
            prefix = f"CT {container}:"
            if not header.startswith(prefix):
                continue
            header = header[len(prefix) :]
        elif header.startswith("CT "):
            continue
        if header.endswith("/" + unit):
            lines = difflib.unified_diff(
                str(diff.get("before") or "").splitlines(keepends=True),
                str(diff.get("after") or "").splitlines(keepends=True),
                fromfile=str(diff.get("before_header") or header),
                tofile=str(diff.get("after_header") or header),
            )
            return "".join(lines) or None
    return None


def _unit_diffs(view: HostView) -> tuple[list[dict[str, Any]], bool]:
    """Every file diff of the host's server_units checks, and whether any reported a change."""
    diffs: list[dict[str, Any]] = []
    changed = False
    for result in view.of(UNITS):
        if not result.ok:
            continue
        for item in result.items():
            changed = changed or bool(item.get("changed"))
            found = item.get("diff")
            if isinstance(found, dict):
                found = [found]
            diffs.extend(d for d in found or [] if isinstance(d, dict))
    return diffs, changed


def skip_msg(view: HostView) -> str | None:
    """The message of a host left untouched because a canary host failed (retune.yml)."""
    for result in view.results:
        fact = (result.res.get("ansible_facts") or {}).get("sglang_retune_result")
        if result.ok and isinstance(fact, dict) and fact.get("skipped"):
            return str(fact.get("msg") or "skipped")
    return None


def host_plan(view: HostView) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]], bool]:
    """The plan of one host; its validated instances (for the inventory fingerprint); the retune's
    per-instance results (for the fleet fingerprint); whether its unit check reported changes."""
    entry: dict[str, Any] = {"status": "ok", "msg": "", "instances": [], "warnings": []}
    validated = view.last(VALIDATE)
    desired: list[dict[str, Any]] = []
    if validated is not None and validated.ok:
        desired = [i for i in validated.res.get("instances") or [] if isinstance(i, dict)]
    diffs, units_changed = _unit_diffs(view)
    retune = view.last(RETUNE)
    running = [i for i in (retune.res.get("instances") if retune else None) or [] if isinstance(i, dict)]
    by_name = {str(i.get("name")): i for i in running}
    unreachable = view.unreachable()
    failures = view.failures(exclude_plays=(SUMMARY_PLAY, FLEET_LOCK_PLAY))
    skipped = skip_msg(view)
    if retune is not None:
        entry["warnings"] += [str(w) for w in retune.res.get("warnings") or []]
    entry["warnings"] += [
        str(w)
        for r in view.results
        if r.ok and r.is_action("sglang_ops.fleet.host_lock")
        for w in r.res.get("warnings") or []
    ]
    if unreachable is not None:
        entry.update(status="unreachable", msg=f"{unreachable.task}: {unreachable.msg()}")
    elif validated is None or not validated.ok:
        why = validated.msg() if validated is not None else "no validation result"
        problems = validated.res.get("problems") if validated is not None else None
        entry.update(status="failed", msg=f"validation: {why}")
        if isinstance(problems, list) and problems:
            entry["problems"] = [str(p) for p in problems]
    elif failures:
        entry.update(status="failed", msg="; ".join(f"{f.task}: {f.msg()}" for f in failures))
    elif skipped is not None:
        entry.update(status="skipped", msg=skipped)
    elif retune is None:
        entry.update(status="failed", msg="no retune result for this host (the run ended before its retune)")
    else:
        entry["msg"] = str(retune.res.get("msg") or "")
    for inst in desired:
        name = str(inst.get("name"))
        got = by_name.get(name)
        item: dict[str, Any] = {
            "name": name,
            "action": "failed",
            "reasons": [],
            "flag_diff": {},
            "unit_diff": unit_diff(diffs, inst),
            "effective_max_running_requests_now": None,
            "predicted_after": None,
            "predicted_why": None,
            "blocked": False,
            "why": None,
        }
        if got is not None:
            action = PLAN_ACTIONS.get(str(got.get("action")), "failed")
            reasons = [str(r) for r in got.get("reasons") or []]
            item.update(
                action=action,
                reasons=reasons,
                flag_diff=got.get("flag_diff") or {},
                effective_max_running_requests_now=got.get("effective_max_running_requests_before"),
                predicted_after=got.get("predicted_effective_max_running_requests"),
                predicted_why=got.get("prediction_missing"),
                blocked=action == "blocked",
                why="; ".join(reasons) if action in ("blocked", "unhealthy") else None,
            )
        elif entry["status"] == "skipped":
            item.update(action="blocked", blocked=True, why=entry["msg"])
        else:
            item["why"] = entry["msg"] or "no retune result for this instance"
        entry["instances"].append(item)
    if not desired and entry["status"] == "ok":
        entry.update(status="failed", msg="no validated instances for this host")
    return entry, desired, running, units_changed


def build_plan(run: Run, created: float | None = None) -> dict[str, Any]:
    """The plan of a check-mode run of retune.yml."""
    views = by_host(run.events)
    hosts: dict[str, Any] = {}
    inventory_records: list[Any] = []
    fleet_records: list[Any] = []
    problems: list[str] = []
    units_changed = False
    for name in sorted(views):
        if not name:
            continue
        entry, desired, running, changed = host_plan(views[name])
        units_changed = units_changed or changed
        hosts[name] = entry
        if desired:
            inventory_records += [[name, i.get("name"), i.get("fingerprint")] for i in desired]
        else:
            inventory_records.append([name, None, entry["status"], entry["msg"]])
        if running:
            fleet_records += [
                [
                    name,
                    i.get("name"),
                    i.get("old_main_pid"),
                    i.get("old_invocation_id"),
                    i.get("running_argv"),
                    i.get("state"),
                ]
                for i in running
            ]
        else:
            fleet_records.append([name, None, entry["status"]])
        if entry["status"] in ("failed", "unreachable"):
            problems.append(f"{name}: {entry['status']}: {entry['msg']}")
            problems += [f"{name}: {p}" for p in entry.get("problems", [])]
        for inst in entry["instances"]:
            if inst["action"] in ("blocked", "failed"):
                problems.append(f"{name}/{inst['name']}: {inst['action']}: {inst['why']}")
    run_problems = [f"{f.task}: {f.msg()}" for f in play_failures(run.events, SUMMARY_PLAY)]
    if run.rc != 0 and not problems and not run_problems:
        run_problems.append(f"ansible-playbook ended with rc {run.rc} ({run.status}) and no failed task was recorded")
    if not hosts:
        run_problems.append(f"the run reached no host (rc {run.rc}, {run.status})")
    changes = sum(1 for h in hosts.values() for i in h["instances"] if i["action"] in CHANGES)
    return {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
        "inventory_fingerprint": fingerprint(inventory_records),
        "fleet_fingerprint": fingerprint(fleet_records),
        "hosts": hosts,
        "changes": changes,
        "units_changed": units_changed,
        "problems": problems + run_problems,
    }


def plan_exit(plan: dict[str, Any]) -> int:
    """0 nothing to do, 2 changes pending, 1 error (like ``terraform plan -detailed-exitcode``)."""
    if plan["problems"]:
        return 1
    return 2 if plan["changes"] or plan.get("units_changed") else 0


def md_cell(text: Any) -> str:
    """Text safe in one cell of a Markdown table."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_section(title: str, items: Iterable[Any]) -> list[str]:
    """A Markdown list under its heading, or nothing when there is nothing to list."""
    items = list(items)
    return ["", f"### {title}", ""] + [f"- {md_cell(i)}" for i in items] if items else []


def flag_changes(diff: dict[str, Any]) -> str:
    parts = [f"{k} {v[0]}→{v[1]}" for k, v in (diff.get("changed") or {}).items() if isinstance(v, list | tuple)]
    parts += [f"+{k} {v}" if v is not True else f"+{k}" for k, v in (diff.get("added") or {}).items()]
    parts += [f"-{k}" for k in diff.get("removed") or {}]
    return ", ".join(parts)


def capacity_cell(inst: dict[str, Any]) -> str:
    """The effective max running requests now, and for an instance to relaunch or start the one
    predicted after (``-`` and why in one word when it cannot be predicted)."""
    now = inst.get("effective_max_running_requests_now")
    now_text = "" if now is None else str(now)
    if inst.get("action") not in CHANGES:
        return now_text
    if inst.get("predicted_after") is not None:
        after = str(inst["predicted_after"])
    else:
        after = "-" + (f" ({inst['predicted_why']})" if inst.get("predicted_why") else "")
    return f"{now_text or '-'} → {after}"


def plan_markdown(plan: dict[str, Any], title: str = "Plan") -> str:
    exit_code = plan_exit(plan)
    verdict = {0: "nothing to do", 2: f"{plan['changes']} instance(s) to relaunch or start", 1: "ERRORS"}[exit_code]
    if exit_code == 2 and not plan["changes"]:
        verdict = "unit files to update (no relaunch)"
    lines = [
        f"## {title}: {verdict}",
        "",
        f"inventory `{plan['inventory_fingerprint'][:19]}` · fleet `{plan['fleet_fingerprint'][:19]}` · "
        f"created {plan['created']}",
        "",
        "| host/instance | action | flag changes | capacity now → after |",
        "| --- | --- | --- | --- |",
    ]
    for host, entry in plan["hosts"].items():
        if not entry["instances"]:
            lines.append(f"| {md_cell(host)} | {entry['status']} | | |")
        for inst in entry["instances"]:
            changes = flag_changes(inst["flag_diff"]) or ("unit file" if inst["unit_diff"] else "")
            if inst["action"] in ("blocked", "failed") and inst["why"]:
                changes = f"{changes} ({inst['why']})" if changes else str(inst["why"])
            lines.append(
                f"| {md_cell(host)}/{md_cell(inst['name'])} | {inst['action']} | {md_cell(changes)} | "
                f"{md_cell(capacity_cell(inst))} |"
            )
    lines += md_section("Problems", plan["problems"])
    lines += md_section("Warnings", (f"{h}: {w}" for h, e in plan["hosts"].items() for w in e.get("warnings") or []))
    return "\n".join(lines) + "\n"


def drift(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Each instance that runs other settings than the inventory's, or is down (or cannot be
    told: blocked, failed), with why."""
    out = []
    for host, entry in plan["hosts"].items():
        for inst in entry["instances"]:
            if inst["action"] == "unchanged" and not inst["unit_diff"]:
                continue
            what = {
                "relaunch": "runs other settings",
                "start": "is down",
                "unchanged": "unit file differs",
            }.get(inst["action"], inst["action"])
            why = "; ".join(inst["reasons"]) or inst["why"] or ""
            out.append({"host": host, "instance": inst["name"], "drift": what, "why": why})
    return out
