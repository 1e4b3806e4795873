"""Shared set-up for the collection's unit tests.

``collections/ansible_collections/sglang_ops/fleet`` is a committed symlink to the repository root,
so putting ``collections/`` on sys.path makes ``ansible_collections.sglang_ops.fleet`` importable
from a plain checkout.

The simulated GPU host (``gpusim``, this repository's own test double, not on PyPI) is imported
from its source when it is not installed: ``make venv`` installs it, ``ansible-test units`` installs
only ``tests/unit/requirements.txt``. ``support/`` (``cli_tools``) is put on sys.path.

The ``sglang_argparse`` fixture rebuilds each SGLang version's argparse parser from the flag dumps
vendored in the repository (``tests/doubles/gpusim/src/gpusim/flags/``, dumped from each release's
own parser), independently of the collection's generated flag table. Tests parse rendered argv
with it to prove that the words are ones that version's parser accepts and maps to the intended
settings.
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
FLAG_DUMPS = REPO_ROOT / "tests" / "doubles" / "gpusim" / "src" / "gpusim" / "flags"

if str(COLLECTIONS) not in sys.path:
    sys.path.insert(0, str(COLLECTIONS))
if str(Path(__file__).resolve().parent / "support") not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
try:
    import gpusim  # noqa: F401  # pylint: disable=unused-import
except ModuleNotFoundError:
    # Also for the simulator's own processes (python -m gpusim.admin, the simulated servers).
    _GPUSIM_SRC = str(REPO_ROOT / "tests" / "doubles" / "gpusim" / "src")
    sys.path.insert(0, _GPUSIM_SRC)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_GPUSIM_SRC, os.environ.get("PYTHONPATH")) if p)


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

    # One instance per session; the cache lives as long as the fixture.
    @functools.cache  # noqa: B019  # pylint: disable=method-cache-max-size-none
    def entries(self, version: str) -> dict[str, Any]:
        """The argparse entries of ``version``, as its own parser dumped them."""
        return json.loads((FLAG_DUMPS / f"{version}.json").read_text(encoding="utf-8"))

    @functools.cache  # noqa: B019  # pylint: disable=method-cache-max-size-none
    def parser(self, version: str) -> argparse.ArgumentParser:
        parser = _Parser(prog="sglang serve", add_help=False, argument_default=argparse.SUPPRESS)
        for entry in self.entries(version).values():
            _add_entry(parser, entry)
        return parser

    @functools.cache  # noqa: B019  # pylint: disable=method-cache-max-size-none
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
