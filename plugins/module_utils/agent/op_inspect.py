# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Operation ``inspect``: everything the retune's decision needs, for every instance of the host,
in one pass - and the evidence pre-flight: the sources of evidence the later proofs need, each
checked before anything is stopped; and whether an instance that answers still produces
(``stall.py``). Also the gathering shared with ``stop``: the processes
between an instance and its relaunch, and an instance's /health and /server_info."""

from __future__ import annotations

import json
from typing import Any

from .evidence import EvidenceError, clip
from .host import Host, parallel
from .http_client import effective_max_running_requests, instance_url, timed_out
from .nvidia import meaningful_app_pids
from .op_observe import startup_journal
from .procfs import classify_processes, in_cgroup
from .request import need
from .settings import process_evidence
from .stall import probe_stall
from .supervision import identity


def op_inspect(req: dict[str, Any], host: Host) -> dict[str, Any]:
    """Everything the decision needs, for every instance of the host, in one pass."""
    instances = req["instances"]
    units = host.units([i["unit"] for i in instances])
    gpus, gpu_error = gpu_snapshot(host)
    others = host.units(sorted(set(host.managed_units) - set(units)))
    cgroups = {i["name"]: units[i["unit"]].get("ControlGroup", "") for i in instances}
    cgroups.update({f"other:{u}": s.get("ControlGroup", "") for u, s in others.items()})
    holders, holder_notes = collect_holders(host, instances, cgroups)
    # The startup lines of a running instance's current run (the model facts the controller
    # predicts the capacity after a retune from, and refuses unfit settings by), read as the observe
    # operation does: "all" (check mode) every running instance's, "changed" (a real run) only
    # those whose command line or environment differ from the desired ones; else none.
    read_journal = req.get("startup_journal")
    stall_probe_s = float(need(req, "stall_probe_s"))
    pattern = str(need(req, "journal_pattern")) if read_journal else ""

    def inspect_one(inst: dict[str, Any]) -> dict[str, Any]:
        state = units[inst["unit"]]
        ident = identity(state)
        pid = ident["main_pid"]
        running = state.get("ActiveState") == "active" and pid > 0
        facts: dict[str, Any] = {
            "name": inst["name"],
            "unit": inst["unit"],
            "load_state": state.get("LoadState"),
            "running": running,
            "cgroup": state.get("ControlGroup", ""),
            "need_daemon_reload": state.get("NeedDaemonReload") == "yes",
            **ident,
        }
        if pid > 0:
            facts.update(process_evidence(inst, host.cmdline(pid), host.environ(pid), host.redactor.argv))
            facts["user"] = host.user(pid)
        if running:
            facts.update(probe_server(host, inst))
            if facts["server_info_status"] == 200 and not facts["unanswered"]:
                # It answers: is it still producing? (A stalled instance is unhealthy, as a wedged one.)
                facts.update(probe_stall(host, inst, stall_probe_s))
            if wants_journal(read_journal, facts):
                lines, source, error = startup_journal(host, ident["invocation_id"], inst["unit"], pattern)
                facts.update(journal=lines, journal_source=source)
                if error:
                    facts["journal_error"] = error
        facts["foreign"] = [describe(p, host) for p in holders[inst["name"]]["foreign"]]
        facts["outside_unit"] = [
            describe(p, host) for p in holders[inst["name"]]["owned"] if not p["reason"].startswith("in the instance")
        ]
        facts["installed_fingerprint"] = (host.state.desired(inst["name"]) or {}).get("fingerprint")
        facts["has_last_good"] = host.state.has_last_good(inst["name"])
        if gpus is not None:
            facts["gpu_used_mib"] = {str(g): gpus[g]["used_mib"] for g in inst["gpus"] if g in gpus}
            missing = [g for g in inst["gpus"] if g not in gpus]
            if missing:
                facts["gpu_missing"] = missing
        return facts

    results = parallel(inspect_one, instances)
    host_errors = evidence_errors(gpu_error, holder_notes)
    for inst, facts in zip(instances, results):
        facts["evidence_errors"] = host_errors + instance_evidence_errors(host, inst, facts)
    return {
        "instances": {inst["name"]: res for inst, res in zip(instances, results)},
        "gpus": {str(k): v for k, v in (gpus or {}).items()},
        "gpu_error": gpu_error,
        "holder_notes": holder_notes,
    }


def wants_journal(request: Any, facts: dict[str, Any]) -> bool:
    """Whether the inspect phase reads a running instance's startup journal (see op_inspect)."""
    if request == "changed":
        return not facts.get("argv_matches") or bool(facts.get("env_mismatches"))
    return request is True or request == "all"


def gpu_snapshot(host: Host) -> tuple[dict[int, dict[str, Any]] | None, dict[str, Any] | None]:
    try:
        return host.gpus(), None
    except EvidenceError as exc:
        return None, exc.to_dict()


def probe_server(host: Host, instance: dict[str, Any]) -> dict[str, Any]:
    """/health, then /server_info (with the API key from the secrets file)."""
    out: dict[str, Any] = {"unanswered": []}
    status, body = host.http(instance_url(instance, "/health"), host.http_timeout)
    out["health_status"] = status
    if status is None:
        out["health_error"] = body
        if timed_out(body):
            out["unanswered"].append(f"/health did not answer within {host.http_timeout:.0f}s")
    status, body = host.http(instance_url(instance, "/server_info"), host.http_timeout, host.api_key)
    out["server_info_status"] = status
    if status is None and timed_out(body):
        out["unanswered"].append(
            f"/server_info did not answer within {host.http_timeout:.0f}s "
            "(it asks every scheduler: one is stuck or gone)"
        )
    if status == 200:
        try:
            info = json.loads(body)
        except ValueError:
            out["server_info_error"] = f"not JSON: {clip(body, 300)!r}"
        else:
            out["server_info"] = host.redactor.obj(info)
            out["effective_max_running_requests"] = effective_max_running_requests(info)
    else:
        out["server_info_error"] = host.redactor.text(clip(body, 300))
    return out


def evidence_errors(gpu_error: dict[str, Any] | None, holder_notes: dict[str, Any]) -> list[dict[str, Any]]:
    """The host's sources of evidence that did not answer correctly before anything was
    touched. The stop, release and start proofs need every one of them: with one broken, an
    instance stopped now could not be proven dead or its GPU free, and would be left down."""
    errors = []
    if gpu_error:
        errors.append(gpu_error)
    smi = holder_notes.get("nvidia_smi_error")
    if smi and smi.get("cmd") not in {e.get("cmd") for e in errors}:
        errors.append(smi)
    return errors


def instance_evidence_errors(host: Host, inst: dict[str, Any], facts: dict[str, Any]) -> list[dict[str, Any]]:
    """Per instance: nvidia-smi lists its GPUs, and a running instance's main process is in the
    unit's cgroup and its /proc entry is readable (the stop proof scans both)."""
    errors: list[dict[str, Any]] = []
    if facts.get("gpu_missing"):
        errors.append(
            {"what": "GPU memory", "msg": f"GPU memory: nvidia-smi does not list GPU(s) {facts['gpu_missing']}"}
        )
    pid = int(facts.get("main_pid") or 0)
    if facts.get("running") and pid > 0:
        cgroup = facts.get("cgroup") or ""
        actual = host.cgroup(pid)
        if not in_cgroup(actual, cgroup):
            errors.append(
                {
                    "what": "the unit's cgroup",
                    "msg": f"the unit's cgroup: systemd names cgroup {cgroup!r} for {inst['unit']} "
                    f"but its main PID {pid} is in {actual!r}",
                }
            )
        if not host.fds_readable(pid):
            errors.append(
                {"what": "/proc", "msg": f"/proc: cannot read /proc/{pid}/fd (the GPU handles of the main process)"}
            )
    return errors


def collect_holders(
    host: Host, instances: list[dict[str, Any]], cgroups: dict[str, str]
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Classify, per instance, the processes between it and a relaunch."""
    table = host.processes()
    notes: dict[str, Any] = {}
    try:
        gpus = host.gpus()
        apps = host.compute_apps({g["uuid"]: i for i, g in gpus.items()})
        app_pids, meaningful = meaningful_app_pids(apps, table)
        notes["compute_apps"] = apps
        notes["compute_app_pids_meaningful"] = meaningful
    except EvidenceError as exc:
        # Device handles still tell who holds a GPU; the memory check will fail closed on
        # its own if nvidia-smi stays unusable.
        app_pids = {}
        notes["nvidia_smi_error"] = exc.to_dict()
    other = [c for c in cgroups.values() if c]
    out = {}
    for inst in instances:
        view = {"gpus": inst["gpus"], "port": inst["port"], "cgroup": cgroups.get(inst["name"], "")}
        out[inst["name"]] = classify_processes(view, table, other, app_pids)
    return out, notes


def describe(proc: dict[str, Any], host: Host) -> dict[str, Any]:
    return {
        "pid": proc["pid"],
        "cmdline": " ".join(host.redactor.argv(proc["cmdline"])),
        "reason": proc["reason"],
        "gpus": proc["gpus"],
        "port": proc["port"],
    }
