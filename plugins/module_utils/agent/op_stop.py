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
from .supervision import stopped


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
    stop = _Stop(req, host)
    stop.stop_units()
    stop.escalate()
    stop.kill_survivors()
    stop.wait_for_teardown()
    return {"instances": stop.report(), "notes": stop.notes}


class _Stop:
    """One stop of a set of instances, step by step; what each step saw is kept for the report."""

    def __init__(self, req: dict[str, Any], host: Host):
        self.host = host
        self.instances: list[dict[str, Any]] = req["instances"]
        self.units = [i["unit"] for i in self.instances]
        # Read before anything is touched: a request that lacks one fails here.
        self.stop_timeout = float(need(req, "stop_timeout"))
        self.kill_timeout = float(need(req, "kill_timeout"))
        self.release_timeout = float(need(req, "release_timeout"))
        self.t0 = host.monotonic()
        self.before = host.units(self.units)
        # Every managed instance's cgroup, to tell "another instance's process" from "foreign".
        all_units = sorted(set(host.managed_units) | set(self.units))
        self.cgroups_all = {u: s.get("ControlGroup", "") for u, s in host.units(all_units).items()}
        cgroups = {
            i["name"]: self.cgroups_all.get(i["unit"], "") or _default_cgroup(self.cgroups_all, i["unit"])
            for i in self.instances
        }
        # This wave's cgroups by instance name, and the other managed units' (never killed).
        self.holder_cgroups = {
            **cgroups,
            **{f"other:{u}": c for u, c in self.cgroups_all.items() if u not in self.units},
        }
        self.actions: dict[str, list[str]] = {i["name"]: [] for i in self.instances}
        # A wedged instance (its own endpoints did not answer at inspect) cannot drain: its
        # scheduler answers nothing, so the drain deadline would only lengthen its outage. It gets
        # the deadline of one signal instead, then the SIGKILL of its cgroup like any other.
        self.deadline_s = {
            i["unit"]: min(self.stop_timeout, self.kill_timeout) if i.get("wedged") else self.stop_timeout
            for i in self.instances
        }
        self.state: dict[str, dict[str, str]] = {}
        self.escalated: list[str] = []
        # Processes known to have been SIGKILLed (pid, start time): one still present is in
        # teardown (the kernel and the GPU driver release its memory, handles and sockets; over
        # 30 s seen on large GPUs), not a survivor: it is waited for within the release deadline.
        self.sigkilled: set[tuple[int, int]] = set()
        self.unit_stopped_at: dict[str, float] = {}
        self.holders: dict[str, dict[str, list[dict[str, Any]]]] = {}
        self.notes: dict[str, Any] = {}
        self.killed: dict[str, list[dict[str, Any]]] = {i["name"]: [] for i in self.instances}
        self.teardown_s = 0.0

    def _record(self, units: list[str], action: str) -> None:
        for inst in self.instances:
            if inst["unit"] in units:
                self.actions[inst["name"]].append(action)

    def stop_units(self) -> None:
        """Stop what runs (or waits to restart); wait for each unit within its deadline."""
        host, before = self.host, self.before
        to_stop = [
            u
            for u in self.units
            if before[u].get("ActiveState") not in ("inactive",) or before[u].get("SubState") == "auto-restart"
        ]
        if to_stop:
            res = host.service.stop(to_stop, wait=False)
            self._record(to_stop, f"{res['cmd']} (rc={res['rc']})")

        def settled() -> bool:
            self.state.update(host.units(self.units))
            late = host.monotonic() - self.t0
            return all(stopped(self.state[u]) or late >= self.deadline_s[u] for u in self.units)

        host.wait(settled, self.t0 + max(self.deadline_s.values(), default=0.0))

    def escalate(self) -> None:
        """The drain did not finish in time (or the main process ignores SIGTERM): SIGKILL every
        process of the service (its cgroup, or its marker), which is exactly the instance's."""
        host = self.host
        self.escalated = [u for u in self.units if not stopped(self.state[u])]
        if self.escalated:
            escalated_cgroups = [self.cgroups_all.get(u, "") for u in self.escalated]
            self.sigkilled |= {
                (pid, p["starttime"])
                for pid, p in host.processes().items()
                if any(in_cgroup(p["cgroup"], c) for c in escalated_cgroups)
            }
            res = host.service.kill_all(self.escalated)
            for inst in self.instances:
                if inst["unit"] in self.escalated:
                    self.actions[inst["name"]].append(
                        f"stop deadline {self.deadline_s[inst['unit']]:.0f}s passed"
                        + (" (wedged: no drain to wait for)" if inst.get("wedged") else "")
                        + f": {res['cmd']} (rc={res['rc']})"
                    )
            self.state = wait_units(host, self.units, stopped, self.kill_timeout)
        self.unit_stopped_at = {u: host.monotonic() - self.t0 for u in self.units}

    def kill_survivors(self) -> None:
        """Whatever of an instance's own still holds its GPUs or port: killed by PID (SIGTERM,
        then SIGKILL), each PID's start time checked before every signal."""
        host = self.host
        self.holders, self.notes = collect_holders(host, self.instances, self.holder_cgroups)
        owned_all = [
            dict(o, instance=inst["name"])
            for inst in self.instances
            for o in self.holders[inst["name"]]["owned"]
            if not dying(o, self.sigkilled)  # a second SIGKILL does nothing to a process in teardown
        ]
        if not owned_all:
            return
        unique = {o["pid"]: o for o in owned_all}
        for entry in host.kill(list(unique.values()), self.kill_timeout):
            self.killed[unique[entry["pid"]]["instance"]].append(entry)
            if entry["signal"] == "SIGKILL":
                self.sigkilled.add((entry["pid"], unique[entry["pid"]]["starttime"]))
        self.holders, self.notes = collect_holders(host, self.instances, self.holder_cgroups)

    def _any_in_teardown(self) -> bool:
        return any(_in_teardown(self.holders[i["name"]], self.sigkilled) for i in self.instances)

    def wait_for_teardown(self) -> None:
        """Processes SIGKILLed and still present: wait for the kernel within the release deadline."""
        if not self._any_in_teardown():
            return
        fresh = True  # the holders were just collected: sample again only after an interval

        def torn_down() -> bool:
            nonlocal fresh
            if not fresh:
                self.holders, self.notes = collect_holders(self.host, self.instances, self.holder_cgroups)
            fresh = False
            return not self._any_in_teardown()

        _unused, waited = self.host.wait(torn_down, self.host.monotonic() + self.release_timeout)
        self.teardown_s = round(waited, 3)

    def report(self) -> dict[str, Any]:
        """Each instance: dead or not, what was done, and why not in one message."""
        host = self.host
        final = host.units(self.units)
        if not all(stopped(final[u]) for u in self.units):
            # Once the last process of a unit is gone, systemd needs a moment to mark it stopped.
            final = wait_units(host, self.units, stopped, self.kill_timeout)
        out: dict[str, Any] = {}
        for inst in self.instances:
            name, unit = inst["name"], inst["unit"]
            st = final[unit]
            if st.get("ActiveState") == "failed":
                # A stop that ended in SIGKILL leaves the unit failed; clear it so a start is clean.
                res = host.service.reset_failed([unit])
                self.actions[name].append(res["cmd"])
            out[name] = self._entry(inst, st)
        return out

    def _entry(self, inst: dict[str, Any], st: dict[str, str]) -> dict[str, Any]:
        host = self.host
        name, unit = inst["name"], inst["unit"]
        h = self.holders[name]
        dead = not h["owned"] and not h["foreign"] and stopped(st)
        entry: dict[str, Any] = {
            "dead": dead,
            "old_main_pid": int(self.before[unit].get("MainPID") or 0),
            "old_invocation_id": self.before[unit].get("InvocationID", ""),
            "unit_state": f"{st.get('ActiveState')}/{st.get('SubState')}",
            "escalated": unit in self.escalated,
            "killed": self.killed[name],
            "survivors": [describe(p, host) for p in h["owned"]],
            "foreign": [describe(p, host) for p in h["foreign"]],
            "time_to_dead_s": round(host.monotonic() - self.t0, 3) if dead else None,
            "unit_stopped_s": round(self.unit_stopped_at[unit], 3),
            "actions": self.actions[name],
        }
        if self.teardown_s > 0:
            entry["teardown_s"] = self.teardown_s  # waited for processes in teardown after SIGKILL
        msg = self._why_not_dead(h, st, entry["unit_state"])
        if msg:
            entry["msg"] = msg
        return entry

    def _why_not_dead(self, h: dict[str, list[dict[str, Any]]], st: dict[str, str], unit_state: str) -> str | None:
        argv = self.host.redactor.argv
        in_teardown = [p for p in h["owned"] if dying(p, self.sigkilled)]
        if h["foreign"]:
            return "; ".join(
                f"PID {p['pid']} ({' '.join(argv(p['cmdline'])) or '?'}) {p['reason']}" for p in h["foreign"]
            )
        if in_teardown and len(in_teardown) == len(h["owned"]):
            return f"still in teardown {self.teardown_s:.0f}s after SIGKILL (the release deadline): " + ", ".join(
                f"PID {p['pid']} ({' '.join(argv(p['cmdline']))})" for p in in_teardown
            )
        if h["owned"]:
            return "survived SIGKILL: " + ", ".join(str(p["pid"]) for p in h["owned"])
        if not stopped(st):
            return f"unit still {unit_state} after the stop deadline and SIGKILL"
        return None


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
