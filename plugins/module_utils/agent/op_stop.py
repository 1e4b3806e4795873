# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Operations ``stop`` (stop the units and prove each instance dead, killing its own survivors by
PID) and ``release`` (wait until its GPUs' memory is released)."""

from __future__ import annotations

from typing import Any, Callable

from .evidence import EvidenceError
from .host import Host
from .op_inspect import collect_holders, describe
from .procfs import in_cgroup
from .request import need
from .systemd import stopped


def wait_units(
    host: Host, units: list[str], done: Callable[[dict[str, str]], bool], timeout: float
) -> dict[str, dict[str, str]]:
    """Poll the units' state until ``done`` holds for each, or ``timeout`` passes: the last state."""
    state: dict[str, dict[str, str]] = {}

    def all_done() -> bool:
        state.update(host.units(units))
        return all(done(state[u]) for u in units)

    host.wait(all_done, host.monotonic() + timeout)
    return state


def op_stop(req: dict[str, Any], host: Host) -> dict[str, Any]:
    """Stop the units, then prove each instance dead: its cgroup empty, nothing of it holding
    its GPUs or listening on its port. Survivors that are the instance's own are killed by PID
    (SIGTERM, then SIGKILL); anything else in the way fails the instance closed."""
    instances = req["instances"]
    units = [i["unit"] for i in instances]
    stop_timeout = float(need(req, "stop_timeout"))
    kill_timeout = float(need(req, "kill_timeout"))
    release_timeout = float(need(req, "release_timeout"))
    t0 = host.monotonic()
    before = host.units(units)
    # Every managed instance's cgroup, to tell "another instance's process" from "foreign".
    all_units = sorted(set(host.managed_units) | set(units))
    cgroups_all = {u: s.get("ControlGroup", "") for u, s in host.units(all_units).items()}
    cgroups = {i["name"]: cgroups_all.get(i["unit"], "") or _default_cgroup(cgroups_all, i["unit"]) for i in instances}
    actions: dict[str, list[str]] = {i["name"]: [] for i in instances}
    to_stop = [
        u
        for u in units
        if before[u].get("ActiveState") not in ("inactive",) or before[u].get("SubState") == "auto-restart"
    ]
    if to_stop:
        res = host.systemctl(["stop", "--no-block", *to_stop])
        for inst in instances:
            if inst["unit"] in to_stop:
                actions[inst["name"]].append(f"systemctl stop (rc={res['rc']})")
    # A wedged instance (its own endpoints did not answer at inspect) cannot drain: its scheduler
    # answers nothing, so the drain deadline would only lengthen its outage. It gets the deadline of
    # one signal instead, then the SIGKILL of its cgroup like any other.
    deadline_s = {i["unit"]: min(stop_timeout, kill_timeout) if i.get("wedged") else stop_timeout for i in instances}
    state: dict[str, dict[str, str]] = {}

    def settled() -> bool:
        state.update(host.units(units))
        late = host.monotonic() - t0
        return all(stopped(state[u]) or late >= deadline_s[u] for u in units)

    host.wait(settled, t0 + max(deadline_s.values(), default=0.0))
    escalated = [u for u in units if not stopped(state[u])]
    # Processes known to have been SIGKILLed (pid, start time): one still present is in teardown
    # (the kernel and the GPU driver release its memory, handles and sockets; over 30 s seen on
    # large GPUs), not a survivor: it is waited for within the release deadline.
    sigkilled: set[tuple[int, int]] = set()
    if escalated:
        # The drain did not finish in time (or the main process ignores SIGTERM): SIGKILL the
        # whole unit cgroup, which is exactly the instance's processes.
        escalated_cgroups = [cgroups_all.get(u, "") for u in escalated]
        sigkilled |= {
            (pid, p["starttime"])
            for pid, p in host.processes().items()
            if any(in_cgroup(p["cgroup"], c) for c in escalated_cgroups)
        }
        res = host.systemctl(["kill", "--kill-whom=all", "--signal=SIGKILL", *escalated])
        for inst in instances:
            if inst["unit"] in escalated:
                actions[inst["name"]].append(
                    f"stop deadline {deadline_s[inst['unit']]:.0f}s passed"
                    + (" (wedged: no drain to wait for)" if inst.get("wedged") else "")
                    + f": systemctl kill SIGKILL (rc={res['rc']})"
                )
        state = wait_units(host, units, stopped, kill_timeout)
    unit_stopped_at = {u: host.monotonic() - t0 for u in units}
    # This wave's cgroups by instance name, and the other managed units' (never killed).
    holder_cgroups = {**cgroups, **{f"other:{u}": c for u, c in cgroups_all.items() if u not in units}}
    holders, notes = collect_holders(host, instances, holder_cgroups)
    killed: dict[str, list[dict[str, Any]]] = {i["name"]: [] for i in instances}
    owned_all = []
    for inst in instances:
        owned_all += [
            dict(o, instance=inst["name"])
            for o in holders[inst["name"]]["owned"]
            if not dying(o, sigkilled)  # a second SIGKILL does nothing to a process in teardown
        ]
    if owned_all:
        unique = {o["pid"]: o for o in owned_all}
        log = host.kill(list(unique.values()), kill_timeout)
        for entry in log:
            killed[unique[entry["pid"]]["instance"]].append(entry)
            if entry["signal"] == "SIGKILL":
                sigkilled.add((entry["pid"], unique[entry["pid"]]["starttime"]))
        holders, notes = collect_holders(host, instances, holder_cgroups)
    teardown_s = 0.0
    if any(_in_teardown(holders[i["name"]], sigkilled) for i in instances):
        release_deadline = host.monotonic() + release_timeout

        fresh = True  # the holders were just collected: sample again only after an interval

        def torn_down() -> bool:
            nonlocal holders, notes, fresh
            if not fresh:
                holders, notes = collect_holders(host, instances, holder_cgroups)
            fresh = False
            return not any(_in_teardown(holders[i["name"]], sigkilled) for i in instances)

        _unused, teardown_s = host.wait(torn_down, release_deadline)
        teardown_s = round(teardown_s, 3)
    final = host.units(units)
    if not all(stopped(final[u]) for u in units):
        # Once the last process of a unit is gone, systemd needs a moment to mark it stopped.
        final = wait_units(host, units, stopped, kill_timeout)
    out: dict[str, Any] = {}
    for inst in instances:
        name, unit = inst["name"], inst["unit"]
        h = holders[name]
        st = final[unit]
        if st.get("ActiveState") == "failed":
            # A stop that ended in SIGKILL leaves the unit failed; clear it so a start is clean.
            host.systemctl(["reset-failed", unit])
            actions[name].append("systemctl reset-failed")
        dead = not h["owned"] and not h["foreign"] and stopped(st)
        entry = {
            "dead": dead,
            "old_main_pid": int(before[unit].get("MainPID") or 0),
            "old_invocation_id": before[unit].get("InvocationID", ""),
            "unit_state": f"{st.get('ActiveState')}/{st.get('SubState')}",
            "escalated": unit in escalated,
            "killed": killed[name],
            "survivors": [describe(p, host) for p in h["owned"]],
            "foreign": [describe(p, host) for p in h["foreign"]],
            "time_to_dead_s": round(host.monotonic() - t0, 3) if dead else None,
            "unit_stopped_s": round(unit_stopped_at[unit], 3),
            "actions": actions[name],
        }
        in_teardown = [p for p in h["owned"] if dying(p, sigkilled)]
        if teardown_s > 0:
            entry["teardown_s"] = teardown_s  # waited for processes in teardown after SIGKILL
        if h["foreign"]:
            entry["msg"] = "; ".join(
                f"PID {p['pid']} ({' '.join(host.redactor.argv(p['cmdline'])) or '?'}) {p['reason']}"
                for p in h["foreign"]
            )
        elif in_teardown and len(in_teardown) == len(h["owned"]):
            entry["msg"] = f"still in teardown {teardown_s:.0f}s after SIGKILL (the release deadline): " + ", ".join(
                f"PID {p['pid']} ({' '.join(host.redactor.argv(p['cmdline']))})" for p in in_teardown
            )
        elif h["owned"]:
            entry["msg"] = "survived SIGKILL: " + ", ".join(str(p["pid"]) for p in h["owned"])
        elif not stopped(st):
            entry["msg"] = f"unit still {entry['unit_state']} after the stop deadline and SIGKILL"
        out[name] = entry
    return {"instances": out, "notes": notes}


def dying(proc: dict[str, Any], sigkilled: set[tuple[int, int]]) -> bool:
    """Already SIGKILLed (by us, or by the unit's escalation) and still present: in teardown."""
    return (proc["pid"], proc["starttime"]) in sigkilled


def _in_teardown(holders: dict[str, list[dict[str, Any]]], sigkilled: set[tuple[int, int]]) -> bool:
    """Everything still between the instance and a relaunch is its own processes in teardown:
    worth waiting for (anything else is not: a foreign holder or a process never killed)."""
    return bool(holders["owned"]) and not holders["foreign"] and all(dying(p, sigkilled) for p in holders["owned"])


def _default_cgroup(cgroups: dict[str, str], unit: str) -> str:
    """An inactive unit has no ControlGroup: derive its path from a sibling's, so stragglers
    that systemd still files under it are recognised."""
    for known_unit, path in cgroups.items():
        if path and path.endswith("/" + known_unit):
            return path[: -len(known_unit)] + unit
    return ""


def op_release(req: dict[str, Any], host: Host) -> dict[str, Any]:
    """Poll per-GPU memory.used (correct inside containers too, unlike compute-app PIDs) until
    every GPU of the instances is at or below the threshold, or the deadline passes."""
    instances = req["instances"]
    threshold = int(need(req, "threshold_mib"))
    timeout = float(need(req, "release_timeout"))
    t0 = host.monotonic()
    pending = {i["name"]: list(i["gpus"]) for i in instances}
    out: dict[str, Any] = {i["name"]: {"released": False, "samples": 0} for i in instances}
    first: dict[int, dict[str, Any]] = {}

    def all_released() -> bool:
        gpus = host.gpus()
        if not first:
            first.update(gpus)
        now = host.monotonic()
        for inst in instances:
            name = inst["name"]
            if name not in pending:
                continue
            missing = [g for g in inst["gpus"] if g not in gpus]
            if missing:
                out[name].update({"msg": f"nvidia-smi does not list GPU(s) {missing}"})
                del pending[name]
                continue
            used = {str(g): gpus[g]["used_mib"] for g in inst["gpus"]}
            out[name]["samples"] += 1
            out[name]["used_mib"] = used
            out[name]["used_mib_first"] = {str(g): first[g]["used_mib"] for g in inst["gpus"] if g in first}
            if all(v <= threshold for v in used.values()):
                out[name].update({"released": True, "time_to_release_s": round(now - t0, 3)})
                del pending[name]
        return not pending

    try:
        host.wait(all_released, t0 + timeout)
    except EvidenceError as exc:
        for name in pending:
            out[name].update({"released": False, "evidence_error": exc.to_dict(), "msg": exc.describe()})
        return {"instances": out}
    for name in pending:
        out[name]["msg"] = (
            f"GPU memory not released within {timeout:.0f}s: memory.used {out[name].get('used_mib')} MiB "
            f"> threshold {threshold} MiB, with no process of the instance left"
        )
    return {"instances": out}
