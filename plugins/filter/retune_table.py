# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The summary table retune.yml prints."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.decide import flag_changes
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.record import was_unwell

DOCUMENTATION = r"""
name: retune_table
short_description: Summary table of the retune results of several hosts
version_added: 0.1.0
author: sglang-fleet contributors
description:
  - One line per instance - host/instance, action, effective max running requests before and
    after (in check mode the predicted after, or C(-) and why in one word), seconds to dead, to
    GPU memory released and to healthy, and what went wrong if anything.
  - Under an instance, one line per process killed by PID beyond its unit's own stop (an orphaned
    scheduler, a manual launch, a straggler) - PID, command line, signals and why.
  - Under a host's instances, one line per host note - each generation client (drained per wave
    and never stopped, or stopped for the retune and started again, and why), and anything else
    the retune had to say about the host.
  - A host that stopped answering mid-retune (C(HOST LOST)) - which call went unanswered and for how
    long, what is known of each instance (C(stop sent, not proven dead), C(relaunched and proven
    healthy before the host was lost), ...), the generation clients' drain left to lapse, and what to
    do next.
  - Reads each host's registered C(sglang_retune_result) (the result of M(sglang_ops.fleet.retune)).
positional: _input, hosts
options:
  _input:
    description: C(hostvars).
    type: dict
    required: true
  hosts:
    description: The hosts to report, in order.
    type: list
    elements: str
    required: true
"""

EXAMPLES = r"""
- name: Summary
  ansible.builtin.debug:
    msg: "{{ hostvars | sglang_ops.fleet.retune_table(groups['sglang_servers']) }}"
"""

RETURN = r"""
_value:
  description: The table, one string per line.
  type: list
  elements: str
"""

COLUMNS = ("instance", "action", "max running req", "dead s", "free s", "healthy s", "note")


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)


def rows_for(host: str, result: Mapping[str, Any] | None) -> list[tuple[str, ...]]:
    if not result:
        return [(host, "not run", "", "", "", "", "no retune result (host skipped, unreachable or failed before)")]
    if result.get("skipped"):
        return [(host, "skipped", "", "", "", "", str(result.get("msg", "")))]
    if "instances" not in result or not result["instances"]:
        status = "failed" if result.get("failed") else "none"
        return [(host, status, "", "", "", "", str(result.get("msg", ""))[:80]), *note_rows(host, result)]
    return instance_rows(host, result) + note_rows(host, result)


def note_rows(host: str, result: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """The host's notes, whole (a generation client's line says whether it was ever stopped)."""
    return [(host, "note", "", "", "", "", str(note)) for note in result.get("notes") or []]


def capacity_cell(inst: Mapping[str, Any], before: Any, after: Any) -> str:
    """``before -> after``; in check mode the predicted after (``_retune.predict``), or ``-`` with
    why there is none in one word (``16 -> - (journal)``)."""
    if after is None and inst.get("predicted_effective_max_running_requests") is not None:
        after = inst["predicted_effective_max_running_requests"]
    elif after is None and inst.get("prediction_missing"):
        return f"{_num(before)} -> - ({inst['prediction_missing']})"
    return f"{_num(before)} -> {_num(after)}" if after is not None or before is not None else "-"


def instance_rows(host: str, result: Mapping[str, Any]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for inst in result["instances"]:
        before = inst.get("effective_max_running_requests_before")
        after = inst.get("effective_max_running_requests_after")
        capacity = capacity_cell(inst, before, after)
        note = ""
        if inst.get("action") not in ("unchanged", "relaunched", "started"):
            note = str(inst.get("msg") or "; ".join(inst.get("reasons") or []))
        elif inst.get("action") != "unchanged" and inst.get("flag_diff"):
            note = flag_changes(inst["flag_diff"], arrow="->")
        if inst.get("teardown_s"):
            note = (f"waited {inst['teardown_s']:.1f}s for processes in teardown after SIGKILL; " + note).strip("; ")
        if inst.get("escalated"):
            note = ("SIGKILL after stop deadline; " + note).strip("; ")
        if inst.get("wedged") and inst.get("action") != "unhealthy":
            # The unhealthy one's reasons say it already; a relaunched one says what hung.
            note = (f"{was_unwell(inst['wedged'])}; " + note).strip("; ")
        if inst.get("host_lost") and inst.get("action") in ("unchanged", "relaunched", "started"):
            # Proven before its host stopped answering (a failed one's message says it already).
            note = (f"{inst['host_lost']}; " + note).strip("; ")
        rows.append(
            (
                f"{host}/{inst.get('name')}",
                str(inst.get("action")),
                capacity,
                _num(inst.get("time_to_dead_s")),
                _num(inst.get("time_to_release_s")),
                _num(inst.get("time_to_healthy_s")),
                note if len(note) <= 160 else note[:157] + "...",
            )
        )
        rows += [("", "", "", "", "", "", line) for line in killed_lines(inst.get("killed") or [])]
    return rows


def killed_lines(killed: Iterable[Mapping[str, Any]]) -> list[str]:
    """Processes killed by PID beyond the unit's own stop (orphaned schedulers, manual launches,
    stragglers), one line each: PID, signals, command line and why."""
    by_pid: dict[Any, dict[str, Any]] = {}
    for entry in killed:
        seen = by_pid.setdefault(entry.get("pid"), {"signals": [], **entry})
        seen["signals"].append(str(entry.get("signal")))
    lines = []
    for pid, entry in by_pid.items():
        cmdline = str(
            entry.get("cmdline") if isinstance(entry.get("cmdline"), str) else " ".join(entry.get("cmdline") or [])
        )
        if len(cmdline) > 100:
            cmdline = cmdline[:97] + "..."
        lines.append(f"  killed PID {pid} ({cmdline}) with {', then '.join(entry['signals'])}: {entry.get('reason')}")
    return lines


def retune_table(hostvars: Mapping[str, Any], hosts: Iterable[str]) -> list[str]:
    rows: list[tuple[str, ...]] = [COLUMNS]
    for host in hosts:
        rows += rows_for(host, (hostvars.get(host) or {}).get("sglang_retune_result"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
    lines = []
    for r in rows:
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r[:-1])) + "  " + r[-1])
    lines.insert(1, "-" * max(len(line) for line in lines))
    return [line.rstrip() for line in lines]


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"retune_table": retune_table}
