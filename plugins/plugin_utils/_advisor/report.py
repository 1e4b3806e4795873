"""The advisor's fleet report: the instances grouped by identical settings, diagnosis and
proposal, and its text for people.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.patch import build_patch, instance_args_after
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.vocabulary import (
    COMPUTE_BOUND,
    DIAGNOSES,
    UNKNOWN,
    fmt,
    instance_names,
    yaml_scalar,
)


def _group_key(a: Mapping[str, Any]) -> str:
    prop = a.get("proposal") or {}
    return json.dumps(
        [
            a.get("release"),
            a.get("settings"),
            a.get("diagnosis"),
            prop.get("changes"),
            prop.get("client_changes"),
        ],
        sort_keys=True,
        default=str,
    )


def fleet_report(
    advices: Iterable[Mapping[str, Any]],
    inventory: Mapping[str, Mapping[str, Any]] | None = None,
    meta: Mapping[str, Any] | None = None,
    host_problems: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The fleet's advice: the instances grouped by identical settings, diagnosis and proposal,
    and the inventory patch (:mod:`_advisor.patch`).

    ``inventory`` maps each host to its layers: ``sglang_server_host_args``, ``sglang_server_args``
    (the group's) and ``instances`` (its ``sglang_server_instances`` entries, each with its own
    ``args``: the one copy of them). Each instance with a server change
    gets ``args_after``: its own args with the proposal (``advise --trial``'s canary override), and
    the report keeps each host's entries as ``layouts``.
    """
    inventory = inventory or {}
    items = [dict(a) for a in advices]
    for a in items:
        after = instance_args_after(a, inventory.get(str(a.get("host"))) or {})
        if after is not None:
            a["args_after"] = after
    groups: dict[str, list[dict[str, Any]]] = {}
    for a in items:
        groups.setdefault(_group_key(a), []).append(a)
    out_groups = []
    for members in groups.values():
        first = members[0]
        out_groups.append(
            {
                "instances": [f"{m['host']}/{m['name']}" for m in members],
                "label": instance_names(members),
                "release": first.get("release"),
                "diagnosis": first.get("diagnosis"),
                "why": first.get("why"),
                "proposal": first.get("proposal"),
                "alternatives": first.get("alternatives") or [],
                "problems": sorted({p for m in members for p in m.get("problems") or []}),
            }
        )
    out_groups.sort(key=lambda g: (DIAGNOSES.index(g["diagnosis"]) if g["diagnosis"] in DIAGNOSES else 99, g["label"]))
    patch, patch_notes = build_patch(items, inventory)
    counts: dict[str, int] = {}
    for a in items:
        counts[a["diagnosis"]] = counts.get(a["diagnosis"], 0) + 1
    return {
        "format": 1,
        **dict(meta or {}),
        "diagnoses": counts,
        "groups": out_groups,
        "instances": items,
        "patch": patch,
        "patch_notes": patch_notes,
        "host_problems": dict(host_problems or {}),
        "layouts": {host: list(layers.get("instances") or []) for host, layers in inventory.items()},
        "advice_produced": bool(items),
    }


def _change_words(changes: Mapping[str, Sequence[Any]]) -> list[str]:
    return [
        f"{key}: {'unset' if old is None else yaml_scalar(old)} -> {yaml_scalar(new)}"
        for key, (old, new) in changes.items()
    ]


def _factor_words(prop: Mapping[str, Any]) -> str:
    """``x2.05 expected (x2.81 at most)``, or ``x2.81`` without an expected factor."""
    factor, expected = prop.get("throughput_factor") or 0.0, prop.get("throughput_factor_expected")
    return f"x{factor:.2f}" if expected is None else f"x{expected:.2f} expected (x{factor:.2f} at most)"


def _throughput_words(prop: Mapping[str, Any]) -> str:
    """``throughput x2.17 expected, x3.15 at most (778 -> ~1688, at most 2450 tok/s per instance)``"""
    factor, expected, before = (
        prop["throughput_factor"],
        prop.get("throughput_factor_expected"),
        prop.get("throughput_before"),
    )
    model = prop.get("throughput_model") or {}
    how = {"window": " (the window's step times)", "measurement": " (the measured step times)"}.get(
        str(model.get("method")), " (the documented exponent)" if model else ""
    )
    words = (
        f"  throughput x{expected:.2f} expected{how}, x{factor:.2f} at most"
        if expected is not None
        else f"  throughput x{factor:.2f}"
    )
    if before is not None:
        after = [f"~{fmt(before * expected, 0)}"] if expected is not None else []
        after.append(("at most " if expected is not None else "") + fmt(before * factor, 0))
        words += f" ({fmt(before, 0)} -> {', '.join(after)} tok/s per instance)"
    return words


# Complexity checked by people: the report's text, one optional section per branch, top to bottom.
def report_text(report: Mapping[str, Any], patch_path: str | None = None) -> str:  # noqa: PLR0912
    """The report for people: per group of instances, the diagnosis, why (metrics to check on a
    dashboard), the proposal and what it is predicted to give."""
    head = "sglang-fleet advice"
    if report.get("window_s") is not None:
        head += f" ({report.get('source', 'sampled /metrics')}, window {fmt(report['window_s'])} s"
        if report.get("interval_s"):
            head += f", every {fmt(report['interval_s'])} s"
        head += ")"
    lines = [head + "; nothing was changed", ""]
    for group in report.get("groups") or []:
        count = len(group["instances"])
        lines.append(
            f"{group['label']} ({count} instance{'s' if count != 1 else ''}, SGLang {group['release']}): "
            f"{str(group['diagnosis']).upper()}"
        )
        for i, line in enumerate(group.get("why") or []):
            lines.append(("  why: " if i == 0 else "       ") + line)
        prop = group.get("proposal")
        if prop:
            if prop.get("changes"):
                lines.append("  proposal (server settings, in the inventory patch):")
                lines += [f"       {w}" for w in _change_words(prop["changes"])]
            if prop.get("client_changes"):
                lines.append("  proposal (generation clients, not the servers):")
                lines += [f"       {k}: {yaml_scalar(v)}" for k, v in prop["client_changes"].items()]
            predicted = (
                f"  predicted: effective max running requests {prop.get('effective_max_before')} -> "
                f"{prop.get('effective_max_after')}"
            )
            if prop.get("binding_after"):
                predicted += f" (then bound by {prop['binding_after']})"
            if prop.get("kv_tokens_after"):
                predicted += f"; KV {prop['kv_tokens_after']} tokens"
            if prop.get("predicted_token_usage") is not None:
                predicted += f", token usage ~{prop['predicted_token_usage']:.2f} at the new max"
            lines.append(predicted)
            if prop.get("throughput_factor") is not None:
                lines.append(_throughput_words(prop))
            lines += [f"  note: {n}" for n in prop.get("notes") or []]
        elif group["diagnosis"] not in (COMPUTE_BOUND, UNKNOWN):
            lines.append("  proposal: none")
        else:
            lines.append("  proposal: none (no tuning change is expected to help)")
        for alt in (group.get("alternatives") or [])[:3]:
            lines.append(
                f"  alternative: {'; '.join(_change_words(alt.get('changes') or {}))} -> effective max "
                f"{alt.get('effective_max_after')}, throughput {_factor_words(alt)}"
            )
        lines += [f"  problem: {p}" for p in group.get("problems") or []]
        lines.append("")
    for host, problem in (report.get("host_problems") or {}).items():
        lines.append(f"{host}: no advice: {problem}")
    for note in report.get("patch_notes") or []:
        lines.append(f"note: {note}")
    if patch_path:
        lines.append(
            f"patch: {patch_path} (review it, copy it into the inventory, then "
            "ansible-playbook retune.yml --check --diff)"
        )
    return "\n".join(lines).rstrip("\n") + "\n"
