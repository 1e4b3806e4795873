"""The fleet's status from the events of ``playbooks/status.yml`` (read-only).

Per instance: the inspection (``sglang_ops.fleet.retune_phase`` op=inspect: unit state, main
PID, /health, /server_info, GPU memory), the retune's check (unchanged or not), the age of the
main process (``ps -o etimes``), the instance's /metrics when it exports them (else
/server_info's internal_states). Per generation client unit: its state and its status file.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

from .events import PHASE, RETUNE, VALIDATE, HostView, by_host
from .runner import Run

UPTIME_TASK = "Read how long each main process has run (seconds, from its /proc start time)"
METRICS_TASK = "Read the metrics of each instance that exports them (on the host itself)"
CLIENTS_TASK = "Find the generation clients"
CLIENT_FILES_TASK = "Read the status file of each generation client"

METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
METRICS = {
    "running_requests": "sglang:num_running_reqs",
    "queued_requests": "sglang:num_queue_reqs",
    "token_usage": "sglang:token_usage",
    "full_token_usage": "sglang:full_token_usage",
    "mamba_usage": "sglang:mamba_usage",
    "gen_throughput_tok_s": "sglang:gen_throughput",
}


def parse_metrics(text: str) -> dict[str, float]:
    """The gauges we show, each the largest value over the instance's series (ranks)."""
    wanted = {v: k for k, v in METRICS.items()}
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = METRIC_LINE.match(line)
        if not match or match.group(1) not in wanted:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        key = wanted[match.group(1)]
        out[key] = max(out.get(key, value), value)
    # The KV cache's usage: sglang:full_token_usage from SGLang 0.5.14 on, where token_usage is the
    # fullest of the KV, SWA and Mamba pools; 0.5.9 has only token_usage, the KV cache's.
    kv = out.get("full_token_usage", out.get("token_usage"))
    if kv is not None:
        out["kv_usage"] = kv
    return out


def _uptimes(view: HostView) -> dict[int, int]:
    result = next((r for r in reversed(view.results) if r.task == UPTIME_TASK and r.ok), None)
    out: dict[int, int] = {}
    for item in result.items() if result else []:
        for line in str(item.get("stdout") or "").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                out[int(parts[0])] = int(parts[1])
    return out


def _metrics(view: HostView) -> dict[str, dict[str, Any]]:
    result = next((r for r in reversed(view.results) if r.task == METRICS_TASK and r.ok), None)
    out: dict[str, dict[str, Any]] = {}
    for item in result.items() if result else []:
        inst = item.get("instance") or {}
        if item.get("skipped") or not isinstance(inst, dict):
            continue
        if item.get("status") == 200 and isinstance(item.get("content"), str):
            out[str(inst.get("name"))] = {"source": "metrics", **parse_metrics(item["content"])}
        else:
            out[str(inst.get("name"))] = {"metrics_error": f"/metrics answered {item.get('status')}: {item.get('msg')}"}
    return out


def _clients(view: HostView) -> list[dict[str, Any]]:
    query = next((r for r in reversed(view.results) if r.task == CLIENTS_TASK and r.ok), None)
    files = next((r for r in reversed(view.results) if r.task == CLIENT_FILES_TASK and r.ok), None)
    status_by_unit: dict[str, dict[str, Any]] = {}
    for item in files.items() if files else []:
        unit = str((item.get("item") or {}).get("item") or "")
        if item.get("skipped"):
            continue
        if item.get("content") and not item.get("failed"):
            try:
                status_by_unit[unit] = json.loads(base64.b64decode(item["content"]))
            except ValueError as exc:
                status_by_unit[unit] = {"error": f"status file unreadable: {exc}"}
        else:
            status_by_unit[unit] = {"error": str(item.get("msg") or "no status file")}
    out = []
    for item in query.items() if query else []:
        props = dict(line.split("=", 1) for line in str(item.get("stdout") or "").splitlines() if "=" in line)
        if props.get("LoadState") != "loaded":
            continue
        unit = str(item.get("item") or props.get("Id"))
        status = status_by_unit.get(unit, {})
        out.append(
            {
                "unit": unit,
                "active_state": props.get("ActiveState"),
                "sub_state": props.get("SubState"),
                "state": status.get("state"),
                "done": status.get("done"),
                "total": status.get("total"),
                "requests_per_s": status.get("requests_per_s"),
                "completion_tokens_per_s": status.get("completion_tokens_per_s"),
                "eta_s": status.get("eta_s"),
                "error": status.get("error"),
                # Endpoints that accept requests and complete none (the client routes around them):
                # URL -> why. The instance behind one needs a relaunch (retune.yml heals it).
                "stalled": dict(status.get("stalled") or {}),
                # Endpoints it took out of service (the server refused its API key or the path):
                # URL -> why. Nothing is sent there until a retune hands it a new key.
                "disabled": dict(status.get("disabled") or {}),
            }
        )
    return out


def host_status(view: HostView) -> dict[str, Any]:
    entry: dict[str, Any] = {"status": "ok", "msg": "", "instances": [], "clients": []}
    validated = view.last(VALIDATE)
    inspected = view.last(PHASE)
    check = view.last(RETUNE)
    unreachable = view.unreachable()
    failures = [r for r in view.failures() if not r.is_action(RETUNE)]
    if unreachable is not None:
        return {**entry, "status": "unreachable", "msg": f"{unreachable.task}: {unreachable.msg()}"}
    if failures:
        entry.update(status="failed", msg="; ".join(f"{f.task}: {f.msg()}" for f in failures))
    if validated is None or not validated.ok:
        entry.update(status="failed", msg=entry["msg"] or "no validation result")
        return entry
    if inspected is None:
        entry.update(status="failed", msg=entry["msg"] or "no inspection result")
    facts = (inspected.res.get("instances") if inspected else None) or {}
    containers = (inspected.res.get("containers") if inspected else None) or {}
    verdicts = {str(i.get("name")): i for i in (check.res.get("instances") if check else None) or []}
    uptimes = _uptimes(view)
    metrics = _metrics(view)
    for inst in validated.res.get("instances") or []:
        name = str(inst.get("name"))
        fact = facts.get(name) or {}
        place = "host" if inst.get("container") is None else str(inst.get("container"))
        gpu_table = (containers.get(place) or {}).get("gpus") or {}
        verdict = verdicts.get(name) or {}
        states = ((fact.get("server_info") or {}).get("internal_states") or [{}])[0] or {}
        usage = dict(metrics.get(name) or {})
        if "source" not in usage and fact.get("server_info"):
            usage.update(
                source="server_info",
                gen_throughput_tok_s=states.get("last_gen_throughput"),
                memory_usage_gib=states.get("memory_usage"),
            )
        pid = int(fact.get("main_pid") or 0)
        desired_fp = inst.get("fingerprint")
        row = {
            "name": name,
            "unit": inst.get("unit"),
            "port": inst.get("port"),
            "active_state": fact.get("active_state"),
            "sub_state": fact.get("sub_state"),
            "running": bool(fact.get("running")),
            "main_pid": pid or None,
            "uptime_s": uptimes.get(pid) if pid else None,
            "health": fact.get("health_status"),
            "installed_fingerprint": fact.get("installed_fingerprint"),
            "desired_fingerprint": desired_fp,
            "installed_is_desired": fact.get("installed_fingerprint") == desired_fp,
            "serves_desired": verdict.get("action") == "unchanged",
            "check": verdict.get("action"),
            "reasons": verdict.get("reasons") or ([str(fact.get("msg"))] if fact.get("failed") else []),
            "effective_max_running_requests": fact.get("effective_max_running_requests"),
            "running_requests": usage.get("running_requests"),
            "queued_requests": usage.get("queued_requests"),
            "kv_usage": usage.get("kv_usage"),
            "token_usage": usage.get("token_usage"),
            "mamba_usage": usage.get("mamba_usage"),
            "gen_throughput_tok_s": usage.get("gen_throughput_tok_s"),
            "memory_usage_gib": usage.get("memory_usage_gib"),
            "usage_source": usage.get("source"),
            "metrics_error": usage.get("metrics_error"),
            "gpus": {
                str(g): {
                    "used_mib": (gpu_table.get(str(g)) or {}).get("used_mib"),
                    "total_mib": (gpu_table.get(str(g)) or {}).get("total_mib"),
                }
                for g in inst.get("gpus") or []
            },
        }
        row["ok"] = bool(row["running"] and row["health"] == 200 and row["serves_desired"])
        entry["instances"].append(row)
    entry["clients"] = _clients(view)
    return entry


def build_status(run: Run) -> dict[str, Any]:
    hosts = {name: host_status(view) for name, view in sorted(by_host(run.events).items()) if name}
    problems = [f"{h}: {e['status']}: {e['msg']}" for h, e in hosts.items() if e["status"] != "ok"]
    if not hosts:
        problems.append(f"the run reached no host (rc {run.rc}, {run.status})")
    elif run.rc != 0 and not problems:
        problems.append(f"ansible-playbook ended with rc {run.rc} ({run.status}) and no failed task was recorded")
    not_ok = [f"{h}/{i['name']}" for h, e in hosts.items() for i in e["instances"] if not i["ok"]]
    not_ok += [
        f"{h}/{c['unit']}: endpoint {url} stalled"
        for h, e in hosts.items()
        for c in e["clients"]
        for url in c["stalled"]
    ]
    not_ok += [
        f"{h}/{c['unit']}: endpoint {url} taken out of service"
        for h, e in hosts.items()
        for c in e["clients"]
        for url in c["disabled"]
    ]
    return {"hosts": hosts, "problems": problems, "not_ok": not_ok}


def status_exit(status: dict[str, Any]) -> int:
    """0 every instance running, healthy and serving its desired settings (and no generation client
    has an endpoint stalled or taken out of service); 2 otherwise; 1 error."""
    if status["problems"]:
        return 1
    return 2 if status["not_ok"] else 0


def _num(value: Any, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value) if isinstance(value, int | float) else str(value)


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "-"
    s = int(seconds)
    return f"{s // 86400}d{s % 86400 // 3600:02d}h" if s >= 86400 else f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def status_table(status: dict[str, Any]) -> str:
    header = (
        "host/instance", "unit", "pid", "uptime", "health", "settings", "run/queue/max",
        "KV", "mamba", "gen tok/s", "GPU MiB",
    )  # fmt: skip
    rows = [header]
    for host, entry in status["hosts"].items():
        if not entry["instances"]:
            rows.append((host, entry["status"], "", "", "", "", "", "", "", "", _short(entry["msg"])))
        for i in entry["instances"]:
            gpus = " ".join(f"{_num(g['used_mib'])}/{_num(g['total_mib'])}" for g in i["gpus"].values())
            settings = "desired" if i["serves_desired"] else (i["check"] or "unknown")
            rows.append(
                (
                    f"{host}/{i['name']}",
                    f"{i['active_state'] or '?'}/{i['sub_state'] or '?'}",
                    _num(i["main_pid"]),
                    _duration(i["uptime_s"]),
                    _num(i["health"]),
                    settings,
                    f"{_num(i['running_requests'])}/{_num(i['queued_requests'])}/"
                    f"{_num(i['effective_max_running_requests'])}",
                    _num(i["kv_usage"], "{:.2f}"),
                    _num(i["mamba_usage"], "{:.2f}"),
                    _num(i["gen_throughput_tok_s"], "{:.1f}"),
                    gpus,
                )
            )
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(header))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    for host, entry in status["hosts"].items():
        for c in entry["clients"]:
            progress = f"{_num(c['done'])}/{_num(c['total'])}" if c["total"] is not None else "-"
            lines.append(
                f"client {host}/{c['unit']}: {c['active_state']}/{c['sub_state']} state {c['state'] or '-'} "
                f"progress {progress} rate {_num(c['requests_per_s'], '{:.2f}')} req/s "
                f"ETA {_duration(c['eta_s'])}" + (f" ({c['error']})" if c["error"] else "")
            )
            lines += [f"  STALLED {url}: {why}" for url, why in c["stalled"].items()]
            lines += [f"  OUT OF SERVICE {url}: {why}" for url, why in c["disabled"].items()]
    for problem in status["problems"]:
        lines.append(f"ERROR {problem}")
    for name in status["not_ok"]:
        lines.append(f"NOT OK {name}")
    return "\n".join(lines) + "\n"


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
