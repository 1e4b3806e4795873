"""SGLang launch arguments: from inventory variables to the exact argv each version accepts.

Pure functions, shared by the ``server_cli_args`` / ``server_instances`` filters, the
``server_validate`` action and the retune action:

* :func:`validate_args` checks tuning settings against one SGLang version and normalises them
  to the names that version uses (its ``/server_info`` keys);
* :func:`render_cli_args` turns settings into argv words;
* :func:`resolve_instances` applies the instance layout of one host (defaults, layered variables,
  GPU/port bookkeeping) and returns every instance with its argv, environment and fingerprint;
* :func:`expected_server_info` / :func:`compare_server_info` say what a running server must
  report for the settings it was given.

Every check collects all problems and raises one :class:`ServerArgsError` listing them, each
naming where the value was written and how to fix it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, NamedTuple, TypeGuard

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flag_table import (
    BOOLOPT,
    LIST,
    OPTIONAL,
    REJECTED,
    SWITCH,
    Flag,
    FlagTable,
    ValueMap,
    load_table,
    version_key,
)

LAUNCH_MODULE = "sglang.launch_server"
DEFAULT_PYTHON = "/opt/sglang/venv/bin/python"
DEFAULT_LISTEN_HOST = "127.0.0.1"
DEFAULT_BASE_PORT = 30000

# Settings the instance layout writes; users set the variable named here instead.
LAYOUT_OWNED: Mapping[str, str] = {
    "model_path": "sglang_server_model_path",
    "served_model_name": "sglang_server_served_model_name",
    "host": "sglang_server_listen_host",
    "port": "sglang_server_base_port (default layout) or the instance's port in sglang_server_instances",
    "base_gpu_id": "the instance's gpus in sglang_server_instances (each instance sees only its own GPUs, "
    "renumbered from 0 by CUDA_VISIBLE_DEVICES)",
    "api_key": "sglang_server_api_key (keys are secrets and never go into args)",
    "admin_api_key": "sglang_server_api_key (keys are secrets and never go into args)",
}
# The layout sets tp_size from the GPU list; an equal value in args is harmless, any other is an error.
TP_SIZE = "tp_size"

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

# Values a release's own type converter refuses before argparse looks at the choices, keyed by the
# converter's name in the flag table: (converter, value) -> the converter's error text. From 0.5.22
# parse_cuda_graph_backend_arg refuses tc_piecewise for --cuda-graph-backend-{decode,prefill}; the
# argparse dumps show only the converter's name (see the flag dumps' README).
CONVERTER_REFUSALS: Mapping[tuple[str, str], str] = {
    ("parse_cuda_graph_backend_arg", "tc_piecewise"): "tc_piecewise was removed; select breakable, full, or disabled",
}

# /server_info reports some values in another form than the flag took them.
SERVER_INFO_REWRITES: Sequence[tuple[str, Any, Any, tuple[str, ...]]] = (
    # (setting, value given, value reported, versions): 0.5.9 rewrites NEXTN in _handle_speculative_decoding.
    ("speculative_algorithm", "NEXTN", "EAGLE", ("0.5.9",)),
)
# Explicit values SGLang replaces at start-up (0.5.23 reports resolved values), so they are not compared.
RESOLVED_AT_STARTUP: frozenset[str] = frozenset({"auto"})
# Settings whose /server_info shape differs from the flag's (parsed into objects), never compared.
NOT_ECHOED: frozenset[str] = frozenset({"lora_paths", "cuda_graph_config"})

# The host variables resolve_instances reads; callers pass just these (templating others is wasted work).
HOST_VARIABLES: tuple[str, ...] = (
    "sglang_server_version",
    "sglang_server_flag_table_version",
    "sglang_server_python",
    "sglang_server_model_path",
    "sglang_server_served_model_name",
    "sglang_server_listen_host",
    "sglang_server_base_port",
    "sglang_server_gpu_count",
    "sglang_server_instances",
    "sglang_server_lxc_container",
    "sglang_server_args",
    "sglang_server_host_args",
    "sglang_server_args_unchecked",
    "sglang_server_env",
    "sglang_server_host_env",
)
INSTANCE_KEYS: tuple[str, ...] = ("name", "gpus", "port", "args", "args_unchecked", "env", "container")

_INSTANCE_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_UNCHECKED_NAME = re.compile(r"[a-z0-9][a-z0-9_]*")
_INT_TEXT = re.compile(r"[+-]?\d+")
_FLOAT_TEXT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")
_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
# argparse's own test for "this word is a negative number, not an option".
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
_PLACEHOLDER = re.compile(r"<([a-z0-9-]+)>")
_YAML_BOOL_WORDS = frozenset({"true", "false", "yes", "no", "on", "off"})
_JSON_TYPES = frozenset({"loads", "json_list_type"})

_TYPE_WORDS: Mapping[str, str] = {
    "int": "an integer",
    "float": "a number",
    "human_readable_int": "an integer or a size such as 200k or 32Ki",
    "loads": "a mapping (or a JSON string)",
    "json_list_type": "a list (or a JSON string holding one)",
    "parse_cuda_graph_config_arg": "a string or a mapping",
}


class ServerArgsError(ValueError):
    """Invalid SGLang settings; ``problems`` holds one line per problem."""

    def __init__(self, problems: Sequence[str], subject: str = "SGLang server settings") -> None:
        self.problems = list(dict.fromkeys(problems))
        count = len(self.problems)
        head = f"{subject}: {count} problem{'s' if count != 1 else ''}"
        super().__init__(head + "".join(f"\n- {problem}" for problem in self.problems))


# --------------------------------------------------------------------------------------------------
# Names


@dataclass(frozen=True)
class _Name:
    """What a user-written key means in one version."""

    status: str  # setting | value_map | deprecated | rejected | absent | unknown
    setting: str | None = None
    flag: Flag | None = None
    value_map: ValueMap | None = None


def _resolve_name(table: FlagTable, version: str, key: str) -> _Name:
    flags = table.flags(version)
    own = flags.get(key)
    if own is not None and not own.deprecated:
        return _Name("setting", key, own)
    group = table.rename_group(key)
    current = sorted(m for m in group if m in flags and not flags[m].deprecated)
    if current:
        return _Name("setting", current[0], flags[current[0]])
    value_map = table.value_maps.get(key)
    if value_map is not None:
        return _Name("value_map", key, own, value_map)
    stale = own or next((flags[m] for m in sorted(group) if m in flags), None)
    if stale is not None:
        return _Name("rejected" if stale.kind == REJECTED else "deprecated", stale.name, stale)
    if table.versions_with(key):
        return _Name("absent", key)
    return _Name("unknown", key)


def _describe_replacement(text: str) -> str:
    """``--cuda-graph-backend-{decode,prefill}=disabled`` -> settings as a user writes them."""
    head, _, placeholder = text.partition(" ")
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


def _history(table: FlagTable, version: str, key: str) -> str:
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
        return _describe_replacement(value_map.replacement)
    group = table.rename_group(key)
    for version in reversed(table.versions):
        for member in sorted(group):
            flag = table.flag(version, member)
            if flag is not None and flag.deprecated_for:
                return _describe_replacement(flag.deprecated_for)
    return None


def _suggest(table: FlagTable, version: str, key: str) -> list[str]:
    flags = table.flags(version)
    pool = {name for name, flag in flags.items() if not flag.deprecated}
    pool |= {name for name in table.known_names() if _resolve_name(table, version, name).status == "setting"}
    pool |= {name for name in table.value_maps if version in table.value_maps[name].versions}
    matches = difflib.get_close_matches(key, sorted(pool), n=3, cutoff=0.6)
    if not matches:
        return []
    # A near-exact match (a typo) is the answer; weaker look-alikes next to it only distract.
    best = difflib.SequenceMatcher(None, key, matches[0]).ratio()
    return [m for m in matches if difflib.SequenceMatcher(None, key, m).ratio() >= best - 0.1]


def _or_list(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _name_problem(table: FlagTable, version: str, key: str, place: str, name: _Name) -> str:
    if name.status == "rejected":
        return f"{place}: '{key}' is deprecated in SGLang {version} and its parser rejects it; remove the key"
    if name.status == "deprecated":
        assert name.flag is not None
        replacement = _describe_replacement(name.flag.deprecated_for or "")
        via = f" (there it is called {name.setting})" if name.setting != key else ""
        return (
            f"{place}: '{key}' is deprecated in SGLang {version}{via} and this collection never emits "
            f"deprecated flags; set {replacement} instead"
        )
    if name.status == "absent":
        text = f"{place}: '{key}' is not accepted by SGLang {version}: {_history(table, version, key)}"
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


# --------------------------------------------------------------------------------------------------
# Values


class _Bad(NamedTuple):
    message: str


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    if value is None:
        return "null"
    return f"a {type(value).__name__}"


def plain(value: Any) -> Any:
    """A deep copy made of builtin types only (Ansible hands over tagged subclasses)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def parse_human_readable_int(text: str) -> int:
    """SGLang's ``human_readable_int`` (0.5.10+): ``200k`` = 200000, ``32Ki`` = 32768, case-sensitive."""
    text = text.strip()
    match = _HUMAN_INT.fullmatch(text)
    if match:
        number, suffix = match.groups()
        if suffix in _IEC:
            if "." in number:
                raise ValueError(f"decimals are not allowed with IEC suffixes like '{suffix}'")
            return int(number) * _IEC[suffix]
        return int(Decimal(number) * _SI[suffix])
    if _INT_TEXT.fullmatch(text):
        return int(text)
    raise ValueError(
        f"invalid integer value {text!r}; use a plain integer, SI suffixes (1k, 1M) or IEC suffixes "
        "(1Ki, 1Mi); suffixes are case-sensitive"
    )


def _scalar(flag: Flag, value: Any) -> Any:
    """Normalise one value of ``flag``'s type, or return _Bad."""
    kind = flag.type or "str"
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, str) and _INT_TEXT.fullmatch(value.strip()):
            return int(value)
        if isinstance(value, str) and _HUMAN_INT.fullmatch(value.strip()):
            return _Bad(
                f"expects an integer, got {_describe(value)} (sizes such as 200k are only "
                "accepted by flags that take them, from SGLang 0.5.10 on)"
            )
        return _Bad(f"expects an integer, got {_describe(value)}")
    if kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                return _Bad(f"expects a finite number, got {value!r}")
            return plain(value)
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            return float(value)
        return _Bad(f"expects a number, got {_describe(value)}")
    if kind == "human_readable_int":
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, str):
            try:
                return parse_human_readable_int(value)
            except (ValueError, InvalidOperation) as exc:
                return _Bad(f"expects {_TYPE_WORDS[kind]}: {exc}")
        return _Bad(f"expects {_TYPE_WORDS[kind]}, got {_describe(value)}")
    if kind in _JSON_TYPES:
        parsed = value
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except ValueError as exc:
                return _Bad(f"expects {_TYPE_WORDS[kind]}; the string is not JSON ({exc})")
        if kind == "json_list_type" and not isinstance(parsed, (list, tuple)):
            return _Bad(f"expects {_TYPE_WORDS[kind]}, got {_describe(value)}")
        try:
            json.dumps(plain(parsed))
        except (TypeError, ValueError):
            return _Bad(f"expects {_TYPE_WORDS[kind]}, got {_describe(value)} that is not JSON-serialisable")
        return plain(parsed)
    if isinstance(value, Mapping):
        # Text flags such as --json-model-override-args take JSON; a mapping is passed as compact JSON.
        try:
            json.dumps(plain(value))
        except (TypeError, ValueError):
            return _Bad(f"expects a string, got {_describe(value)} that is not JSON-serialisable")
        return plain(value)
    # str, nullable_str, parse_cuda_graph_backend_arg and any other converter taking text.
    if isinstance(value, bool):
        return _Bad(
            f"expects a string, got {_describe(value)} (YAML reads unquoted yes/no/on/off/true/false "
            "as booleans; quote the value)"
        )
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (int, float)):
        return str(value)
    return _Bad(f"expects {_TYPE_WORDS.get(kind, 'a string')}, got {_describe(value)}")


def _refusal(flag: Flag | None, value: Any) -> str | None:
    """The converter's error text when ``flag``'s type converter refuses ``value``."""
    if flag is None or not isinstance(value, str):
        return None
    return CONVERTER_REFUSALS.get((flag.type or "str", value))


def _choice_problem(table: FlagTable, version: str, flag: Flag, value: Any) -> str | None:
    refusal = _refusal(flag, value)
    if refusal is None and (flag.choices is None or value in flag.choices):
        return None
    group = table.rename_group(flag.name)
    elsewhere = [
        v
        for v in table.versions
        if v != version
        and any(
            (other := table.flag(v, member)) is not None
            and not other.deprecated
            and other.choices is not None
            and value in other.choices
            and _refusal(other, value) is None
            for member in group
        )
    ]
    if refusal is not None:
        text = f"{value!r} is refused by {flag.opt} on SGLang {version}, whose parser answers {refusal!r}"
        if flag.choices:
            text += f"; choose one of: {', '.join(str(c) for c in flag.choices)}"
    else:
        assert flag.choices is not None
        text = (
            f"{value!r} is not a valid choice for {flag.opt} on SGLang {version}; "
            f"choose one of: {', '.join(str(c) for c in flag.choices)}"
        )
    if elsewhere:
        text += f" ({value!r} is accepted by SGLang {', '.join(elsewhere)})"
    return text


def _convert(table: FlagTable, version: str, flag: Flag, value: Any) -> Any:
    """Normalise ``value`` for ``flag`` on ``version``; _Bad(message) when it cannot be passed."""
    where = f"{flag.opt} on SGLang {version}"
    if flag.kind in (SWITCH, BOOLOPT):
        if isinstance(value, bool):
            return value
        hint = ""
        if isinstance(value, str) and value.strip().lower() in _YAML_BOOL_WORDS:
            hint = " (write true or false without quotes; strings are not converted)"
        return _Bad(f"{where} is a switch and expects true or false, got {_describe(value)}{hint}")
    if flag.kind == OPTIONAL and isinstance(value, bool):
        return value
    if flag.kind == LIST:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if not items and flag.nargs == "+":
            return _Bad(f"{where} expects at least one value, got an empty list")
        normalized = []
        for item in items:
            converted = _scalar(flag, item)
            if isinstance(converted, _Bad):
                return _Bad(f"{where}: each list item {converted.message}")
            if isinstance(converted, str) and converted.startswith("-") and not _NEGATIVE_NUMBER.match(converted):
                return _Bad(f"{where}: list item {converted!r} starts with '-' and would be read as an option")
            problem = _choice_problem(table, version, flag, converted)
            if problem:
                return _Bad(problem)
            normalized.append(converted)
        return normalized
    if isinstance(value, (list, tuple)) and flag.type not in _JSON_TYPES:
        return _Bad(f"{where} takes one value, got a list")
    converted = _scalar(flag, value)
    if isinstance(converted, _Bad):
        return _Bad(f"{where} {converted.message}")
    problem = _choice_problem(table, version, flag, converted)
    return _Bad(problem) if problem else converted


# --------------------------------------------------------------------------------------------------
# Checking a set of settings


class _Item(NamedTuple):
    key: str
    value: Any
    place: str
    layer: int = 0


@dataclass
class _Checked:
    args: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, _Item] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _same_value(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _check_items(table: FlagTable, version: str, items: Iterable[_Item]) -> _Checked:
    out = _Checked()
    pending: list[tuple[_Item, ValueMap, Flag | None]] = []
    for item in sorted(items, key=lambda i: (i.key, i.layer)):
        if item.value is None:
            continue
        name = _resolve_name(table, version, item.key)
        if name.status == "value_map":
            assert name.value_map is not None
            pending.append((item, name.value_map, name.flag))
            continue
        if name.status != "setting":
            out.problems.append(_name_problem(table, version, item.key, item.place, name))
            continue
        assert name.flag is not None and name.setting is not None
        converted = _convert(table, version, name.flag, item.value)
        if isinstance(converted, _Bad):
            out.problems.append(f"{item.place}: {converted.message}")
            continue
        _store(out, name.setting, converted, item, version)
    for item, value_map, own in pending:
        _apply_value_map(table, version, out, item, value_map, own)
    out.args = dict(sorted(out.args.items()))
    return out


def _store(out: _Checked, setting: str, value: Any, item: _Item, version: str, via: str | None = None) -> bool:
    """Record one setting; a later layer wins, two values in one layer are a problem."""
    earlier = out.origins.get(setting)
    if earlier is not None:
        if earlier.layer > item.layer:
            return False
        if earlier.layer == item.layer and not _same_value(out.args[setting], value):
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
    table: FlagTable, version: str, out: _Checked, item: _Item, value_map: ValueMap, own: Flag | None
) -> None:
    flags = table.flags(version)
    if own is not None or version in value_map.versions:
        state = f"is deprecated in SGLang {version}"
    else:
        state = f"is not accepted by SGLang {version} ({_history(table, version, item.key)})"
    if value_map.source == "switch":
        if not isinstance(item.value, bool):
            hint = ""
            if isinstance(item.value, str) and item.value.strip().lower() in _YAML_BOOL_WORDS:
                hint = " (write true or false without quotes; strings are not converted)"
            out.problems.append(
                f"{item.place}: '{item.key}' is a switch and expects true or false, got {_describe(item.value)}{hint}"
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
    replacement = _describe_replacement(value_map.replacement)
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
            ref = _resolve_name(table, version, placeholder[1].replace("-", "_"))
            if ref.setting is None or ref.setting not in out.args:
                out.problems.append(f"{item.place}: '{item.key}' {state}; set {replacement} instead")
                return
            wanted = out.args[ref.setting]
        converted = _convert(table, version, flag, wanted)
        if isinstance(converted, _Bad):
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


# --------------------------------------------------------------------------------------------------
# Public API: settings


def _table_for(version: Any) -> FlagTable:
    table = load_table()
    if not isinstance(version, str) or not table.supports(version):
        raise ServerArgsError([f"SGLang version {version!r} has no flag table; supported: {', '.join(table.versions)}"])
    return table


def _mapping_items(args: Any, where: str, problems: list[str], layer: int = 0) -> list[_Item]:
    if args is None:
        return []
    if not isinstance(args, Mapping):
        problems.append(f"{where}: expected a mapping of setting names to values, got {_describe(args)}")
        return []
    items = []
    for key, value in args.items():
        if not isinstance(key, str) or not key:
            problems.append(f"{where}: setting names must be non-empty strings, got {key!r}")
            continue
        items.append(_Item(str(key), value, f"{where}.{key}", layer))
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
    checked = _check_items(table, version, items)
    problems.extend(checked.problems)
    if problems:
        raise ServerArgsError(problems)
    return checked.args, checked.warnings


def _format_value(flag: Flag, value: Any) -> str:
    if flag.type in _JSON_TYPES or isinstance(value, (Mapping, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _with_value(opt: str, word: str) -> list[str]:
    # A value that looks like an option would be taken for one; the --opt=value form cannot be.
    if word.startswith("-") and not _NEGATIVE_NUMBER.match(word):
        return [f"{opt}={word}"]
    return [opt, word]


def _render_setting(flag: Flag, value: Any) -> list[str]:
    if flag.kind == SWITCH:
        return [flag.opt] if value else []
    if flag.kind == BOOLOPT:
        return [flag.opt] if value else [flag.no_opt or f"--no-{flag.opt[2:]}"]
    if flag.kind == OPTIONAL and isinstance(value, bool):
        return [flag.opt] if value else []
    if flag.kind == LIST:
        return [flag.opt, *(_format_value(flag, v) for v in value)]
    return _with_value(flag.opt, _format_value(flag, value))


def render_cli_args(args: Mapping[str, Any] | None, version: str) -> list[str]:
    """argv words for ``args`` on SGLang ``version``, after :func:`validate_args`.

    Flags come sorted by setting name, each in the full spelling ``version`` accepts (never an
    abbreviation, never a deprecated alias): ``True`` is a bare switch, ``False`` omits a switch
    (``--no-x`` for BooleanOptionalAction flags), lists become several words and mappings compact
    JSON. Raises :class:`ServerArgsError` for invalid settings.
    """
    normalized, _warnings = validate_args(args, version)
    flags = load_table().flags(version)
    words: list[str] = []
    for name, value in normalized.items():
        words.extend(_render_setting(flags[name], value))
    return words


def unchecked_cli_words(unchecked: Mapping[str, Any]) -> list[str]:
    """argv words for ``args_unchecked``: ``--kebab-name value``, never validated."""
    words: list[str] = []
    for key in sorted(unchecked):
        value = unchecked[key]
        opt = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            words.append(opt)
        elif isinstance(value, (list, tuple)):
            words.extend([opt, *(_unchecked_word(v) for v in value)])
        else:
            words.extend(_with_value(opt, _unchecked_word(value)))
    return words


def _unchecked_word(value: Any) -> str:
    if isinstance(value, (Mapping, list, tuple)):
        return json.dumps(plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value)
    return str(value)


def expected_server_info(args: Mapping[str, Any] | None, version: str) -> dict[str, Any]:
    """For each setting in ``args``, the value ``/server_info`` of ``version`` should report.

    Values SGLang resolves at start-up (``auto``) and settings reported in another shape
    (:data:`NOT_ECHOED`) are left out; NEXTN is expected as EAGLE on 0.5.9, which rewrites it.
    """
    normalized, _warnings = validate_args(args, version)
    flags = load_table().flags(version)
    expected: dict[str, Any] = {}
    for name, value in normalized.items():
        if name in NOT_ECHOED or (isinstance(value, str) and value in RESOLVED_AT_STARTUP):
            continue
        flag = flags[name]
        shown = flag.const if flag.kind == OPTIONAL and value is True else value
        if isinstance(shown, Mapping) and flag.type not in _JSON_TYPES:
            # A text flag keeps the JSON string it was given.
            shown = _format_value(flag, shown)
        for setting, given, reported, versions in SERVER_INFO_REWRITES:
            if name == setting and shown == given and version in versions:
                shown = reported
        expected[name] = shown
    return expected


# --------------------------------------------------------------------------------------------------
# Public API: instances of one host


def fingerprint(version: str, argv: Sequence[str], env: Mapping[str, str]) -> str:
    """sha256 of the canonical JSON of what makes a running instance what it is."""
    canonical = json.dumps(
        {"version": version, "argv": list(argv), "env": dict(env)},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _env_value(value: Any) -> str | None:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, str):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    return None


@dataclass
class _Layout:
    index: int | None  # position in sglang_server_instances; None for the default layout
    name: str
    gpus: list[int]
    port: int
    container: int | None
    args: Any
    args_unchecked: Any
    env: Any

    def path(self, key: str) -> str:
        return f"sglang_server_instances[{self.index}].{key}" if self.index is not None else key


def _merge_layers(
    table: FlagTable | None, version: str, layers: Sequence[tuple[Any, str]], problems: list[str]
) -> list[_Item]:
    """Merge ``(mapping, where)`` layers key by key, later wins, null removes.

    With a table, keys that are one setting under two names merge as one (a host's
    ``mamba_radix_cache_strategy`` overrides a group's ``mamba_scheduler_strategy``).
    """
    merged: dict[str, _Item] = {}
    for layer, (mapping, where) in enumerate(layers):
        seen: dict[str, _Item] = {}
        for item in _mapping_items(mapping, where, problems, layer):
            slot = item.key
            if table is not None:
                name = _resolve_name(table, version, item.key)
                if name.status == "setting" and name.setting is not None:
                    slot = name.setting
            twin = seen.get(slot)
            if twin is not None and not _same_value(plain(twin.value), plain(item.value)):
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


def _host_scalar(
    hostvars: Mapping[str, Any],
    name: str,
    default: Any,
    where: str,
    problems: list[str],
    check: Any,
    expected: str,
) -> Any:
    value = hostvars.get(name)
    if value is None:
        return default
    if not check(value):
        problems.append(f"{where}: {name} expects {expected}, got {_describe(value)}")
        return default
    return plain(value)


def _instance_layouts(
    hostname: str,
    hostvars: Mapping[str, Any],
    gpu_count: int | None,
    base_port: int,
    host_container: int | None,
    problems: list[str],
) -> list[_Layout]:
    where = f"host {hostname}"
    entries = hostvars.get("sglang_server_instances")
    if entries is None or (isinstance(entries, (list, tuple)) and not entries):
        count = gpu_count or 0
        return [_Layout(None, f"gpu{i}", [i], base_port + i, host_container, None, None, None) for i in range(count)]
    if not isinstance(entries, (list, tuple)):
        problems.append(f"{where}: sglang_server_instances expects a list of instances, got {_describe(entries)}")
        return []
    layouts: list[_Layout] = []
    for index, entry in enumerate(entries):
        path = f"sglang_server_instances[{index}]"
        if not isinstance(entry, Mapping):
            problems.append(f"{where}: {path} expects a mapping with name, gpus and port, got {_describe(entry)}")
            continue
        label = f"{where}, instance {entry.get('name', index)}"
        for key in entry:
            if key not in INSTANCE_KEYS:
                close = difflib.get_close_matches(str(key), INSTANCE_KEYS, n=1)
                hint = f"; did you mean {close[0]}?" if close else f"; known keys: {', '.join(INSTANCE_KEYS)}"
                problems.append(f"{label}: {path}.{key} is not an instance key{hint}")
        name = entry.get("name")
        if not isinstance(name, str) or not _INSTANCE_NAME.fullmatch(name):
            problems.append(
                f"{label}: {path}.name expects a name of lowercase letters, digits and '-' "
                f"(starting with a letter or digit), got {_describe(name)}"
            )
            name = f"#{index}"
        gpus = entry.get("gpus")
        gpu_list: list[int] = []
        if not isinstance(gpus, (list, tuple)) or not all(_is_int(g) for g in gpus):
            problems.append(f"{label}: {path}.gpus expects a list of GPU indexes, got {_describe(gpus)}")
        elif not gpus:
            problems.append(f"{label}: {path}.gpus is empty; every instance needs at least one GPU")
        else:
            gpu_list = [int(g) for g in gpus]
            duplicated = sorted({g for g in gpu_list if gpu_list.count(g) > 1})
            if duplicated:
                problems.append(f"{label}: {path}.gpus lists GPU {', '.join(map(str, duplicated))} twice")
        port = entry.get("port")
        if not _is_int(port) or not 1 <= port <= 65535:
            problems.append(f"{label}: {path}.port expects a TCP port number (1-65535), got {_describe(port)}")
            port = -1 - index
        container = entry.get("container", host_container)
        if container is not None and (not _is_int(container) or container <= 0):
            problems.append(
                f"{label}: {path}.container expects a Proxmox container id (a positive integer) or null, "
                f"got {_describe(container)}"
            )
            container = None
        layouts.append(
            _Layout(
                index,
                str(name),
                gpu_list,
                int(port),
                container,
                entry.get("args"),
                entry.get("args_unchecked"),
                entry.get("env"),
            )
        )
    return layouts


def _check_layout(hostname: str, layouts: Sequence[_Layout], gpu_count: int | None, problems: list[str]) -> None:
    where = f"host {hostname}"
    by_name: dict[str, list[_Layout]] = {}
    by_port: dict[int, list[_Layout]] = {}
    by_gpu: dict[int, list[_Layout]] = {}
    for layout in layouts:
        by_name.setdefault(layout.name, []).append(layout)
        if layout.port > 0:
            by_port.setdefault(layout.port, []).append(layout)
        for gpu in dict.fromkeys(layout.gpus):
            by_gpu.setdefault(gpu, []).append(layout)
            if gpu_count is not None and not 0 <= gpu < gpu_count:
                problems.append(
                    f"{where}, instance {layout.name}: {layout.path('gpus')} names GPU {gpu}, but "
                    f"sglang_server_gpu_count is {gpu_count} (GPUs 0-{gpu_count - 1})"
                )
    for name, group in by_name.items():
        if len(group) > 1 and not name.startswith("#"):
            paths = ", ".join(layout.path("name") for layout in group)
            problems.append(f"{where}: instance name {name} is used more than once ({paths}); names must be unique")
    for port, group in sorted(by_port.items()):
        if len(group) > 1:
            names = " and ".join(layout.name for layout in group)
            problems.append(f"{where}: port {port} is used by instances {names}; give each instance its own port")
    for gpu, group in sorted(by_gpu.items()):
        if len(group) > 1:
            names = " and ".join(layout.name for layout in group)
            problems.append(f"{where}: GPU {gpu} is used by instances {names}; an instance needs its GPUs to itself")


def _parallel_problem(layout: _Layout, checked: _Checked, where: str) -> tuple[int, str | None]:
    """tp_size for the instance, and the problem when the parallel sizes do not fit its GPUs."""
    count = len(layout.gpus)
    args = checked.args
    tp = args.get(TP_SIZE)
    dp = args.get("dp_size")
    pp = args.get("pp_size") or 1
    # With DP attention the data-parallel ranks share the tensor-parallel GPUs.
    dp_attention = bool(args.get("enable_dp_attention")) or (args.get("attn_dp_size") or 1) > 1
    replicas = 1 if dp_attention or dp is None else dp
    if layout.index is None:
        gpus_text = f"1 GPU (GPU {layout.gpus[0]} in the default layout)"
    else:
        gpus_text = f"{count} GPU{'s' if count != 1 else ''} ({layout.path('gpus')}: {layout.gpus})"
    if not all(_is_int(v) and v > 0 for v in (tp or 1, replicas, pp)):
        return count, f"{where}: tp_size, dp_size and pp_size must be positive integers"
    if tp is None:
        if count % (replicas * pp):
            origin = checked.origins.get("dp_size") or checked.origins.get("pp_size")
            place = origin.place if origin else where
            return count, f"{place}: {gpus_text} cannot be split into dp_size {replicas} x pp_size {pp}"
        return count // (replicas * pp), None
    if tp * replicas * pp == count:
        return tp, None
    place = checked.origins[TP_SIZE].place
    sizes = (
        f"tp_size {tp}" + (f" x dp_size {replicas}" if replicas > 1 else "") + (f" x pp_size {pp}" if pp > 1 else "")
    )
    if layout.index is None:
        fix = (
            "the default layout runs one single-GPU instance per GPU; list the instances in "
            "sglang_server_instances with the GPUs each one spans"
        )
    else:
        fix = f"tp_size follows the GPU list: drop the key or change {layout.path('gpus')}"
    return tp, f"{place}: {sizes} needs {tp * replicas * pp} GPUs but the instance has {gpus_text}; {fix}"


def resolve_instances(hostname: str, hostvars: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every SGLang instance of one host, fully resolved, from that host's variables.

    Applies the documented defaults, the default layout (one instance per GPU, ``gpu{i}`` on port
    ``sglang_server_base_port + i``) or the explicit ``sglang_server_instances``, merges the
    settings layers (``sglang_server_args`` < ``sglang_server_host_args`` < instance ``args``,
    likewise for env and args_unchecked; null removes) and checks all of it. Returns one dict per
    instance with the keys name, unit, gpus, port, container, version, flag_table, args,
    args_unchecked, argv, env, warnings and fingerprint. Raises :class:`ServerArgsError` listing
    every problem of the host.
    """
    where = f"host {hostname}"
    problems: list[str] = []
    host_warnings: list[str] = []
    table = load_table()

    version = hostvars.get("sglang_server_version")
    table_version = hostvars.get("sglang_server_flag_table_version")
    supported = ", ".join(table.versions)
    if not isinstance(version, str) or not version:
        problems.append(
            f"{where}: sglang_server_version is required: the SGLang release installed, "
            f'as a string such as "{table.versions[-1]}" (supported: {supported})'
        )
        version = None
    if table_version is not None:
        if not isinstance(table_version, str) or not table.supports(table_version):
            problems.append(
                f"{where}: sglang_server_flag_table_version {table_version!r} is not a known flag "
                f"table; use one of {supported}"
            )
            table_version = None
        elif version is not None and table_version != version:
            host_warnings.append(
                f"{where}: SGLang {version} is checked against the flag table of {table_version} "
                "(sglang_server_flag_table_version); flags added, renamed or removed in between are not caught"
            )
    elif version is not None and not table.supports(version):
        problems.append(
            f"{where}: sglang_server_version {version!r} is not supported; supported: {supported}. For a "
            "release in between, set sglang_server_flag_table_version to the nearest supported version "
            "and its flag table is used"
        )
    flag_version: str | None = None
    if table_version is not None:
        flag_version = str(table_version)
    elif version is not None and table.supports(version):
        flag_version = version

    python = _host_scalar(
        hostvars,
        "sglang_server_python",
        DEFAULT_PYTHON,
        where,
        problems,
        lambda v: isinstance(v, str) and v.startswith("/"),
        "an absolute path to a python",
    )
    model_path = hostvars.get("sglang_server_model_path")
    if not isinstance(model_path, str) or not model_path.strip():
        problems.append(
            f"{where}: sglang_server_model_path is required: a Hugging Face repo id or a local path, "
            f"got {_describe(model_path)}"
        )
    served = _host_scalar(
        hostvars,
        "sglang_server_served_model_name",
        None,
        where,
        problems,
        lambda v: isinstance(v, str) and bool(v),
        "a non-empty string",
    )
    listen = _host_scalar(
        hostvars,
        "sglang_server_listen_host",
        DEFAULT_LISTEN_HOST,
        where,
        problems,
        lambda v: isinstance(v, str) and bool(v),
        "an address or host name",
    )
    base_port = _host_scalar(
        hostvars,
        "sglang_server_base_port",
        DEFAULT_BASE_PORT,
        where,
        problems,
        lambda v: _is_int(v) and 1 <= v <= 65535,
        "a TCP port number (1-65535)",
    )
    gpu_count = hostvars.get("sglang_server_gpu_count")
    if not _is_int(gpu_count) or gpu_count < 1:
        problems.append(
            f"{where}: sglang_server_gpu_count is required: the number of GPUs on the host "
            f"(or in its container), got {_describe(gpu_count)}"
        )
        gpu_count = None
    host_container = _host_scalar(
        hostvars,
        "sglang_server_lxc_container",
        None,
        where,
        problems,
        lambda v: _is_int(v) and v > 0,
        "a Proxmox container id (a positive integer)",
    )

    layouts = _instance_layouts(hostname, hostvars, gpu_count, base_port, host_container, problems)
    _check_layout(hostname, layouts, gpu_count, problems)
    if flag_version is None or version is None:
        raise ServerArgsError(problems, subject=f"SGLang settings of host {hostname}")

    resolved = []
    for layout in layouts:
        label = f"{where}, instance {layout.name}"
        layers = [
            (hostvars.get("sglang_server_args"), f"{where}: sglang_server_args"),
            (hostvars.get("sglang_server_host_args"), f"{where}: sglang_server_host_args"),
            (layout.args, f"{label}: {layout.path('args')}"),
        ]
        items = _merge_layers(table, flag_version, layers, problems)
        owned = []
        for item in items:
            name = _resolve_name(table, flag_version, item.key)
            setting = (name.setting if name.status == "setting" else None) or item.key
            if setting in LAYOUT_OWNED:
                problems.append(f"{item.place}: {setting} is set by the instance layout; use {LAYOUT_OWNED[setting]}")
                owned.append(item)
        checked = _check_items(table, flag_version, [i for i in items if i not in owned])
        problems.extend(checked.problems)
        tp, parallel_problem = _parallel_problem(layout, checked, label)
        if parallel_problem:
            problems.append(parallel_problem)

        launch: dict[str, Any] = {
            "model_path": plain(model_path),
            "host": listen,
            "port": layout.port,
            "base_gpu_id": 0,
            TP_SIZE: tp,
        }
        if served is not None:
            launch["served_model_name"] = served
        args = dict(sorted({**checked.args, **launch}.items()))

        env_items = _merge_layers(
            None,
            flag_version,
            [
                (hostvars.get("sglang_server_env"), f"{where}: sglang_server_env"),
                (hostvars.get("sglang_server_host_env"), f"{where}: sglang_server_host_env"),
                (layout.env, f"{label}: {layout.path('env')}"),
            ],
            problems,
        )
        env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in layout.gpus)}
        for item in sorted(env_items, key=lambda i: i.key):
            text = _env_value(item.value)
            if not _ENV_NAME.fullmatch(item.key):
                problems.append(f"{item.place}: '{item.key}' is not a valid environment variable name")
            elif item.key == "CUDA_VISIBLE_DEVICES":
                problems.append(
                    f"{item.place}: CUDA_VISIBLE_DEVICES is set from the instance's gpus; "
                    f"change {layout.path('gpus')} or sglang_server_instances instead"
                )
            elif text is None:
                problems.append(
                    f"{item.place}: environment values must be strings, numbers or booleans, "
                    f"got {_describe(item.value)}"
                )
            else:
                env[item.key] = text
        env = dict(sorted(env.items()))

        unchecked_items = _merge_layers(
            None,
            flag_version,
            [
                (hostvars.get("sglang_server_args_unchecked"), f"{where}: sglang_server_args_unchecked"),
                (layout.args_unchecked, f"{label}: {layout.path('args_unchecked')}"),
            ],
            problems,
        )
        unchecked: dict[str, Any] = {}
        warnings = list(host_warnings) + list(checked.warnings)
        for item in sorted(unchecked_items, key=lambda i: i.key):
            known = _resolve_name(table, flag_version, item.key)
            known_as = known.setting if known.status == "setting" else None
            if not _UNCHECKED_NAME.fullmatch(item.key):
                problems.append(f"{item.place}: '{item.key}' is not a snake_case flag name")
                continue
            if known_as in LAYOUT_OWNED or known_as == TP_SIZE or item.key in LAYOUT_OWNED:
                owner = LAYOUT_OWNED.get(known_as or item.key, f"the instance's gpus ({layout.path('gpus')})")
                problems.append(f"{item.place}: {known_as or item.key} is set by the instance layout; use {owner}")
                continue
            if known_as is not None and known_as in args:
                problems.append(
                    f"{item.place}: {known_as} is also set in args ({checked.origins[known_as].place}); "
                    "keep it in args only"
                )
                continue
            value = plain(item.value)
            if not isinstance(value, (str, int, float, bool, list, dict)):
                problems.append(
                    f"{item.place}: unchecked values must be strings, numbers, booleans, lists or "
                    f"mappings, got {_describe(item.value)}"
                )
                continue
            unchecked[item.key] = value
            words = unchecked_cli_words({item.key: value})
            shown = " ".join(words) if words else "nothing (false)"
            note = (
                f"; SGLang {flag_version} knows this flag as {known_as}, move it to args to have it checked"
                if known_as
                else ""
            )
            warnings.append(f"{label}: {item.place.split(': ', 1)[1]} is passed unchecked as {shown}{note}")

        if problems:
            continue
        argv = [
            str(python),
            "-m",
            LAUNCH_MODULE,
            *render_cli_args(args, flag_version),
            *unchecked_cli_words(unchecked),
        ]
        resolved.append(
            {
                "name": layout.name,
                "unit": f"sglang-{layout.name}.service",
                "gpus": list(layout.gpus),
                "port": layout.port,
                "container": layout.container,
                "version": version,
                "flag_table": flag_version,
                "args": args,
                "args_unchecked": unchecked,
                "argv": argv,
                "env": env,
                "warnings": list(dict.fromkeys(warnings)),
                "fingerprint": fingerprint(version, argv, env),
            }
        )
    if problems:
        raise ServerArgsError(problems, subject=f"SGLang settings of host {hostname}")
    return resolved
