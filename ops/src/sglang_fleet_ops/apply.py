"""The outcome of an apply (``retune.yml`` run for real), from the retune results in its events.

Each host's result is what the role registered as ``sglang_retune_result``: the retune action's
own result (``sglang_ops.fleet.retune``), or the fact retune.yml sets for a host left untouched
because a canary host failed. A host with neither is an error: the run did not reach it.
"""

from __future__ import annotations

from typing import Any

from .events import FLEET_LOCK_PLAY, HOST_LOCK, RETUNE, SUMMARY_PLAY, VALIDATE, HostView, by_host, play_failures
from .plan import md_cell, md_section, skip_msg
from .runner import Run

PROVEN = ("unchanged", "relaunched", "started")
INSTANCE_FIELDS = (
    "name",
    "action",
    "state",
    "reasons",
    "flag_diff",
    "old_main_pid",
    "new_main_pid",
    "effective_max_running_requests_before",
    "effective_max_running_requests_after",
    "time_to_dead_s",
    "time_to_release_s",
    "time_to_healthy_s",
    "killed",
    "msg",
)


def lock_conflicts(run: Run) -> list[str]:
    """Why the fleet lock could not be taken, per host (the host lock names the holder)."""
    out = []
    for view in by_host(run.events).values():
        for result in view.results:
            if result.play == FLEET_LOCK_PLAY and result.is_action(HOST_LOCK) and result.failed:
                out.append(f"{view.name}: {result.msg()}")
    return out


def lock_unreachable(run: Run) -> list[str]:
    return [
        f"{view.name}: unreachable: {r.msg()}"
        for view in by_host(run.events).values()
        for r in view.results
        if r.play == FLEET_LOCK_PLAY and (r.unreachable or r.res.get("unreachable"))
    ]


def host_outcome(view: HostView) -> dict[str, Any]:
    entry: dict[str, Any] = {"status": "ok", "msg": "", "instances": []}
    retune = view.last(RETUNE)
    unreachable = view.unreachable()
    failures = view.failures(exclude_plays=(SUMMARY_PLAY, FLEET_LOCK_PLAY))
    skipped = skip_msg(view)
    validated = view.last(VALIDATE)
    if retune is not None:
        entry["instances"] = [
            {k: i.get(k) for k in INSTANCE_FIELDS} for i in retune.res.get("instances") or [] if isinstance(i, dict)
        ]
        # A line per generation client (drained per wave and back in service, stopped, or which
        # endpoint it did not take back and why), and the host's other notes, as retune.yml prints them.
        entry["notes"] = [str(n) for n in retune.res.get("notes") or []]
    if unreachable is not None:
        entry.update(status="unreachable", msg=f"{unreachable.task}: {unreachable.msg()}")
    elif failures:
        entry.update(status="failed", msg="; ".join(f"{f.task}: {f.msg()}" for f in failures))
    elif skipped is not None:
        entry.update(status="skipped", msg=skipped)
    elif retune is None:
        entry.update(status="failed", msg="no retune result for this host (the run ended before its retune)")
    else:
        entry["msg"] = str(retune.res.get("msg") or "")
    if retune is None and validated is not None and validated.ok:
        # The instances the inventory wants here, none of them proven.
        entry["instances"] = [
            {"name": i.get("name"), "action": "skipped" if skipped else "failed", "msg": entry["msg"]}
            for i in validated.res.get("instances") or []
            if isinstance(i, dict)
        ]
    return entry


def build_outcome(run: Run) -> dict[str, Any]:
    hosts = {name: host_outcome(view) for name, view in sorted(by_host(run.events).items()) if name}
    problems = []
    for name, entry in hosts.items():
        if entry["status"] != "ok":
            problems.append(f"{name}: {entry['status']}: {entry['msg']}")
        for inst in entry["instances"]:
            if inst.get("action") not in PROVEN:
                problems.append(f"{name}/{inst.get('name')}: {inst.get('action')}: {inst.get('msg')}")
    problems += [f"{f.task}: {f.msg()}" for f in play_failures(run.events, SUMMARY_PLAY)]
    if run.rc != 0 and not problems:
        problems.append(f"ansible-playbook ended with rc {run.rc} ({run.status}) and no failed task was recorded")
    if not hosts:
        problems.append(f"the run reached no host (rc {run.rc}, {run.status})")
    counts: dict[str, int] = {}
    for entry in hosts.values():
        for inst in entry["instances"]:
            counts[str(inst.get("action"))] = counts.get(str(inst.get("action")), 0) + 1
    return {"hosts": hosts, "counts": counts, "problems": problems, "rc": run.rc}


def outcome_markdown(outcome: dict[str, Any]) -> str:
    ok = not outcome["problems"]
    lines = [
        f"## Apply: {'every instance proven' if ok else 'FAILED'}",
        "",
        "| host/instance | action | state | max running requests | msg |",
        "| --- | --- | --- | --- | --- |",
    ]
    for host, entry in outcome["hosts"].items():
        if not entry["instances"]:
            lines.append(f"| {host} | {entry['status']} | | | {md_cell(entry['msg'])} |")
        for inst in entry["instances"]:
            before = inst.get("effective_max_running_requests_before")
            after = inst.get("effective_max_running_requests_after")
            capacity = "" if before is None and after is None else f"{before} → {after}"
            lines.append(
                f"| {host}/{inst.get('name')} | {inst.get('action')} | {inst.get('state') or ''} | {capacity} | "
                f"{md_cell(inst.get('msg') or '')} |"
            )
    lines += md_section(
        "Generation clients and notes",
        [f"{host}: {note}" for host, entry in outcome["hosts"].items() for note in entry.get("notes") or []],
    )
    lines += md_section("Problems", outcome["problems"])
    return "\n".join(lines) + "\n"
