# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The retune's decision for one instance: is it serving its desired settings (unchanged), or is it
to be relaunched, started, left alone because the evidence does not allow touching it (blocked),
or left alone and named because it is wedged while its settings are already the desired ones
(unhealthy); and the flag diff behind a relaunch, in words. Pure functions over the inspect
phase's facts.

A *wedged* instance is one whose own /health or /server_info did not answer within the deadline
(a scheduler stopped or stuck in a driver call) while the host's sources of evidence answered: what
it runs is still read from /proc (command line, environment, user), and its relaunch is proven on
the new process's endpoints, so it is healed like any other instance to relaunch. Only a broken
host-wide source of evidence blocks the host. A *stalled* instance answers both but holds requests
and processes no token (the agent's ``stall.py``): unhealthy in the same way, and treated the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.settings import (
    describe_server_info,
    differences,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.record import STALLED, UNCHANGED, UNHEALTHY

RELAUNCH_WEDGED_VAR = "sglang_retune_relaunch_wedged"


@dataclass
class Decision:
    name: str
    action: str  # UNCHANGED, "relaunch", "start", "blocked" or UNHEALTHY
    reasons: list[str] = field(default_factory=list)
    flag_diff: dict[str, Any] = field(default_factory=dict)
    # What did not answer, when the instance is wedged (its own endpoints hang), or why it is stalled
    # (it answers and produces nothing); empty otherwise.
    wedged: list[str] = field(default_factory=list)


def unhealthy_words(wedged: list[str]) -> str:
    """The reason a wedged or stalled instance is unhealthy: ``wedged: `` and what did not answer;
    a stall's verdict says ``stalled: `` itself."""
    hangs = [w for w in wedged if not w.startswith(STALLED)]
    return "; ".join(([f"wedged: {'; '.join(hangs)}"] if hangs else []) + [w for w in wedged if w.startswith(STALLED)])


def decide(instance: Mapping[str, Any], facts: Mapping[str, Any], check_mode: bool) -> Decision:
    """Is this instance serving its desired settings? Unchanged means running, healthy and
    reporting the desired settings itself (its command line, its environment, its own
    /server_info), not merely an unchanged unit file."""
    name = instance["name"]
    if facts.get("failed"):
        return Decision(name, "blocked", [f"no usable evidence: {facts.get('msg')}"])
    foreign = facts.get("foreign") or []
    if foreign:
        return Decision(
            name,
            "blocked",
            [
                "a process that is not this instance's holds its GPU or port: "
                + "; ".join(f"PID {p['pid']} ({p['cmdline']}) {p['reason']}" for p in foreign)
            ],
        )
    if not check_mode and facts.get("installed_fingerprint") != instance.get("fingerprint"):
        return Decision(
            name,
            "blocked",
            [
                "the desired state installed on the host does not match the inventory "
                f"(installed {facts.get('installed_fingerprint')}, inventory {instance.get('fingerprint')}): "
                "apply the server role first (retune.yml does)"
            ],
        )
    if not facts.get("running"):
        state = f"{facts.get('active_state') or 'unknown'}/{facts.get('sub_state') or 'unknown'}"
        return unless_evidence_broken(Decision(name, "start", [f"not running (unit {state})"]), facts)
    wedged = list(facts.get("unanswered") or [])
    if facts.get("stalled"):
        wedged.append(str(facts["stalled"]))
    reasons: list[str] = [unhealthy_words(wedged)] if wedged else []
    # The inspected facts are the running evidence: the host's verdicts on the command line and
    # environment it read (they hold secrets and never leave it), the user, and /server_info.
    answered = facts.get("server_info_status") == 200
    found = differences(instance, {**facts, "server_info": (facts.get("server_info") or {}) if answered else None})
    diff: dict[str, Any] = found["flag_diff"] or {}
    if facts.get("health_status") != 200 and not wedged:
        reasons.append(f"unhealthy: /health answered {facts.get('health_status') or facts.get('health_error')}")
    if found["flag_diff"] is not None:
        reasons.append("command line differs: " + describe_flag_diff(diff))
    if found["env"]:
        reasons.append(
            "environment differs: "
            + ", ".join(f"{k}={v['running']!r}→{v['expected']!r}" for k, v in found["env"].items())
        )
    if found["user"]:
        reasons.append(f"runs as {found['user']['running']}, desired {found['user']['expected']}")
    if not answered and not wedged:
        reasons.append(
            f"cannot confirm its settings: /server_info answered {facts.get('server_info_status')} "
            f"({facts.get('server_info_error')})"
        )
    elif found["server_info"]:
        reasons.append(describe_server_info(found["server_info"], "desired"))
    if wedged and len(reasons) == 1:
        # Its settings, read from /proc, are the desired ones: a relaunch would change nothing but
        # its health, which is the operator's call (the scheduler may be held on purpose).
        return unless_evidence_broken(
            Decision(
                name,
                UNHEALTHY,
                [
                    reasons[0] + ": its command line and environment (/proc) are the desired settings, so it is "
                    f"left as it is; to relaunch it, set {RELAUNCH_WEDGED_VAR}=true (or sglang_retune_force=true)"
                ],
                wedged=wedged,
            ),
            facts,
        )
    if reasons:
        return unless_evidence_broken(Decision(name, "relaunch", reasons, diff, wedged=wedged), facts)
    return Decision(name, UNCHANGED, [])


def unless_evidence_broken(decision: Decision, facts: Mapping[str, Any]) -> Decision:
    """An instance to stop or start is blocked, while it still serves, when a source of evidence
    the later proofs need (nvidia-smi, /proc, the unit's cgroup) did not answer correctly: once
    stopped it could not be proven dead or its GPU free, and would be left down."""
    errors = facts.get("evidence_errors") or []
    if not errors:
        return decision
    would = "be named unhealthy" if decision.action == UNHEALTHY else decision.action
    return Decision(
        decision.name,
        "blocked",
        [f"evidence the retune needs is broken, so nothing is stopped: {e.get('msg')}" for e in errors]
        + [f"(would {would}: {'; '.join(decision.reasons)})"],
        decision.flag_diff,
        wedged=decision.wedged,
    )


def flag_changes(diff: Mapping[str, Any], arrow: str = "→") -> str:
    """A flag diff in one line (``--flag old→new, +--added value, -removed``); empty if none."""
    parts = [f"{k} {v[0]}{arrow}{v[1]}" for k, v in diff.get("changed", {}).items()]
    parts += [f"+{k} {v}" if v is not True else f"+{k}" for k, v in diff.get("added", {}).items()]
    parts += [f"-{k}" for k in diff.get("removed", {})]
    return ", ".join(parts)


def describe_flag_diff(diff: Mapping[str, Any]) -> str:
    return flag_changes(diff) or "(same flags, other words)"
