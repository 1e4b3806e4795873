"""Rendering: checked settings as the words and values a launched SGLang server is given.

:func:`render_cli_args` writes settings as argv words in the spelling one version accepts;
:func:`unchecked_cli_words` writes unchecked flags verbatim; :func:`env_value` writes one
environment value; :func:`fingerprint` digests what makes a running instance what it is; and
:func:`expected_server_info` says what ``/server_info`` of that version must report for the
settings given.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.checks import validate_args
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.table import (
    BOOLOPT,
    LIST,
    OPTIONAL,
    SWITCH,
    Flag,
    load_table,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.values import (
    JSON_TYPES,
    NEGATIVE_NUMBER,
    plain,
)

LAUNCH_MODULE = "sglang.launch_server"

# /server_info reports some values in another form than the flag took them.
SERVER_INFO_REWRITES: Sequence[tuple[str, Any, Any, tuple[str, ...]]] = (
    # (setting, value given, value reported, versions): 0.5.9 rewrites NEXTN in _handle_speculative_decoding.
    ("speculative_algorithm", "NEXTN", "EAGLE", ("0.5.9",)),
)
# Explicit values SGLang replaces at start-up (0.5.23 reports resolved values), so they are not compared.
RESOLVED_AT_STARTUP: frozenset[str] = frozenset({"auto"})
# Settings whose /server_info shape differs from the flag's (parsed into objects), never compared.
NOT_ECHOED: frozenset[str] = frozenset({"lora_paths", "cuda_graph_config"})


def _format_value(flag: Flag, value: Any) -> str:
    if flag.type in JSON_TYPES or isinstance(value, (Mapping, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _with_value(opt: str, word: str) -> list[str]:
    # A value that looks like an option would be taken for one; the --opt=value form cannot be.
    if word.startswith("-") and not NEGATIVE_NUMBER.match(word):
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
        if isinstance(shown, Mapping) and flag.type not in JSON_TYPES:
            # A text flag keeps the JSON string it was given.
            shown = _format_value(flag, shown)
        for setting, given, reported, versions in SERVER_INFO_REWRITES:
            if name == setting and shown == given and version in versions:
                shown = reported
        expected[name] = shown
    return expected


def fingerprint(version: str, argv: Sequence[str], env: Mapping[str, str]) -> str:
    """sha256 of the canonical JSON of what makes a running instance what it is."""
    canonical = json.dumps(
        {"version": version, "argv": list(argv), "env": dict(env)},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def env_value(value: Any) -> str | None:
    """``value`` as an environment value (booleans as 1/0), None when it cannot be one."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, str):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    return None
