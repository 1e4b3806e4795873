"""Every setting of every version renders to words that version's own parser maps back to it.

The parser is rebuilt from the reference argparse dumps (every spelling, deprecated aliases and
SGLang's allow_abbrev prefix matching included), so a word the renderer invents, shortens or takes
from a deprecated alias shows up here as a parse failure or a wrong dest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.checks import ServerArgsError
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.table import (
    BOOLOPT,
    LIST,
    OPTIONAL,
    REJECTED,
    SWITCH,
    Flag,
    load_table,
    supported_versions,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.render import render_cli_args

SCALARS: dict[str, tuple[Any, Any]] = {
    # converter: (value given, value the parser must produce)
    "int": (7, 7),
    "float": (0.25, 0.25),
    "str": ("sample-value", "sample-value"),
    "nullable_str": ("sample-value", "sample-value"),
    "human_readable_int": ("32Ki", 32768),
    "loads": ({"k": [1, "v"], "a": None}, {"k": [1, "v"], "a": None}),
    "json_list_type": ([1, "a", {"b": 2}], [1, "a", {"b": 2}]),
    "parse_cuda_graph_config_arg": ("sample-value", "sample-value"),
    "parse_cuda_graph_backend_arg": ("full", "full"),
}
LIST_ITEMS: dict[str, list[Any]] = {"int": [1, 2], "float": [0.5, 1.5], "str": ["a", "b"]}


def samples(flag: Flag) -> list[tuple[str, Any, Any]]:
    """(label, value to render, value the parser must store) for one setting."""
    if flag.kind == SWITCH:
        return [("true", True, True)]
    if flag.kind == BOOLOPT:
        return [("true", True, True), ("false", False, False)]
    if flag.kind == OPTIONAL:
        return [("bare", True, flag.const), ("value", "sample-value", "sample-value")]
    if flag.kind == LIST:
        items = list(flag.choices[:2]) if flag.choices else LIST_ITEMS.get(flag.type or "str", ["a", "b"])
        return [("list", items, items)]
    if flag.choices:
        return [("choice", flag.choices[-1], flag.choices[-1])]
    given, parsed = SCALARS[flag.type or "str"]
    return [("value", given, parsed)]


CASES = [
    pytest.param(version, name, id=f"{version}-{name}")
    for version in load_table().versions
    for name in load_table().flags(version)
]


@pytest.mark.parametrize(("version", "name"), CASES)
def test_rendered_words_parse_back_to_the_setting(sglang_argparse: Any, version: str, name: str) -> None:
    flag = load_table().flags(version)[name]
    current = sglang_argparse.current_spellings(version)

    if flag.kind == REJECTED:
        with pytest.raises(
            ServerArgsError, match=f"'{name}' is deprecated in SGLang {version} and its parser rejects it"
        ):
            render_cli_args({name: True}, version)
        with pytest.raises(Exception, match="rejected"):
            sglang_argparse.parse(version, [flag.opt])
        return

    for label, value, parsed in samples(flag):
        try:
            words = render_cli_args({name: value}, version)
        except ServerArgsError as exc:
            # Only a deprecated setting without a mechanical replacement may refuse a valid value.
            assert flag.deprecated, f"{label}: {exc}"
            assert f"'{name}'" in str(exc)
            continue
        options = [w.split("=", 1)[0] for w in words if w.startswith("--")]
        assert options, words
        assert all(o in current for o in options), f"{label}: emitted a deprecated or unknown spelling: {words}"
        namespace = sglang_argparse.parse(version, words)
        if flag.deprecated:
            # Replaced by the setting(s) its deprecation names; the deprecated dest itself stays unset.
            assert flag.dest not in namespace or flag.dest in {load_table().flags(version)[n].dest for n in namespace}
            assert namespace, words
        else:
            assert namespace == {flag.dest: parsed}, f"{label}: {words} -> {namespace}"


@pytest.mark.parametrize("version", load_table().versions)
def test_one_argv_with_many_settings_parses_as_a_whole(sglang_argparse: Any, version: str) -> None:
    """Settings rendered together must not swallow each other's words (nargs lists, optional values)."""
    flags = load_table().flags(version)
    chosen: dict[str, Any] = {}
    expected: dict[str, Any] = {}
    for name, flag in flags.items():
        if flag.deprecated:
            continue
        _label, value, parsed = samples(flag)[0]
        chosen[name] = value
        expected[flag.dest] = parsed
    words = render_cli_args(chosen, version)
    assert sglang_argparse.parse(version, words) == expected


def test_every_supported_version_has_its_own_parser_dump(sglang_argparse: Any) -> None:
    """The parsers these tests check against come from each release's own dump, vendored in the
    repository, for exactly the versions the collection supports."""
    flag_dumps = Path(__file__).resolve().parents[4] / "tests" / "doubles" / "gpusim" / "src" / "gpusim" / "flags"
    dumps = {p.stem for p in flag_dumps.glob("0.*.json")}
    assert dumps == set(supported_versions())
    for version in supported_versions():
        assert "--model-path" in sglang_argparse.entries(version)
