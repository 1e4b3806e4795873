"""Flag checks: a set of settings, in layers, against one SGLang version.

:func:`validate_args` checks one mapping of settings and returns them under the names the version
uses, with normalised values and the warnings to show (deprecated keys passed as their
replacement). :func:`merge_layers` merges layered mappings key by key (later wins, null removes,
one setting under two names counts once) and :func:`check_items` checks the merged items, keeping
where each value was written so that every problem names its place. Every check collects all
problems; callers raise one :class:`ServerArgsError` listing them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.names import (
    REMOVAL_NOTES,
    describe_replacement,
    history,
    name_problem,
    resolve_name,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.table import (
    Flag,
    FlagTable,
    ValueMap,
    load_table,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.values import (
    YAML_BOOL_WORDS,
    Bad,
    convert,
    describe,
    plain,
)

_PLACEHOLDER = re.compile(r"<([a-z0-9-]+)>")


class ServerArgsError(ValueError):
    """Invalid SGLang settings; ``problems`` holds one line per problem."""

    def __init__(self, problems: Sequence[str], subject: str = "SGLang server settings") -> None:
        self.problems = list(dict.fromkeys(problems))
        count = len(self.problems)
        head = f"{subject}: {count} problem{'s' if count != 1 else ''}"
        super().__init__(head + "".join(f"\n- {problem}" for problem in self.problems))


class Item(NamedTuple):
    """One key as written: its value, where (for messages), and its layer (later layers win)."""

    key: str
    value: Any
    place: str
    layer: int = 0


@dataclass
class Checked:
    """Checked settings under the version's names, where each came from, warnings and problems."""

    args: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, Item] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _same_json(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def check_items(table: FlagTable, version: str, items: Iterable[Item]) -> Checked:
    """Resolve, convert and store each item; value maps are applied last, as they may refer to
    other settings (``<dp-size>``)."""
    out = Checked()
    pending: list[tuple[Item, ValueMap, Flag | None]] = []
    for item in sorted(items, key=lambda i: (i.key, i.layer)):
        if item.value is None:
            continue
        name = resolve_name(table, version, item.key)
        if name.status == "value_map":
            if name.value_map is None:
                raise AssertionError("a value-mapped name has its value map")
            pending.append((item, name.value_map, name.flag))
            continue
        if name.status != "setting":
            out.problems.append(name_problem(table, version, item.key, item.place, name))
            continue
        if name.flag is None or name.setting is None:
            raise AssertionError("a resolved name names its flag and setting")
        converted = convert(table, version, name.flag, item.value)
        if isinstance(converted, Bad):
            out.problems.append(f"{item.place}: {converted.message}")
            continue
        _store(out, name.setting, converted, item, version)
    for item, value_map, own in pending:
        _apply_value_map(table, version, out, item, value_map, own)
    out.args = dict(sorted(out.args.items()))
    return out


def _store(out: Checked, setting: str, value: Any, item: Item, version: str, via: str | None = None) -> bool:
    """Record one setting; a later layer wins, two values in one layer are a problem."""
    earlier = out.origins.get(setting)
    if earlier is not None:
        if earlier.layer > item.layer:
            return False
        if earlier.layer == item.layer and not _same_json(out.args[setting], value):
            what = f"{via} sets {setting}" if via else f"both set {setting}"
            out.problems.append(
                f"{item.place}: contradicts {earlier.place}: {what} on SGLang {version} "
                f"({out.args[setting]!r} vs {value!r}); keep one"
            )
            return False
    out.args[setting] = value
    out.origins[setting] = item
    return True


def _apply_value_map(
    table: FlagTable, version: str, out: Checked, item: Item, value_map: ValueMap, own: Flag | None
) -> None:
    flags = table.flags(version)
    if own is not None or version in value_map.versions:
        state = f"is deprecated in SGLang {version}"
    else:
        state = f"is not accepted by SGLang {version} ({history(table, version, item.key)})"
    if value_map.source == "switch":
        if not isinstance(item.value, bool):
            hint = ""
            if isinstance(item.value, str) and item.value.strip().lower() in YAML_BOOL_WORDS:
                hint = " (write true or false without quotes; strings are not converted)"
            out.problems.append(
                f"{item.place}: '{item.key}' is a switch and expects true or false, got {describe(item.value)}{hint}"
            )
            return
        if item.value is False:
            return
    elif value_map.source_choices is not None and item.value not in value_map.source_choices:
        choices = ", ".join(str(c) for c in value_map.source_choices)
        out.problems.append(
            f"{item.place}: {item.value!r} is not a valid choice for '{item.key}'; choose one of: {choices}"
        )
        return
    replacement = describe_replacement(value_map.replacement)
    resolved: dict[str, Any] = {}
    for target, target_value in value_map.targets.items():
        flag = flags.get(target)
        if flag is None or flag.deprecated:
            text = f"{item.place}: '{item.key}' {state} and its replacement {replacement} is not available there either"
            if item.key in REMOVAL_NOTES:
                text += f"; {REMOVAL_NOTES[item.key]}"
            out.problems.append(text)
            return
        wanted: Any = target_value
        placeholder = _PLACEHOLDER.fullmatch(str(target_value)) if isinstance(target_value, str) else None
        if placeholder:
            ref = resolve_name(table, version, placeholder[1].replace("-", "_"))
            if ref.setting is None or ref.setting not in out.args:
                out.problems.append(f"{item.place}: '{item.key}' {state}; set {replacement} instead")
                return
            wanted = out.args[ref.setting]
        converted = convert(table, version, flag, wanted)
        if isinstance(converted, Bad):
            text = (
                f"{item.place}: '{item.key}' {state} and its replacement "
                f"{target}: {wanted} cannot be used there: {converted.message}"
            )
            if item.key in REMOVAL_NOTES:
                text += f"; {REMOVAL_NOTES[item.key]}"
            out.problems.append(text)
            return
        resolved[target] = converted
    stored = [_store(out, t, v, item, version, via=f"'{item.key}'") for t, v in resolved.items()]
    if any(stored):
        rendered = ", ".join(f"{t}: {v}" for t, v in resolved.items())
        out.warnings.append(
            f"{item.place}: '{item.key}' {state}; passing {rendered} instead "
            "(set that in place of the old key to silence this warning)"
        )


def _table_for(version: Any) -> FlagTable:
    table = load_table()
    if not isinstance(version, str) or not table.supports(version):
        raise ServerArgsError([f"SGLang version {version!r} has no flag table; supported: {', '.join(table.versions)}"])
    return table


def _mapping_items(args: Any, where: str, problems: list[str], layer: int = 0) -> list[Item]:
    if args is None:
        return []
    if not isinstance(args, Mapping):
        problems.append(f"{where}: expected a mapping of setting names to values, got {describe(args)}")
        return []
    items = []
    for key, value in args.items():
        if not isinstance(key, str) or not key:
            problems.append(f"{where}: setting names must be non-empty strings, got {key!r}")
            continue
        items.append(Item(str(key), value, f"{where}.{key}", layer))
    return items


def validate_args(
    args: Mapping[str, Any] | None, version: str, where: str = "args"
) -> tuple[dict[str, Any], list[str]]:
    """Check tuning settings for one SGLang version.

    ``args`` maps setting names (snake_case, as ``/server_info`` reports them, or the name the
    setting has in another supported version) to values; null entries are dropped. Returns the
    settings under the names ``version`` uses, with normalised values (sizes such as ``200k`` as
    integers, JSON strings parsed), sorted by name, and the warnings to show (replaced deprecated
    flags). Raises :class:`ServerArgsError` listing every problem; ``where`` prefixes each place.
    """
    table = _table_for(version)
    problems: list[str] = []
    items = _mapping_items(args, where, problems)
    checked = check_items(table, version, items)
    problems.extend(checked.problems)
    if problems:
        raise ServerArgsError(problems)
    return checked.args, checked.warnings


def merge_layers(
    table: FlagTable | None, version: str, layers: Sequence[tuple[Any, str]], problems: list[str]
) -> list[Item]:
    """Merge ``(mapping, where)`` layers key by key, later wins, null removes.

    With a table, keys that are one setting under two names merge as one (a host's
    ``mamba_radix_cache_strategy`` overrides a group's ``mamba_scheduler_strategy``).
    """
    merged: dict[str, Item] = {}
    for layer, (mapping, where) in enumerate(layers):
        seen: dict[str, Item] = {}
        for item in _mapping_items(mapping, where, problems, layer):
            slot = item.key
            if table is not None:
                name = resolve_name(table, version, item.key)
                if name.status == "setting" and name.setting is not None:
                    slot = name.setting
            twin = seen.get(slot)
            if twin is not None and not _same_json(plain(twin.value), plain(item.value)):
                problems.append(
                    f"{item.place}: same setting as {twin.place} ({slot} on SGLang {version}) with another "
                    "value; keep one"
                )
            seen[slot] = item
            if item.value is None:
                merged.pop(slot, None)
            else:
                merged[slot] = item
    return list(merged.values())
