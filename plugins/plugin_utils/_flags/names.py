"""Flag names: which SGLang setting a key written in the inventory is on one version.

A key may be the setting's own name, a name it had in another release (rename groups of the flag
table), a deprecated switch that stands for other settings (a value map), a flag the release
removed or has not added yet, or a typo. :func:`resolve_name` says which; :func:`name_problem`
words the message for every case that cannot be passed, naming the release history, SGLang's own
replacement and the closest known names.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.table import (
    REJECTED,
    Flag,
    FlagTable,
    ValueMap,
    version_key,
)

# Facts from the reference (sglang.md section 1.2) that the argparse dumps cannot show, used to
# say what to do when a setting has no equivalent in the version asked for.
REMOVAL_NOTES: Mapping[str, str] = {
    "enable_piecewise_cuda_graph": "piecewise CUDA graph is the default since SGLang 0.5.10; remove the key "
    "(cuda_graph_backend_prefill chooses or disables the prefill graph backend)",
    "disable_piecewise_cuda_graph": "before 0.5.10 piecewise CUDA graph only runs when "
    "enable_piecewise_cuda_graph is set; remove the key",
    "enforce_piecewise_cuda_graph": "before 0.5.10 use enable_piecewise_cuda_graph; the tc_piecewise backend "
    "it selects was dropped in 0.5.22, so on newer releases remove the key",
    "enable_breakable_cuda_graph": "before 0.5.14 there is no breakable CUDA graph backend; remove the key",
}


@dataclass(frozen=True)
class Name:
    """What a user-written key means in one version."""

    status: str  # setting | value_map | deprecated | rejected | absent | unknown
    setting: str | None = None
    flag: Flag | None = None
    value_map: ValueMap | None = None


def resolve_name(table: FlagTable, version: str, key: str) -> Name:
    """What ``key`` means on ``version``: the current spelling of its setting when there is one."""
    flags = table.flags(version)
    own = flags.get(key)
    if own is not None and not own.deprecated:
        return Name("setting", key, own)
    group = table.rename_group(key)
    current = sorted(m for m in group if m in flags and not flags[m].deprecated)
    if current:
        return Name("setting", current[0], flags[current[0]])
    value_map = table.value_maps.get(key)
    if value_map is not None:
        return Name("value_map", key, own, value_map)
    stale = own or next((flags[m] for m in sorted(group) if m in flags), None)
    if stale is not None:
        return Name("rejected" if stale.kind == REJECTED else "deprecated", stale.name, stale)
    if table.versions_with(key):
        return Name("absent", key)
    return Name("unknown", key)


def describe_replacement(text: str) -> str:
    """``--cuda-graph-backend-{decode,prefill}=disabled`` -> settings as a user writes them."""
    head, _unused, placeholder = text.partition(" ")
    option, eq, value = head.partition("=")
    match = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", option)
    options = [f"{match[1]}{alt}{match[3]}" for alt in match[2].split(",")] if match else [option]
    names = [o.lstrip("-").replace("-", "_") for o in options]
    if eq:
        return " and ".join(f"{n}: {value}" for n in names)
    if placeholder:
        ref = placeholder.strip("<>").replace("-", "_")
        return " and ".join(f"{n} (set to your {ref})" for n in names)
    return " and ".join(names)


def history(table: FlagTable, version: str, key: str) -> str:
    """Which releases accept ``key``, said relative to ``version``."""
    present = table.versions_with(key)
    value_map = table.value_maps.get(key)
    if value_map is not None:
        present = tuple(sorted(set(present) | set(value_map.versions), key=version_key))
    earlier = [v for v in present if version_key(v) < version_key(version)]
    later = [v for v in present if version_key(v) > version_key(version)]
    if earlier and not later:
        text = f"it was removed after SGLang {earlier[-1]}"
    elif later and not earlier:
        text = f"it is only accepted from SGLang {later[0]} on"
    else:
        text = f"it is accepted by SGLang {', '.join(present)}"
    other_names = sorted({m for m in table.rename_group(key) if m != key for v in present if m in table.flags(v)})
    if other_names:
        text += f" (also known as {', '.join(other_names)})"
    return text


def _replacement_hint(table: FlagTable, key: str) -> str | None:
    """The newest replacement SGLang itself named for ``key``, as settings."""
    value_map = table.value_maps.get(key)
    if value_map is not None:
        return describe_replacement(value_map.replacement)
    group = table.rename_group(key)
    for version in reversed(table.versions):
        for member in sorted(group):
            flag = table.flag(version, member)
            if flag is not None and flag.deprecated_for:
                return describe_replacement(flag.deprecated_for)
    return None


def _suggest(table: FlagTable, version: str, key: str) -> list[str]:
    flags = table.flags(version)
    pool = {name for name, flag in flags.items() if not flag.deprecated}
    pool |= {name for name in table.known_names() if resolve_name(table, version, name).status == "setting"}
    pool |= {name for name in table.value_maps if version in table.value_maps[name].versions}
    matches = difflib.get_close_matches(key, sorted(pool), n=3, cutoff=0.6)
    if not matches:
        return []
    # A near-exact match (a typo) is the answer; weaker look-alikes next to it only distract.
    best = difflib.SequenceMatcher(None, key, matches[0]).ratio()
    return [m for m in matches if difflib.SequenceMatcher(None, key, m).ratio() >= best - 0.1]


def _or_list(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def name_problem(table: FlagTable, version: str, key: str, place: str, name: Name) -> str:
    """The message for a key that names no setting ``version`` accepts, prefixed with ``place``."""
    if name.status == "rejected":
        return f"{place}: '{key}' is deprecated in SGLang {version} and its parser rejects it; remove the key"
    if name.status == "deprecated":
        if name.flag is None:
            raise AssertionError("a known name has its flag")
        replacement = describe_replacement(name.flag.deprecated_for or "")
        via = f" (there it is called {name.setting})" if name.setting != key else ""
        return (
            f"{place}: '{key}' is deprecated in SGLang {version}{via} and this collection never emits "
            f"deprecated flags; set {replacement} instead"
        )
    if name.status == "absent":
        text = f"{place}: '{key}' is not accepted by SGLang {version}: {history(table, version, key)}"
        hint = _replacement_hint(table, key)
        if hint:
            text += f"; its replacement is {hint}"
        if key in REMOVAL_NOTES:
            text += f"; {REMOVAL_NOTES[key]}"
        return text
    suggestions = _suggest(table, version, key)
    if suggestions:
        return f"{place}: SGLang {version} has no setting '{key}'; did you mean {_or_list(suggestions)}?"
    return (
        f"{place}: SGLang {version} has no setting '{key}' (a flag this collection does not know "
        "goes in sglang_server_args_unchecked or the instance's args_unchecked)"
    )
