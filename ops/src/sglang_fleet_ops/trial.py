"""``advise --trial``: try the advisor's proposal for one group on ONE canary instance, measure it
against the untouched instances of the same group, and keep it or put the canary back.

1. ``playbooks/advise.yml`` (the report: groups of instances with one diagnosis and proposal);
2. ``retune.yml`` limited to the canary's host, ``sglang_retune_only`` naming the canary, and the
   host's ``sglang_server_instances`` as extra vars with the proposal in the canary's own ``args``
   (instance args win over the host's; the other instances' entries are the inventory's), so only
   the canary is relaunched - with the retune's proofs and its rollback on failure;
3. ``playbooks/advise.yml`` again, limited to the group's hosts, over the window: the canary's
   generation throughput (``rate(sglang:generation_tokens_total)``, else ``sglang:gen_throughput``)
   against the untouched instances' mean (or, in a group of one, against the canary's own before);
4. kept when the gain reaches the threshold (default x1.10), else ``retune.yml`` again for the
   canary without the override: it runs the inventory's settings - its previous ones - again.

Nothing is written to the inventory here: a kept trial says to copy the patch and retune the rest,
or, with ``--propose``, the CLI writes it into the inventory on a branch (proposal_git.py).
The orchestration takes the two playbook runs as callables (unit-tested with fakes), in named steps:
first_report, choose (then the caller's ``before_touch``), apply_to_canary, measure, decide.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

FORMAT = 1
DEFAULT_THRESHOLD = 1.10

# (limit, window) -> build_advice(...) of an advise.yml run
AdviseRun = Callable[[str | None, float | None], dict[str, Any]]
# (limit, extravars, ident) -> apply.build_outcome(...) of a retune.yml run
RetuneRun = Callable[[str, dict[str, Any], str], dict[str, Any]]


class TrialError(Exception):
    pass


def choose_group(report: Mapping[str, Any], group: int | None = None, canary: str | None = None) -> dict[str, Any]:
    """The group tried: ``group`` (1-based, in the report's order), else the canary's group, else
    the first whose proposal changes server settings."""
    groups = [dict(g) for g in report.get("groups") or []]
    chosen: dict[str, Any] | None = None
    if group is not None:
        if not 1 <= group <= len(groups):
            raise TrialError(f"--group {group}: the report has {len(groups)} group(s)")
        chosen, what = groups[group - 1], f"group {group}"
    elif canary is not None:
        chosen = next((g for g in groups if canary in (g.get("instances") or [])), None)
        if chosen is None:
            raise TrialError(f"--canary {canary}: the report has no such instance")
        what = f"the group of {canary}"
    if chosen is not None:
        if not (chosen.get("proposal") or {}).get("changes"):
            raise TrialError(f"{what} ({chosen.get('label')}, {chosen.get('diagnosis')}) has no server settings to try")
        return chosen
    for candidate in groups:
        if (candidate.get("proposal") or {}).get("changes"):
            return candidate
    raise TrialError("no group of instances has a proposal that changes server settings: nothing to try")


def split_key(key: str) -> tuple[str, str]:
    host, _, name = key.rpartition("/")
    if not host or not name:
        raise TrialError(f"{key!r} is not host/instance")
    return host, name


def choose_canary(group: Mapping[str, Any], canary: str | None = None) -> str:
    members = [str(m) for m in group.get("instances") or []]
    if canary is not None:
        if canary not in members:
            raise TrialError(f"--canary {canary} is not in the group tried ({', '.join(members)})")
        return canary
    if not members:
        raise TrialError("the group tried has no instance")
    return members[0]


def trial_extravars(report: Mapping[str, Any], canary: str) -> dict[str, Any]:
    """retune.yml's extra vars that relaunch the canary alone with the proposal as its own args:
    the host's ``sglang_server_instances`` as the report has them, the canary's ``args`` replaced
    by its ``args_after`` (its args with the proposal, as the advisor's patch writes them)."""
    host, name = split_key(canary)
    layout = (report.get("layouts") or {}).get(host)
    if not layout:
        raise TrialError(f"the report has no instance layout of host {host} (advise.yml of this collection writes it)")
    entries = copy.deepcopy([dict(e) for e in layout])
    found = [e for e in entries if str(e.get("name")) == name]
    if not found:
        raise TrialError(f"host {host} has no instance {name} in its layout")
    after = _items(report).get(canary, {}).get("args_after")
    if not isinstance(after, Mapping):
        raise TrialError(f"the report has no args with the proposal for {canary}")
    found[0]["args"] = dict(after)
    return {"sglang_server_instances": entries, "sglang_retune_only": [name]}


def revert_extravars(canary: str) -> dict[str, Any]:
    """retune.yml's extra vars that put the canary back on the inventory's (its previous) settings."""
    return {"sglang_retune_only": [split_key(canary)[1]]}


def throughput(item: Mapping[str, Any] | None) -> float | None:
    """Generation tokens per second over the window: the counter's rate, else the gauge's mean."""
    stats = (item or {}).get("stats") or {}
    for key in ("generation_rate", "gen_throughput_mean"):
        value = stats.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _items(report: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {f"{i.get('host')}/{i.get('name')}": dict(i) for i in (report or {}).get("instances") or []}


def _instance_result(outcome: Mapping[str, Any], canary: str) -> dict[str, Any]:
    host, name = split_key(canary)
    for inst in ((outcome.get("hosts") or {}).get(host) or {}).get("instances") or []:
        if str(inst.get("name")) == name:
            return dict(inst)
    return {}


def _retune_ok(outcome: Mapping[str, Any], canary: str, actions: Sequence[str]) -> tuple[bool, dict[str, Any]]:
    inst = _instance_result(outcome, canary)
    return (not outcome.get("problems") and inst.get("action") in actions), inst


# (report, trial so far) -> None, or TrialError: the caller's own checks once the group and the
# canary are chosen, before anything is touched (advise --trial --propose: the fleet repository).
BeforeTouch = Callable[[Mapping[str, Any], Mapping[str, Any]], None]


def run_trial(
    advise_run: AdviseRun,
    retune_run: RetuneRun,
    *,
    window: float | None = None,
    group: int | None = None,
    canary: str | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    settle: float = 0.0,
    sleep: Callable[[float], None] = time.sleep,
    before_touch: BeforeTouch | None = None,
) -> dict[str, Any]:
    """The trial, start to end; ``decision`` is kept, reverted or failed (with ``problems``)."""
    out = new_trial(threshold)
    report = first_report(out, advise_run, window)
    if report is None:
        return out
    try:
        chosen, key, extravars = choose(out, report, group, canary)
        if before_touch is not None:
            before_touch(report, out)
    except TrialError as exc:
        out["problems"].append(str(exc))
        return out
    host, _name = split_key(key)
    if not apply_to_canary(out, retune_run, key, extravars):
        # The host's desired state (units, records) back to the inventory's, the canary with it.
        _revert(out, retune_run, host, key)
        return out
    if settle > 0:
        sleep(settle)
    measure(out, advise_run, chosen, key, window)
    if decide(out) == "kept":
        out["decision"] = "kept"
        return out
    if _revert(out, retune_run, host, key):
        out["decision"] = "reverted"
    return out


def new_trial(threshold: float) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "decision": "failed",
        "threshold": threshold,
        "group": None,
        "canary": None,
        "changes": {},
        "before": {},
        "after": {},
        "gain": None,
        "retune": None,
        "revert": None,
        "problems": [],
    }


def first_report(out: dict[str, Any], advise_run: AdviseRun, window: float | None) -> dict[str, Any] | None:
    """The advice over the whole fleet (the proposal tried, the throughput before), or None."""
    first = advise_run(None, window)
    report = first.get("report")
    if not report:
        out["problems"] += list(first.get("problems") or []) or ["no advice"]
        return None
    return dict(report)


def choose(
    out: dict[str, Any], report: Mapping[str, Any], group: int | None, canary: str | None
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """The group, its canary and retune.yml's extra vars; the trial's record of them and of the
    throughput before. TrialError when the report has nothing to try."""
    chosen = choose_group(report, group, canary)
    key = choose_canary(chosen, canary)
    changes = dict(chosen["proposal"]["changes"])
    extravars = trial_extravars(report, key)
    out.update(
        group={
            "label": chosen.get("label"),
            "diagnosis": chosen.get("diagnosis"),
            "instances": chosen.get("instances"),
        },
        canary=key,
        changes=changes,
        predicted={
            k: chosen["proposal"].get(k)
            for k in (
                "effective_max_before",
                "effective_max_after",
                "throughput_factor",
                "throughput_factor_expected",
                "throughput_model",
            )
            if k in chosen["proposal"]
        },
    )
    items = _items(report)
    out["before"] = {
        "canary": throughput(items.get(key)),
        "others": {m: throughput(items.get(m)) for m in _others(chosen, key)},
    }
    return chosen, key, extravars


def _others(chosen: Mapping[str, Any], key: str) -> list[str]:
    return [m for m in chosen.get("instances") or [] if m != key]


def apply_to_canary(out: dict[str, Any], retune_run: RetuneRun, key: str, extravars: dict[str, Any]) -> bool:
    """retune.yml relaunches the canary alone with the proposal; False when it did not."""
    applied = retune_run(split_key(key)[0], extravars, "trial-apply")
    ok, inst = _retune_ok(applied, key, ("relaunched", "unchanged"))
    out["retune"] = {
        "action": inst.get("action"),
        "effective_max_running_requests_before": inst.get("effective_max_running_requests_before"),
        "effective_max_running_requests_after": inst.get("effective_max_running_requests_after"),
        "msg": inst.get("msg"),
    }
    if not ok:
        out["problems"] += list(applied.get("problems") or []) or [f"{key}: retune: {inst.get('action')}"]
        out["problems"].append("the proposal was not applied to the canary (the retune rolls back a failed relaunch)")
    return ok


def measure(
    out: dict[str, Any], advise_run: AdviseRun, chosen: Mapping[str, Any], key: str, window: float | None
) -> None:
    """The group's hosts over the window: the canary against the untouched instances' mean (or, in
    a group of one, against the canary's own throughput before)."""
    others = _others(chosen, key)
    hosts = sorted({split_key(m)[0] for m in chosen.get("instances") or []})
    second = advise_run(",".join(hosts), window)
    after_items = _items(second.get("report"))
    canary_after = throughput(after_items.get(key))
    others_after = {m: throughput(after_items.get(m)) for m in others}
    measured = [v for v in others_after.values() if v is not None]
    baseline = sum(measured) / len(measured) if measured else None
    baseline_of = "the untouched instances' mean"
    if baseline is None and not others:
        baseline, baseline_of = out["before"]["canary"], "the canary itself before the change"
    out["after"] = {"canary": canary_after, "others": others_after, "baseline": baseline, "baseline_of": baseline_of}
    if canary_after is None or not baseline:
        out["problems"].append(
            f"no throughput to compare (canary {canary_after}, {baseline_of} {baseline}): "
            + "; ".join(second.get("problems") or [])
        )


def decide(out: dict[str, Any]) -> str:
    """kept when the measured gain reaches the threshold, else reverted (no figure: reverted)."""
    canary_after, baseline = out["after"].get("canary"), out["after"].get("baseline")
    if canary_after is None or not baseline:
        return "reverted"
    out["gain"] = round(canary_after / baseline, 4)
    return "kept" if out["gain"] >= out["threshold"] else "reverted"


def _revert(out: dict[str, Any], retune_run: RetuneRun, host: str, key: str) -> bool:
    """retune.yml for the canary without the override: the inventory's (its previous) settings."""
    reverted = retune_run(host, revert_extravars(key), "trial-revert")
    ok, inst = _retune_ok(reverted, key, ("relaunched", "unchanged"))
    out["revert"] = {
        "action": inst.get("action"),
        "effective_max_running_requests_after": inst.get("effective_max_running_requests_after"),
        "msg": inst.get("msg"),
    }
    if not ok:
        out["problems"] += list(reverted.get("problems") or []) or [f"{key}: revert: {inst.get('action')}"]
        out["problems"].append(f"the canary {key} could NOT be put back on its previous settings")
    return ok


def _tput(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} tok/s"


def trial_text(trial: Mapping[str, Any]) -> str:
    lines = []
    group = trial.get("group") or {}
    if group:
        lines.append(f"trial: {group.get('label')} ({group.get('diagnosis')}), canary {trial.get('canary')}")
    else:
        lines.append("trial: no group tried")
    changes = trial.get("changes") or {}
    if changes:
        words = "; ".join(
            f"{k}: {'unset' if v[0] is None else v[0]} -> {'unset' if v[1] is None else v[1]}"
            for k, v in changes.items()
        )
        lines.append(f"  applied to the canary only: {words}")
    retune = trial.get("retune") or {}
    if retune:
        before_max = retune.get("effective_max_running_requests_before")
        after_max = retune.get("effective_max_running_requests_after")
        lines.append(
            f"  retune: {retune.get('action')}, effective max running requests {before_max} -> {after_max}"
            + (f" (predicted {trial['predicted'].get('effective_max_after')})" if trial.get("predicted") else "")
        )
    before, after = trial.get("before") or {}, trial.get("after") or {}
    if before:
        others = ", ".join(f"{k} {_tput(v)}" for k, v in (before.get("others") or {}).items())
        lines.append(f"  before: canary {_tput(before.get('canary'))}" + (f"; untouched {others}" if others else ""))
    if after:
        others = ", ".join(f"{k} {_tput(v)}" for k, v in (after.get("others") or {}).items())
        lines.append(
            f"  after: canary {_tput(after.get('canary'))}; {after.get('baseline_of')} {_tput(after.get('baseline'))}"
            + (f" ({others})" if others else "")
        )
    threshold = float(trial.get("threshold") or DEFAULT_THRESHOLD)
    if trial.get("gain") is not None:
        sign = ">=" if trial["gain"] >= threshold else "<"
        expected = (trial.get("predicted") or {}).get("throughput_factor_expected")
        method = ((trial.get("predicted") or {}).get("throughput_model") or {}).get("method")
        lines.append(
            f"  gain x{trial['gain']:.2f} {sign} x{threshold:.2f}"
            + (f" (predicted x{expected:.2f}" + (f", {method}" if method else "") + ")" if expected else "")
        )
    decision = str(trial.get("decision"))
    if decision == "kept":
        lines.append(
            "  KEPT: the canary keeps the new settings (an extra-vars override, not in the inventory): "
            "copy the patch into the inventory and run retune.yml for the rest"
        )
    elif decision == "reverted":
        lines.append("  REVERTED: the canary runs its previous settings (the inventory's) again")
    else:
        lines.append("  FAILED")
    lines += [f"  problem: {p}" for p in trial.get("problems") or []]
    return "\n".join(lines) + "\n"


def trial_exit(trial: Mapping[str, Any]) -> int:
    """0 kept or reverted as planned, 1 failed (or a revert that did not happen)."""
    return 0 if trial.get("decision") in ("kept", "reverted") and not _revert_failed(trial) else 1


def _revert_failed(trial: Mapping[str, Any]) -> bool:
    return any("could NOT be put back" in str(p) for p in trial.get("problems") or [])
