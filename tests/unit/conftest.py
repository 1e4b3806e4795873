"""Shared set-up for the collection's unit tests.

``collections/ansible_collections/sglang_ops/fleet`` is a committed symlink to the repository root,
so putting ``collections/`` on sys.path makes ``ansible_collections.sglang_ops.fleet`` importable
from a plain checkout.

The ``sglang_argparse`` fixture rebuilds each SGLang version's argparse parser from the reference
dumps (``$SGLANG_FLAGS_DIR``, default /work/shared/reference/sglang-flags) or, where those are not
reachable (CI), from the committed flag table. Tests parse rendered argv with it to prove that the
words are ones that version's parser accepts and maps to the intended settings.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
COLLECTIONS = REPO_ROOT / "collections"
REFERENCE_FLAGS = Path(os.environ.get("SGLANG_FLAGS_DIR", "/work/shared/reference/sglang-flags"))

if str(COLLECTIONS) not in sys.path:
    sys.path.insert(0, str(COLLECTIONS))


def reference_available() -> bool:
    return REFERENCE_FLAGS.is_dir() and any(REFERENCE_FLAGS.glob("*.json"))


def _human_readable_int(text: str) -> int:
    # Written from SGLang's documented behaviour, independently of the collection's own parser.
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", text.strip())
    if match:
        number, suffix = match.groups()
        iec = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
        si = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
        if suffix in iec:
            if "." in number:
                raise argparse.ArgumentTypeError("decimals are not allowed with IEC suffixes")
            return int(number) * iec[suffix]
        return int(Decimal(number) * si[suffix])
    return int(text)


def _nullable_str(text: str) -> str | None:
    return None if text in ("", "None") else text


CONVERTERS: Mapping[str | None, Any] = {
    None: str,
    "str": str,
    "int": int,
    "float": float,
    "human_readable_int": _human_readable_int,
    "loads": json.loads,
    "json_list_type": json.loads,
    "nullable_str": _nullable_str,
    "parse_cuda_graph_backend_arg": str,
    "parse_cuda_graph_config_arg": str,
}


class _Rejecting(argparse.Action):
    """SGLang's DeprecatedAction: giving the flag at all is an error."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs["nargs"] = 0
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        raise argparse.ArgumentError(self, "deprecated and rejected")


class ParseFailed(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # type: ignore[override]
        raise ParseFailed(message)


def _add_entry(parser: argparse.ArgumentParser, entry: Mapping[str, Any]) -> None:
    action = entry["action"]
    options = list(entry["option_strings"])
    kwargs: dict[str, Any] = {"dest": entry["dest"]}
    if action in ("_StoreTrueAction", "DeprecatedStoreTrueAction"):
        kwargs["action"] = "store_true"
    elif action == "BooleanOptionalAction":
        kwargs["action"] = argparse.BooleanOptionalAction
        options = [o for o in options if not o.startswith("--no-")]
    elif action == "DeprecatedAction":
        kwargs["action"] = _Rejecting
    elif action == "DeprecatedStoreConstAction" and entry["nargs"] == 0:
        replacement = entry.get("deprecated_for") or ""
        kwargs.update(action="store_const", const=replacement.partition("=")[2] or True)
    else:
        kwargs["type"] = CONVERTERS.get(entry["type"], str)
        if entry["nargs"] is not None:
            kwargs["nargs"] = entry["nargs"]
        if entry["nargs"] == "?":
            kwargs["const"] = entry["const"]
        if entry["choices"]:
            kwargs["choices"] = entry["choices"]
    parser.add_argument(*options, **kwargs)


class SGLangArgparse:
    """Per-version parsers like SGLang's (allow_abbrev on, every spelling and alias present)."""

    def __init__(self) -> None:
        self.source = "reference dumps" if reference_available() else "committed flag table"

    @functools.cache  # noqa: B019 - one instance per session; the cache lives as long as the fixture
    def entries(self, version: str) -> dict[str, Any]:
        """The argparse entries of ``version``, in the reference dump format."""
        if reference_available():
            return json.loads((REFERENCE_FLAGS / f"{version}.json").read_text(encoding="utf-8"))
        # Imported here: the collection is importable only once this conftest has extended sys.path.
        from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flag_table import load_table  # noqa: PLC0415

        entries: dict[str, Any] = {}
        for flag in load_table().flags(version).values():
            base = {
                "dest": flag.dest,
                "type": flag.type,
                "nargs": flag.nargs if flag.kind == "list" else ("?" if flag.kind == "optional" else None),
                "choices": list(flag.choices) if flag.choices else None,
                "const": flag.const,
                "deprecated_for": flag.deprecated_for,
            }
            action = {"switch": "_StoreTrueAction", "boolopt": "BooleanOptionalAction", "rejected": "DeprecatedAction"}
            spellings = [flag.opt, *flag.aliases, *([flag.no_opt] if flag.no_opt else [])]
            kind_action = action.get(flag.kind, "_StoreAction")
            if flag.deprecated_for is not None and kind_action == "_StoreTrueAction":
                kind_action = "DeprecatedStoreTrueAction"
            entries[flag.opt] = {**base, "action": kind_action, "option_strings": spellings}
            for alias in flag.deprecated_aliases:
                alias_action = "DeprecatedStoreTrueAction" if flag.kind == "switch" else "DeprecatedAliasStoreAction"
                entries[alias] = {**base, "action": alias_action, "option_strings": [alias], "choices": None}
        return entries

    @functools.cache  # noqa: B019
    def parser(self, version: str) -> argparse.ArgumentParser:
        parser = _Parser(prog="sglang serve", add_help=False, argument_default=argparse.SUPPRESS)
        for entry in self.entries(version).values():
            _add_entry(parser, entry)
        return parser

    @functools.cache  # noqa: B019
    def current_spellings(self, version: str) -> frozenset[str]:
        """Option strings of ``version`` that are not deprecated."""
        return frozenset(
            spelling
            for entry in self.entries(version).values()
            if not str(entry["action"]).startswith("Deprecated")
            for spelling in entry["option_strings"]
        )

    def parse(self, version: str, words: list[str]) -> dict[str, Any]:
        """Parse argv words with ``version``'s parser; ParseFailed when it would exit with status 2."""
        try:
            return vars(self.parser(version).parse_args(words))
        except argparse.ArgumentError as exc:
            raise ParseFailed(str(exc)) from exc


@pytest.fixture(scope="session")
def sglang_argparse() -> SGLangArgparse:
    return SGLangArgparse()
