"""The tuning advice from the events of ``playbooks/advise.yml`` (read-only).

The playbook's ``sglang_ops.fleet.advise_report`` task (the fleet report) registers the report as
data (``report``), for people (``text``) and the inventory patch (``patch_yaml``, written on the
controller at ``patch_path``). Failures before it (a host's settings invalid, a host unreachable)
are problems; a host without evidence is named in the report itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .collection import playbook
from .events import VALIDATE, by_host
from .runner import Run

ADVISE_PLAYBOOK = playbook("advise")
ADVISE = "sglang_ops.fleet.advise"  # per host
REPORT = "sglang_ops.fleet.advise_report"  # once, the fleet's
REPORT_TASK = "Write the fleet report and the inventory patch (on the controller)"
OBSERVE_TASK = "Observe and diagnose the instances of the host"


def advise_extravars(
    window: float | None = None,
    interval: float | None = None,
    prometheus: str | None = None,
    out: Path | None = None,
    measure: bool = False,
) -> dict[str, Any]:
    """The playbook's variables for the options given (none of them secret: the runner records them)."""
    extravars: dict[str, Any] = {}
    if window is not None:
        extravars["sglang_advise_window"] = float(window)
    if interval is not None:
        extravars["sglang_advise_interval"] = float(interval)
    if prometheus:
        extravars["sglang_advise_prometheus_url"] = prometheus
    if out is not None:
        extravars["sglang_advise_output"] = str(out.resolve())
    if measure:
        extravars["sglang_advise_measure"] = True
    return extravars


def build_advice(run: Run) -> dict[str, Any]:
    """``{"report", "text", "patch_path", "patch_yaml", "advice_produced", "problems"}``."""
    hosts = by_host(run.events)
    problems: list[str] = []
    found: dict[str, Any] | None = None
    for name, view in sorted(hosts.items()):
        unreachable = view.unreachable()
        if unreachable is not None:
            problems.append(f"{name}: unreachable: {unreachable.task}: {unreachable.msg()}")
            continue
        for failure in view.failures():
            what = "invalid settings" if failure.is_action(VALIDATE) else failure.task
            problems.append(f"{name}: {what}: {failure.msg()}")
        for result in view.of(REPORT):
            if result.ok and isinstance(result.res.get("report"), dict):
                found = result.res
    if found is None:
        problems.append(f"no advice: the task {REPORT_TASK!r} gave no report (rc={run.rc})")
        return {
            "report": None,
            "text": "",
            "patch_path": None,
            "patch_yaml": None,
            "advice_produced": False,
            "problems": problems,
        }
    report = found["report"]
    for host, problem in (report.get("host_problems") or {}).items():
        line = f"{host}: no advice: {problem}"
        if not any(p.startswith(f"{host}: ") for p in problems):
            problems.append(line)
    return {
        "report": report,
        "text": str(found.get("text") or ""),
        "patch_path": found.get("patch_path"),
        "patch_yaml": found.get("patch_yaml"),
        "advice_produced": bool(found.get("advice_produced")),
        "problems": problems,
    }


def advise_exit(advice: dict[str, Any]) -> int:
    """0 when advice was produced (problems of some hosts are listed), 1 otherwise."""
    return 0 if advice["advice_produced"] else 1
