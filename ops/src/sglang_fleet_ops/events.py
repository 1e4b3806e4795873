"""The results of a playbook run, per host, from ansible-runner's job events.

Only ``runner_on_ok``, ``runner_on_failed`` and ``runner_on_unreachable`` (and the skipped ones,
for completeness) are read, with ``event_data.host``, ``event_data.task``, ``event_data.play``,
``event_data.task_action`` (the module or action) and ``event_data.res`` (the task's result, as
registered). Loops come as one final event whose ``res.results`` holds every item.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# Play names of playbooks/retune.yml that decide how a failure counts (a unit test checks them
# against the playbook).
FLEET_LOCK_PLAY = "Take the fleet lock - the host lock of every host of the run - before any host is touched"
SUMMARY_PLAY = "Summary of the hosts this run reached"

VALIDATE = "sglang_ops.fleet.server_validate"
UNITS = "sglang_ops.fleet.server_units"
RETUNE = "sglang_ops.fleet.retune"
PHASE = "sglang_ops.fleet.retune_phase"
HOST_LOCK = "sglang_ops.fleet.host_lock"

RESULT_EVENTS = {"runner_on_ok", "runner_on_failed", "runner_on_unreachable", "runner_on_skipped"}


@dataclass
class TaskResult:
    event: str  # runner_on_ok, runner_on_failed, runner_on_unreachable, runner_on_skipped
    host: str
    play: str
    task: str
    action: str
    res: dict[str, Any]
    ignore_errors: bool

    @property
    def ok(self) -> bool:
        return self.event == "runner_on_ok"

    @property
    def failed(self) -> bool:
        return self.event == "runner_on_failed"

    @property
    def unreachable(self) -> bool:
        return self.event == "runner_on_unreachable"

    def is_action(self, name: str) -> bool:
        """``name`` under its FQCN or its short name."""
        return self.action == name or self.action == name.rsplit(".", 1)[-1]

    def msg(self) -> str:
        return str(self.res.get("msg") or self.res.get("stderr") or self.event)

    def items(self) -> list[dict[str, Any]]:
        """A loop's item results, or the result itself."""
        results = self.res.get("results")
        if isinstance(results, list):
            return [r for r in results if isinstance(r, dict)]
        return [self.res]


@dataclass
class HostView:
    name: str
    results: list[TaskResult] = field(default_factory=list)

    def of(self, action: str, task: str | None = None) -> list[TaskResult]:
        return [r for r in self.results if r.is_action(action) and (task is None or r.task == task)]

    def last(self, action: str, task: str | None = None) -> TaskResult | None:
        found = [r for r in self.of(action, task) if r.event != "runner_on_skipped"]
        return found[-1] if found else None

    def unreachable(self) -> TaskResult | None:
        found = [r for r in self.results if r.unreachable and not r.ignore_errors]
        return found[0] if found else None

    def failures(self, exclude_plays: Iterable[str] = ()) -> list[TaskResult]:
        """Failed tasks that were not ignored (a rescued failure still counts: it failed)."""
        skip = set(exclude_plays)
        return [r for r in self.results if r.failed and not r.ignore_errors and r.play not in skip]


def task_results(events: Iterable[dict[str, Any]]) -> list[TaskResult]:
    out = []
    for event in events:
        kind = event.get("event")
        if kind not in RESULT_EVENTS:
            continue
        data = event.get("event_data") or {}
        res = data.get("res")
        out.append(
            TaskResult(
                event=str(kind),
                host=str(data.get("host") or ""),
                play=str(data.get("play") or ""),
                task=str(data.get("task") or ""),
                action=str(data.get("resolved_action") or data.get("task_action") or ""),
                res=res if isinstance(res, dict) else {},
                ignore_errors=bool(data.get("ignore_errors")),
            )
        )
    return out


def by_host(events: Iterable[dict[str, Any]]) -> dict[str, HostView]:
    hosts: dict[str, HostView] = {}
    for result in task_results(events):
        hosts.setdefault(result.host, HostView(result.host)).results.append(result)
    return hosts


def play_failures(events: Iterable[dict[str, Any]], play: str) -> list[TaskResult]:
    return [r for r in task_results(events) if r.play == play and r.failed and not r.ignore_errors]
