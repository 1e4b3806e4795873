# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Operation ``apply``: converge the host's desired state (system user, directories, files,
daemon-reload, enable, start what is not running), never restarting a running instance."""

from __future__ import annotations

import grp
import json
import os
import pwd
from typing import Any

from .evidence import EvidenceError, run_cmd
from .host import Host
from .request import need
from .settings import process_evidence
from .state import load_json, owner_ids, sha256, write_atomic
from .supervision import identity
from .waiting import wait_until

# A deploy's wait for /health where the supervisor's start does not wait for it: the unit's own
# health wait's poll (sglang-fleet-wait-healthy), and each request's bound.
HEALTH_POLL = 1.0
HEALTH_TIMEOUT = 10.0


def op_apply(req: dict[str, Any], host: Host) -> dict[str, Any]:
    """Converge the host's desired state: system user, directories, files (units, desired-state
    records, helper scripts, the secrets file); daemon-reload when a unit changed; enable and
    start instances that are not running. Never restarts a running instance: relaunching is
    the retune plugin's job, with its checks.

    Each step reports what it would do in check mode (``check_mode``) and does it otherwise, and
    a file's diff is returned with ``diff`` (never a secret's): the contract of a builtin module.
    The first step that fails ends the run, saying what was done before it."""
    check = bool(req.get("check_mode"))
    start_timeout = float(need(req, "start_timeout"))
    result: dict[str, Any] = {"changed": False, "files": [], "actions": [], "started": []}
    for name in keep_running_as_last_good(req, host, check):
        _did(result, f"keep the settings {name} runs now as its last good settings")
    if req.get("user"):
        user = ensure_user(req["user"], check)
        result["actions"] += user["actions"]
        result["changed"] |= user["changed"]
    _converge_directories(req, check, result)
    unit_changed, failure = _converge_files(req, host, check, result)
    if failure is None and unit_changed:
        failure = _daemon_reload(host, check, result)
    if failure is None:
        failure = _enable_units(req, host, check, result)
    if failure is None:
        failure = _start_units(req, host, check, unit_changed, start_timeout, result)
    return failure or result


def _did(result: dict[str, Any], action: str) -> None:
    result["changed"] = True
    result["actions"].append(action)


def _converge_directories(req: dict[str, Any], check: bool, result: dict[str, Any]) -> None:
    """Each directory exists with its mode and owner (an existing one with another mode or owner
    is set to them, as the builtin file module does)."""
    for spec in req.get("directories", []):
        path = spec["path"]
        mode = int(spec.get("mode", "0755"), 8)
        ids = owner_ids(spec.get("owner", "root"), spec.get("group", "root"))
        if os.path.isdir(path):
            st = os.stat(path)
            if (st.st_mode & 0o7777, (st.st_uid, st.st_gid)) == (mode, ids):
                continue
            _did(result, f"set directory {path} to mode {mode:04o}, owner {spec.get('owner', 'root')}")
        else:
            _did(result, f"create directory {path}")
        if not check:
            os.makedirs(path, mode=mode, exist_ok=True)
            os.chown(path, *ids)
            os.chmod(path, mode)


def _converge_files(
    req: dict[str, Any], host: Host, check: bool, result: dict[str, Any]
) -> tuple[bool, dict[str, Any] | None]:
    """Each file's content, mode and owner; a changed unit is verified before it is written.
    Returns whether a unit (or drop-in) changed, and the failure if one was refused."""
    unit_changed = False
    for spec in req.get("files", []):
        path = spec["path"]
        content = spec["content"]
        mode = int(spec.get("mode", "0644"), 8)
        owner, group = spec.get("owner", "root"), spec.get("group", "root")
        secret = bool(spec.get("secret"))
        before = host.file_state(path)
        content_changed = not before["exists"] or before["sha256"] != sha256(content.encode())
        meta_changed = before["exists"] and (
            before["mode"] != mode or (before["uid"], before["gid"]) != owner_ids(owner, group)
        )
        entry: dict[str, Any] = {"path": path, "changed": bool(content_changed or meta_changed)}
        if content_changed and req.get("diff") and not secret:
            entry["diff"] = {
                "before_header": path,
                "after_header": path,
                "before": before.get("text", ""),
                "after": content,
            }
        if content_changed and host.service.is_definition(path) and spec.get("verify", True) and not secret:
            problem = host.service.verify(os.path.basename(path), content)
            if problem:
                return unit_changed, {"failed": True, "msg": problem, "files": result["files"]}
        if entry["changed"]:
            result["changed"] = True
            if host.service.is_definition(path):
                unit_changed = True
            if not check:
                write_atomic(path, content, mode, owner, group)
        result["files"].append(entry)
    return unit_changed, None


def _daemon_reload(host: Host, check: bool, result: dict[str, Any]) -> dict[str, Any] | None:
    result["actions"].append(host.service.reload_action)
    if not check:
        res = host.service.reload()
        if res["rc"] != 0:
            return {"failed": True, "msg": f"daemon-reload failed: {res}", **result}
    return None


def _enable_units(req: dict[str, Any], host: Host, check: bool, result: dict[str, Any]) -> dict[str, Any] | None:
    if not req.get("enable"):
        return None
    for unit in req.get("units", []):
        if host.service.is_enabled(unit):
            continue
        _did(result, f"enable {unit}")
        if not check:
            res = host.service.enable(unit)
            if res["rc"] != 0:
                return {"failed": True, "msg": f"enable {unit} failed: {res}", **result}
    return None


def _start_units(
    req: dict[str, Any], host: Host, check: bool, unit_changed: bool, timeout: float, result: dict[str, Any]
) -> dict[str, Any] | None:
    """Start the units that are not running (running ones are left alone); on a failed start,
    the journal tail of each unit that did not come up."""
    units = list(req.get("units", []))
    if not units or not req.get("start"):
        return None
    # In check mode once a unit changed, the state is not asked: every unit is reported as one to
    # start (an over-report for a running instance, which the real run leaves alone).
    state = host.units(units) if not unit_changed or not check else {}
    to_start = [u for u in units if state.get(u, {}).get("ActiveState") not in ("active", "activating", "reloading")]
    if not to_start:
        return None
    _did(result, "start " + " ".join(to_start))
    result["started"] = to_start
    if check:
        return None
    # A deploy asks for these starts: clear a start-rate limit left by earlier failures (the
    # unit's start guard still waits for free GPUs and port).
    host.service.reset_failed(to_start)
    # Blocks until each start has ended (on systemd, until the unit's ExecStartPost health wait
    # succeeds: TimeoutStartSec).
    t0 = host.monotonic()
    res = host.service.start(to_start, wait=True, timeout=timeout)
    if res["rc"] == 0 and not host.service.start_waits_for_health:
        res = _wait_healthy(host, to_start, dict(req.get("health_urls") or {}), t0 + timeout)
    if res["rc"] == 0:
        return None
    host.load_secrets()  # this run may just have written the secrets file
    after = host.units(to_start)
    tails = {
        u: host.journal(after[u].get("InvocationID", ""), u, 25)
        for u in to_start
        if after[u].get("ActiveState") != "active"
    }
    return {
        "failed": True,
        "msg": f"starting {' '.join(to_start)} failed: rc={res['rc']} {res['stderr'].strip()}",
        "journal": tails,
        **result,
    }


def _wait_healthy(host: Host, units: list[str], urls: dict[str, str], deadline: float) -> dict[str, Any]:
    """Wait until each started unit's server answers /health 200 (a supervisor whose start does
    not wait for it), or one of them fails, or the deadline passes: an outcome like the start's."""
    pending = [u for u in units if urls.get(u)]
    failed: list[str] = []

    def done() -> bool:
        states = host.units(pending)
        for unit in list(pending):
            if states[unit].get("ActiveState") == "failed":
                failed.append(unit)
                pending.remove(unit)
            elif host.http(urls[unit], HEALTH_TIMEOUT)[0] == 200:
                pending.remove(unit)
        return not pending

    wait_until(done, deadline, HEALTH_POLL, host.monotonic, host.sleep)
    bad = failed + pending
    why = ", ".join([*(f"{u} failed" for u in failed), *(f"{u} not healthy in time" for u in pending)])
    return {"cmd": "wait for /health of " + " ".join(units), "rc": 1 if bad else 0, "stdout": "", "stderr": why}


def keep_running_as_last_good(req: dict[str, Any], host: Host, check: bool) -> list[str]:
    """Before new settings overwrite an instance's unit, keep the settings it runs now as its last
    good settings if none are recorded yet (the first change after a deploy), so that a retune
    whose new settings fail has something to roll back to. Kept only on evidence that the old
    unit is what runs: the unit is active (its start waited for /health), and its main process
    has the command line and environment of the installed desired-settings record."""
    specs = {spec["path"]: spec for spec in req.get("files", [])}
    kept = []
    for path, spec in specs.items():
        if not host.state.is_desired_path(path):
            continue
        try:
            new = json.loads(spec["content"])
        except ValueError:
            continue
        name, unit = new.get("name"), new.get("unit")
        if not isinstance(name, str) or not isinstance(unit, str):
            continue
        unit_path = host.service.definition_path(unit)
        unit_spec = specs.get(unit_path)
        before = host.file_state(unit_path)
        if unit_spec is None or not before["exists"] or before["sha256"] == sha256(unit_spec["content"].encode()):
            continue  # no unit yet, or it is not about to change
        old = load_json(path)
        if host.state.has_last_good(name) or not old or old.get("name") != name or not old.get("argv"):
            continue
        state = host.units([unit]).get(unit, {})
        pid = identity(state)["main_pid"]
        if state.get("ActiveState") != "active" or pid <= 0:
            continue
        running = process_evidence(old, host.cmdline(pid), host.environ(pid), host.redactor.argv)
        if not running["argv_matches"] or running["env_mismatches"]:
            continue
        kept.append(name)
        if not check:
            host.state.write_last_good(dict(old, unit=unit), unit_path, before.get("text", ""))
    return kept


def ensure_user(spec: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    """A system user for the servers, in the groups that may open /dev/nvidia* (those that
    exist here)."""
    name = spec["name"]
    groups = [g for g in spec.get("groups", []) if _group_exists(g)]
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        entry = None
    changed = False
    actions: list[str] = []
    if entry is None:
        changed = True
        actions.append(f"create system user {name}")
        if not check_mode:
            argv = [
                "useradd",
                "--system",
                "--user-group",
                "--home-dir",
                spec["home"],
                "--create-home",
                "--shell",
                "/usr/sbin/nologin",
            ]
            if groups:
                argv += ["--groups", ",".join(groups)]
            rc, out, err = run_cmd([*argv, name])
            if rc != 0:
                raise EvidenceError(f"create user {name}", [*argv, name], rc, out, err)
    else:
        missing = [g for g in groups if name not in grp.getgrnam(g).gr_mem and grp.getgrnam(g).gr_gid != entry.pw_gid]
        if missing:
            changed = True
            actions.append(f"add {name} to groups {','.join(missing)}")
            if not check_mode:
                argv = ["usermod", "--append", "--groups", ",".join(missing), name]
                rc, out, err = run_cmd(argv)
                if rc != 0:
                    raise EvidenceError(f"add {name} to groups", argv, rc, out, err)
    return {"changed": changed, "actions": actions}


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True
