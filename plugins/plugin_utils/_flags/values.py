"""Flag values: whether one value fits one flag of one SGLang version, and in which form.

:func:`convert` normalises a value for a flag (switches, lists, integers, sizes such as ``200k``,
numbers, JSON-typed flags, text) or returns :class:`Bad` with the reason; it checks the flag's
choices and the values a release's own type converter refuses (:data:`CONVERTER_REFUSALS`),
naming the releases that would accept the value. :func:`describe` says what a value is in
messages; :func:`plain` copies a value into builtin types.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, NamedTuple

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.table import (
    BOOLOPT,
    LIST,
    OPTIONAL,
    SWITCH,
    Flag,
    FlagTable,
)

# Values a release's own type converter refuses before argparse looks at the choices, keyed by the
# converter's name in the flag table: (converter, value) -> the converter's error text. From 0.5.22
# parse_cuda_graph_backend_arg refuses tc_piecewise for --cuda-graph-backend-{decode,prefill}; the
# argparse dumps show only the converter's name (see the flag dumps' README).
CONVERTER_REFUSALS: Mapping[tuple[str, str], str] = {
    ("parse_cuda_graph_backend_arg", "tc_piecewise"): "tc_piecewise was removed; select breakable, full, or disabled",
}

_INT_TEXT = re.compile(r"[+-]?\d+")
_FLOAT_TEXT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")
_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
# argparse's own test for "this word is a negative number, not an option".
NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
YAML_BOOL_WORDS = frozenset({"true", "false", "yes", "no", "on", "off"})
JSON_TYPES = frozenset({"loads", "json_list_type"})

_TYPE_WORDS: Mapping[str, str] = {
    "int": "an integer",
    "float": "a number",
    "human_readable_int": "an integer or a size such as 200k or 32Ki",
    "loads": "a mapping (or a JSON string)",
    "json_list_type": "a list (or a JSON string holding one)",
    "parse_cuda_graph_config_arg": "a string or a mapping",
}


class Bad(NamedTuple):
    """Why a value cannot be passed (a message without the place it was written)."""

    message: str


def describe(value: Any) -> str:
    """What ``value`` is, in words, for messages."""
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


# Complexity checked by people: one branch per argparse type of the flag table.
def _scalar(flag: Flag, value: Any) -> Any:  # noqa: PLR0912
    """Normalise one value of ``flag``'s type, or return Bad."""
    kind = flag.type or "str"
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, str) and _INT_TEXT.fullmatch(value.strip()):
            return int(value)
        if isinstance(value, str) and _HUMAN_INT.fullmatch(value.strip()):
            return Bad(
                f"expects an integer, got {describe(value)} (sizes such as 200k are only "
                "accepted by flags that take them, from SGLang 0.5.10 on)"
            )
        return Bad(f"expects an integer, got {describe(value)}")
    if kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                return Bad(f"expects a finite number, got {value!r}")
            return plain(value)
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            return float(value)
        return Bad(f"expects a number, got {describe(value)}")
    if kind == "human_readable_int":
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, str):
            try:
                return parse_human_readable_int(value)
            except (ValueError, InvalidOperation) as exc:
                return Bad(f"expects {_TYPE_WORDS[kind]}: {exc}")
        return Bad(f"expects {_TYPE_WORDS[kind]}, got {describe(value)}")
    if kind in JSON_TYPES:
        parsed = value
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except ValueError as exc:
                return Bad(f"expects {_TYPE_WORDS[kind]}; the string is not JSON ({exc})")
        if kind == "json_list_type" and not isinstance(parsed, (list, tuple)):
            return Bad(f"expects {_TYPE_WORDS[kind]}, got {describe(value)}")
        try:
            json.dumps(plain(parsed))
        except (TypeError, ValueError):
            return Bad(f"expects {_TYPE_WORDS[kind]}, got {describe(value)} that is not JSON-serialisable")
        return plain(parsed)
    if isinstance(value, Mapping):
        # Text flags such as --json-model-override-args take JSON; a mapping is passed as compact JSON.
        try:
            json.dumps(plain(value))
        except (TypeError, ValueError):
            return Bad(f"expects a string, got {describe(value)} that is not JSON-serialisable")
        return plain(value)
    # str, nullable_str, parse_cuda_graph_backend_arg and any other converter taking text.
    if isinstance(value, bool):
        return Bad(
            f"expects a string, got {describe(value)} (YAML reads unquoted yes/no/on/off/true/false "
            "as booleans; quote the value)"
        )
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (int, float)):
        return str(value)
    return Bad(f"expects {_TYPE_WORDS.get(kind, 'a string')}, got {describe(value)}")


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
        if flag.choices is None:
            raise AssertionError("only a flag with choices gets here")
        text = (
            f"{value!r} is not a valid choice for {flag.opt} on SGLang {version}; "
            f"choose one of: {', '.join(str(c) for c in flag.choices)}"
        )
    if elsewhere:
        text += f" ({value!r} is accepted by SGLang {', '.join(elsewhere)})"
    return text


def convert(table: FlagTable, version: str, flag: Flag, value: Any) -> Any:
    """Normalise ``value`` for ``flag`` on ``version``; Bad(message) when it cannot be passed."""
    where = f"{flag.opt} on SGLang {version}"
    if flag.kind in (SWITCH, BOOLOPT):
        if isinstance(value, bool):
            return value
        hint = ""
        if isinstance(value, str) and value.strip().lower() in YAML_BOOL_WORDS:
            hint = " (write true or false without quotes; strings are not converted)"
        return Bad(f"{where} is a switch and expects true or false, got {describe(value)}{hint}")
    if flag.kind == OPTIONAL and isinstance(value, bool):
        return value
    if flag.kind == LIST:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if not items and flag.nargs == "+":
            return Bad(f"{where} expects at least one value, got an empty list")
        normalized = []
        for item in items:
            converted = _scalar(flag, item)
            if isinstance(converted, Bad):
                return Bad(f"{where}: each list item {converted.message}")
            if isinstance(converted, str) and converted.startswith("-") and not NEGATIVE_NUMBER.match(converted):
                return Bad(f"{where}: list item {converted!r} starts with '-' and would be read as an option")
            problem = _choice_problem(table, version, flag, converted)
            if problem:
                return Bad(problem)
            normalized.append(converted)
        return normalized
    if isinstance(value, (list, tuple)) and flag.type not in JSON_TYPES:
        return Bad(f"{where} takes one value, got a list")
    converted = _scalar(flag, value)
    if isinstance(converted, Bad):
        return Bad(f"{where} {converted.message}")
    problem = _choice_problem(table, version, flag, converted)
    return Bad(problem) if problem else converted
