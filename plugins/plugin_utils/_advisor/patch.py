"""The advisor's inventory patch: the proposals as the inventory variables to change, and the
YAML file the operator reviews. Nothing is ever applied.

Per host, the patch is written at the layer where it means exactly the proposals:

* ``sglang_server_host_args`` (the whole dict: Ansible replaces a dict variable, it does not merge
  it) when every instance of the host got the same change and none sets a changed key in its own
  ``args``;
* otherwise ``sglang_server_instances`` (the whole list, for the same reason): the host's instances
  as the inventory writes them, each with its own proposal in its ``args``, the others as they are.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.vocabulary import instance_names, yaml_scalar

HOST_ARGS = "sglang_server_host_args"
INSTANCES = "sglang_server_instances"


def args_after(args: Mapping[str, Any] | None, changes: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    """``args`` with a proposal's changes: each new value set, ``None`` (SGLang's default) removed."""
    out = dict(args or {})
    for key, (_old, new) in changes.items():
        if new is None:
            out.pop(key, None)
        else:
            out[key] = new
    return out


def patched_layout(
    layout: Sequence[Mapping[str, Any]], changes_by_name: Mapping[str, Mapping[str, Sequence[Any]]]
) -> list[dict[str, Any]]:
    """A host's ``sglang_server_instances`` entries with each named instance's changes in its own
    ``args`` (instance args win over the host's and the group's); the other entries unchanged."""
    out = []
    for entry in layout:
        new = dict(entry)
        changes = changes_by_name.get(str(entry.get("name")))
        if changes:
            new["args"] = args_after(entry.get("args"), changes)
        out.append(new)
    return out


def _server_changes(advice: Mapping[str, Any]) -> dict[str, list[Any]]:
    """The settings the patch sets for an instance: its proposal's changes, and - where the
    instance runs another value than the inventory has (``drift``) - the running value, which
    the proposal was computed with. None without a proposal that changes server settings."""
    changes = dict((advice.get("proposal") or {}).get("changes") or {})
    if not changes:
        return {}
    for key, (wanted, running) in (advice.get("drift") or {}).items():
        changes.setdefault(key, [wanted, running])
    return changes


def instance_args_after(advice: Mapping[str, Any], layers: Mapping[str, Any]) -> dict[str, Any] | None:
    """The instance's own ``args`` with its proposal (what ``advise --trial`` relaunches its canary
    with), or None without a server change or an inventory entry."""
    changes = _server_changes(advice)
    entry = next((e for e in layers.get("instances") or [] if str(e.get("name")) == str(advice["name"])), None)
    if not changes or entry is None:
        return None
    return args_after(entry.get("args"), changes)


def _host_patch(
    host: str, members: Sequence[Mapping[str, Any]], layers: Mapping[str, Any]
) -> tuple[dict[str, Any], str | None]:
    """One host's variables, and a note saying why they are per instance."""
    layout = [dict(e) for e in layers.get("instances") or []]
    instance_args = {str(e.get("name")): dict(e.get("args") or {}) for e in layout}
    on_host = [str(e.get("name")) for e in layout] or [str(m["name"]) for m in members]
    by_name = {str(m["name"]): _server_changes(m) for m in members}
    distinct = {json.dumps(c, sort_keys=True) for c in by_name.values()}
    keys = {key for changes in by_name.values() for key in changes}
    shadowing = sorted(name for name in on_host if keys & set(instance_args.get(name) or {}))
    untouched = [name for name in on_host if name not in by_name]
    why = f"{instance_names(members)}: {', '.join(sorted({str(m['diagnosis']) for m in members}))}"
    drift = _drift_note(members)
    if len(distinct) == 1 and not untouched and not shadowing:
        changes = next(iter(by_name.values()))
        host_args = dict(layers.get(HOST_ARGS) or {})
        previous = {key: host_args[key] for key in changes if key in host_args}
        return {
            HOST_ARGS: args_after(host_args, changes),
            "_changes": changes,
            "_previous": previous,
            "_why": why,
        }, (f"{host}: {drift}" if drift else None)
    reasons = []
    if len(distinct) > 1:
        reasons.append("its instances got different proposals")
    if untouched:
        reasons.append(f"{', '.join(untouched)} got none")
    if shadowing:
        one = len(shadowing) == 1
        reasons.append(
            f"{', '.join(shadowing)} set{'s' if one else ''} a changed key in {'its' if one else 'their'} own args"
        )
    if not layout:
        return {}, f"{host}: {'; '.join(reasons)}, and the report has no instance layout of it: no patch for it"
    where = (
        f"{host}: {'; '.join(reasons)}: the patch sets each proposal in its instance's own args "
        f"({INSTANCES}, the whole list)"
    )
    previous = {
        name: {key: instance_args[name][key] for key in changes if key in (instance_args.get(name) or {})}
        for name, changes in by_name.items()
    }
    return {
        INSTANCES: patched_layout(layout, by_name),
        "_changes_by_instance": by_name,
        "_previous_by_instance": previous,
        "_why": why,
    }, where + (f"; {drift}" if drift else "")


def _drift_note(members: Sequence[Mapping[str, Any]]) -> str | None:
    """A note for instances that do not run the inventory's settings (the patch sets what runs)."""
    keys = sorted({key for m in members for key in m.get("drift") or {}})
    if not keys:
        return None
    return (
        f"the instances do not run the inventory's {', '.join(keys)}: the advice is for what runs, so the patch "
        "sets them back to the running values (retune first to advise on the inventory's)"
    )


def build_patch(
    advices: Sequence[Mapping[str, Any]], inventory: Mapping[str, Mapping[str, Any]]
) -> tuple[dict[str, Any], list[str]]:
    """``{"host_vars": {host: {variable: value, "_...": annotations}}, "group_vars": {...}}``: per
    host the layer the proposals go in (see the module's docstring), and the generation clients'
    concurrency for client-bound instances; with notes for the operator."""
    host_vars: dict[str, Any] = {}
    group_vars: dict[str, Any] = {}
    by_host: dict[str, list[Mapping[str, Any]]] = {}
    for a in advices:
        if _server_changes(a):
            by_host.setdefault(str(a["host"]), []).append(a)
        client = (a.get("proposal") or {}).get("client_changes")
        if client:
            group_vars.setdefault("generation", {}).update(client)
    hosts_by_note: dict[str, list[str]] = {}
    for host, members in sorted(by_host.items()):
        entry, note = _host_patch(host, members, inventory.get(host) or {})
        if entry:
            host_vars[host] = entry
        if note:
            hosts_by_note.setdefault(note.removeprefix(f"{host}: "), []).append(host)
    notes = [f"{', '.join(hosts)}: {note}" for note, hosts in hosts_by_note.items()]
    return {"host_vars": host_vars, "group_vars": group_vars}, notes


def _was(key: str, previous: Mapping[str, Any], changes: Mapping[str, Sequence[Any]]) -> str:
    if key in previous:
        return f"  # was {yaml_scalar(previous[key])}"
    if key in changes:
        ran = changes[key][0]
        return "  # added; the server ran " + ("SGLang's default" if ran is None else yaml_scalar(ran))
    return ""


def _instances_yaml(
    entries: Sequence[Mapping[str, Any]],
    by_name: Mapping[str, Mapping[str, Sequence[Any]]],
    previous_by_name: Mapping[str, Mapping[str, Any]],
) -> list[str]:
    lines = ["    # The whole list: Ansible replaces a list variable, it does not merge it.", f"    {INSTANCES}:"]
    for entry in entries:
        name = str(entry.get("name"))
        changes = by_name.get(name) or {}
        keys = ["name", *[k for k in entry if k not in ("name", "args")]]
        for i, key in enumerate(keys):
            lines.append(("      - " if i == 0 else "        ") + f"{key}: {yaml_scalar(entry.get(key))}")
        args = entry.get("args")
        if args is None:
            continue
        if not args:
            lines.append("        args: {}")
            continue
        lines.append("        args:" + ("  # the proposal for this instance" if changes else ""))
        previous = previous_by_name.get(name) or {}
        for key, value in args.items():
            lines.append(f"          {key}: {yaml_scalar(value)}{_was(key, previous, changes)}")
    return lines


def patch_yaml(report: Mapping[str, Any]) -> str:
    """The patch as a YAML file the operator reviews, with the reason and the old value of every
    changed key in comments. Each ``host_vars`` block is the content of that host's file."""
    patch = report.get("patch") or {}
    lines = [
        "---",
        "# sglang-fleet tuning advice" + (f", {report['created']}" if report.get("created") else "") + ".",
        "# Written by playbooks/advise.yml; nothing was applied. Review it, copy each block into the",
        "# inventory file it names, then: ansible-playbook retune.yml --check --diff",
    ]
    for note in report.get("patch_notes") or []:
        lines.append(f"# NOTE: {note}")
    host_vars = patch.get("host_vars") or {}
    group_vars = patch.get("group_vars") or {}
    if not host_vars and not group_vars:
        lines.append("# No tuning change is proposed.")
    lines.append("host_vars:" + (" {}" if not host_vars else ""))
    for host, entry in host_vars.items():
        lines.append(f"  {host}:  # host_vars/{host}.yml")
        lines.append(f"    # {entry.get('_why')}")
        if HOST_ARGS in entry:
            changes = entry.get("_changes") or {}
            previous = entry.get("_previous") or {}
            lines.append(f"    {HOST_ARGS}:")
            for key, value in entry[HOST_ARGS].items():
                lines.append(f"      {key}: {yaml_scalar(value)}{_was(key, previous, changes)}")
        else:
            lines += _instances_yaml(
                entry[INSTANCES], entry.get("_changes_by_instance") or {}, entry.get("_previous_by_instance") or {}
            )
    lines.append("group_vars:" + (" {}" if not group_vars else ""))
    for group, values in group_vars.items():
        lines.append(f"  {group}:  # group_vars/{group}.yml (the hosts that run the generation client)")
        for key, value in values.items():
            lines.append(f"    {key}: {yaml_scalar(value)}")
    return "\n".join(lines) + "\n"
