# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Operations ``start`` (start the units and prove each a new, healthy process serving exactly the
expected settings) and ``record`` (keep the settings an instance serves as its last good ones)."""

from __future__ import annotations

import json
from typing import Any

from .evidence import clip
from .host import Host, parallel
from .http_client import instance_url
from .op_clients import op_resume
from .op_inspect import probe_server
from .procfs import in_cgroup
from .request import need
from .settings import describe_server_info, differences, process_evidence
from .state import sha256
from .supervision import identity


def op_start(req: dict[str, Any], host: Host) -> dict[str, Any]:
    """Start each instance (its desired unit, or its last good one for a rollback), prove it
    is a new process (new main PID and invocation), healthy (/health 200), serving exactly the
    expected settings (/server_info, its own command line and environment), with the asserted
    capacity, and able to answer real completions. Records the last good settings on success."""
    instances = req["instances"]
    start_timeout = float(need(req, "start_timeout"))
    health_timeout = float(need(req, "health_timeout"))
    need(req, "smoke_requests")  # read after the start: known to be there before it
    out: dict[str, Any] = {}
    ready: list[dict[str, Any]] = []
    listen_ports = host.listening_ports()
    table: dict[int, dict[str, Any]] | None = None
    for inst in instances:
        name = inst["name"]
        res: dict[str, Any] = {"started": False, "healthy": False, "actions": []}
        out[name] = res
        if inst.get("use_last_good"):
            record = host.state.last_good(name)
            if not record or record.get("_corrupt"):
                res["msg"] = f"no usable last good settings recorded at {host.state.last_good_path(name)}"
                continue
            inst.update(
                argv=record["argv"],
                env=record["env"],
                expected_server_info=record["expected_server_info"],
                fingerprint=record["fingerprint"],
            )
            unit_path = record["unit_path"]
            if host.file_state(unit_path).get("sha256") != sha256(record["unit_text"].encode()):
                host.write_file(unit_path, record["unit_text"], 0o644)
                res["actions"].append(f"restored last good unit {unit_path}")
                host.service.reload()
        else:
            desired = host.state.desired(name) or {}
            if desired.get("fingerprint") != inst["fingerprint"]:
                res["msg"] = (
                    f"the desired state installed on the host ({host.state.desired_path(name)}, fingerprint "
                    f"{desired.get('fingerprint')}) is not the inventory's ({inst['fingerprint']}): "
                    "apply the server role first (retune.yml does)"
                )
                continue
        if inst["port"] in listen_ports:
            table = table or host.processes()
            holders = [p for p in table.values() if inst["port"] in p["ports"]]
            res["msg"] = f"port {inst['port']} is already in use by " + ", ".join(
                f"PID {p['pid']} ({' '.join(host.redactor.argv(p['cmdline']))})" for p in holders
            )
            continue
        ready.append(inst)
    if not ready:
        return {"instances": out}
    units = [i["unit"] for i in ready]
    host.service.reset_failed(units)
    t0 = host.monotonic()
    res_start = host.service.start(units, wait=False)
    for inst in ready:
        out[inst["name"]]["actions"].append(f"{res_start['cmd']} (rc={res_start['rc']})")

    def start_one(inst: dict[str, Any]) -> dict[str, Any]:
        return _prove_started(host, inst, t0, start_timeout, health_timeout, req)

    for inst, res in zip(ready, parallel(start_one, ready)):
        out[inst["name"]].update(res)
    result: dict[str, Any] = {"instances": out}
    if req.get("resume_clients") and all(r.get("healthy") for r in out.values()):
        # The wave is healthy: hand its endpoints back to the generation clients now, in this round
        # trip, rather than in one of their own (each round trip is capacity the wave does not serve).
        result["resumed"] = op_resume({**req, "clients": req["resume_clients"]}, host)["clients"]
    return result


def _prove_started(
    host: Host,
    inst: dict[str, Any],
    t0: float,
    start_timeout: float,
    health_timeout: float,
    req: dict[str, Any],
) -> dict[str, Any]:
    """Wait until the unit runs a new main process that answers /health, or crashes, or the
    start deadline passes; then prove its settings."""
    unit = inst["unit"]
    old_pid = int(inst.get("old_main_pid") or 0)
    old_inv = inst.get("old_invocation_id") or ""
    res: dict[str, Any] = {"started": False, "healthy": False}
    deadline = t0 + start_timeout
    seen: dict[str, Any] = {"first": None, "activity": False, "crashed": False}
    state: dict[str, str] = {}

    def settled() -> bool:
        state.update(host.units([unit])[unit])
        ident = identity(state)
        seen["ident"] = ident
        first = seen["first"] = seen["first"] or ident
        new_identity = ident["main_pid"] > 0 and ident["main_pid"] != old_pid and ident["invocation_id"] != old_inv
        # A queued start job leaves the unit inactive for a moment: "inactive" means it ended
        # only once it had been seen activating (or long after the start was asked for).
        seen["activity"] = seen["activity"] or ident["active_state"] in ("activating", "active") or new_identity
        seen["crashed"] = (
            ident["active_state"] == "failed"
            or ident["sub_state"] == "auto-restart"
            or ident["n_restarts"] > first["n_restarts"]
            or (ident["active_state"] == "inactive" and (seen["activity"] or host.monotonic() - t0 > 30))
        )
        if seen["crashed"]:
            return True
        if new_identity:
            res["started"] = True
            res["new_main_pid"] = ident["main_pid"]
            res["new_invocation_id"] = ident["invocation_id"]
            status, _unused = host.http(
                instance_url(inst, "/health"), min(host.http_timeout, max(1.0, deadline - host.monotonic()))
            )
            if status == 200:
                res["time_to_healthy_s"] = round(host.monotonic() - t0, 3)
                return True
        return False

    healthy, _unused = host.wait(settled, deadline)
    ident = seen["ident"]
    if seen["crashed"]:
        res.update(
            msg=f"crashed while starting: unit {ident['active_state']}/{ident['sub_state']} (result {ident['result']})",
            crashed=True,
            journal=host.journal(ident["invocation_id"] or old_inv, unit, 30),
            new_main_pid=ident["main_pid"],
        )
        return res
    if not healthy:
        res.update(
            msg=f"not healthy within the start deadline of {start_timeout:.0f}s "
            f"(unit {ident['active_state']}/{ident['sub_state']})",
            journal=host.journal(ident["invocation_id"], unit, 30),
        )
        return res
    return _prove_settings(host, inst, res, state, health_timeout, req)


def _prove_settings(
    host: Host,
    inst: dict[str, Any],
    res: dict[str, Any],
    state: dict[str, str],
    health_timeout: float,
    req: dict[str, Any],
) -> dict[str, Any]:
    problems: list[str] = []
    pid = res["new_main_pid"]
    cgroup = state.get("ControlGroup", "")
    # Who owns the port: the new server, not a leftover that answered its warmup.
    table = host.processes()
    listeners = [p for p in table.values() if inst["port"] in p["ports"]]
    strangers = [p for p in listeners if not in_cgroup(p["cgroup"], cgroup)]
    if not listeners or strangers:
        problems.append(
            f"port {inst['port']} is not served by the unit's processes: "
            + (", ".join(f"PID {p['pid']}" for p in strangers) or "nobody listens")
        )
    evidence = process_evidence(inst, host.cmdline(pid), host.environ(pid), host.redactor.argv)
    res["argv"] = evidence["argv"]
    probe = probe_server(host, inst)
    res["health_status"] = probe.get("health_status")
    answered = not probe.get("unanswered") and probe.get("server_info_status") == 200
    if answered:
        evidence["server_info"] = probe["server_info"]
    found = differences(inst, evidence)
    if found["flag_diff"] is not None:
        problems.append("the running command line differs from the desired one")
        res["argv_diff"] = found["flag_diff"]
    if found["env"]:
        problems.append(f"environment differs: {sorted(found['env'])}")
    if probe.get("unanswered"):
        problems += probe["unanswered"]
    elif not answered:
        problems.append(f"/server_info answered {probe.get('server_info_status')}: {probe.get('server_info_error')}")
    else:
        if found["server_info"]:
            res["server_info_mismatches"] = found["server_info"]
            problems.append(describe_server_info(found["server_info"], "expected"))
        res["effective_max_running_requests"] = probe.get("effective_max_running_requests")
        res["version"] = probe["server_info"].get("version")
        minimum = req.get("min_max_running_requests")
        if minimum and (res["effective_max_running_requests"] or 0) < int(minimum):
            problems.append(
                f"effective max running requests {res['effective_max_running_requests']} "
                f"is below the asserted minimum {minimum}"
            )
    if not problems:
        smoke = smoke_requests(host, inst, int(req["smoke_requests"]), health_timeout, req)
        res["smoke"] = smoke
        if smoke["ok"] < smoke["sent"]:
            problems.append(
                f"{smoke['sent'] - smoke['ok']} of {smoke['sent']} smoke completions failed: {smoke['errors'][:2]}"
            )
    if problems:
        res["msg"] = "; ".join(problems)
        res["journal"] = host.journal(res.get("new_invocation_id", ""), inst["unit"], 20)
        return res
    res["healthy"] = True
    if req.get("record_last_good", True):
        record_last_good(host, inst)
        res["recorded_last_good"] = True
    return res


def smoke_requests(host: Host, inst: dict[str, Any], count: int, timeout: float, req: dict[str, Any]) -> dict[str, Any]:
    """A few real completions: /health alone passes while generation hangs (sglang#22779)."""
    sent, ok, errors = 0, 0, []
    for i in range(count):
        body = {
            "model": inst.get("served_model_name") or "default",
            "prompt": f"sglang-fleet health check {i}: the capital of France is",
            "max_tokens": int(req.get("smoke_max_tokens", 8)),
            "temperature": 0,
        }
        sent += 1
        status, text = host.http(instance_url(inst, "/v1/completions"), timeout, host.api_key, body)
        if status == 200:
            try:
                choices = json.loads(text).get("choices") or []
            except ValueError:
                choices = []
            if choices:
                ok += 1
                continue
        errors.append(f"status {status}: {host.redactor.text(clip(text, 200))}")
    return {"sent": sent, "ok": ok, "errors": errors}


def record_last_good(host: Host, inst: dict[str, Any]) -> None:
    """Keep ``inst``'s settings, with the unit file installed now, as its last good settings."""
    unit_path = host.service.definition_path(inst["unit"])
    host.state.write_last_good(inst, unit_path, host.file_state(unit_path).get("text", ""))


def op_record(req: dict[str, Any], host: Host) -> dict[str, Any]:
    """Record the last good settings of instances verified unchanged (first run after a deploy)."""
    for inst in req["instances"]:
        record_last_good(host, inst)
    return {"recorded": [i["name"] for i in req["instances"]]}
