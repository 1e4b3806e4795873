#!/usr/bin/env python3
"""Build plugins/plugin_utils/_flags/sglang_flags.json from the per-version argparse dumps.

The dumps (one ``<version>.json`` per SGLang release, every option of
``python -m sglang.launch_server``) are too large to ship and carry fields the collection never
reads (help text, defaults). This keeps what rendering and validation need:

* per version, one record per setting, keyed by the name ``/server_info`` reports: the spelling
  to emit, its kind (switch, value, list, ...), converter, nargs and choices;
* ``renames``: groups of names that are one setting under different spellings across versions
  (an option alias, a deprecated alias that stores into the new name, or the 0.5.9 parser's long
  ``--tensor-parallel-size`` style dests);
* ``value_maps``: deprecated switches whose replacement is another setting with a value
  (``--disable-piecewise-cuda-graph`` means ``--cuda-graph-backend-prefill=disabled``), read from
  the dumps' ``deprecated_for`` texts.

The dumps live in the simulator's package, ``tests/doubles/gpusim/src/gpusim/flags/`` (its
README says where they come from), the one copy in the repository: add a release there and run
this script. Files in SOURCE_DIR not named ``<version>.json`` (``order.json``) are ignored.

Usage::

    tools/gen_flag_table.py [SOURCE_DIR] [--output FILE] [--check]

``--check`` exits 1 when FILE differs from what SOURCE_DIR produces, and writes nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = REPO_ROOT / "tests" / "doubles" / "gpusim" / "src" / "gpusim" / "flags"
DEFAULT_OUTPUT = REPO_ROOT / "plugins" / "plugin_utils" / "_flags" / "sglang_flags.json"
VERSION_FILE = re.compile(r"\d+\.\d+\.\d+")
FORMAT = 1

_DEPRECATED_VALUE_ACTIONS = frozenset({"DeprecatedStoreConstAction"})
_REJECTING_ACTIONS = frozenset({"DeprecatedAction"})
_SWITCH_ACTIONS = frozenset({"_StoreTrueAction", "DeprecatedStoreTrueAction", "DeprecatedAction"})


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def snake(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def _is_deprecated(entry: Mapping[str, Any]) -> bool:
    return str(entry["action"]).startswith("Deprecated")


def _positive_spellings(entry: Mapping[str, Any]) -> list[str]:
    """Option strings that set the value; BooleanOptionalAction's ``--no-x`` twin is left out."""
    if entry["action"] == "BooleanOptionalAction":
        return [s for s in entry["option_strings"] if not s.startswith("--no-")]
    return list(entry["option_strings"])


class _Groups:
    """Union-find over names, so that chains of renames end up in one group."""

    def __init__(self) -> None:
        self._parent: dict[str, str] = {}

    def find(self, name: str) -> str:
        self._parent.setdefault(name, name)
        root = name
        while self._parent[root] != root:
            root = self._parent[root]
        while self._parent[name] != root:
            self._parent[name], name = root, self._parent[name]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self._parent[max(ra, rb)] = min(ra, rb)

    def groups(self) -> list[list[str]]:
        members: dict[str, list[str]] = {}
        for name in self._parent:
            members.setdefault(self.find(name), []).append(name)
        return sorted(sorted(group) for group in members.values() if len(group) > 1)


def load_sources(source: Path) -> dict[str, dict[str, Any]]:
    files = sorted(
        (p for p in source.glob("*.json") if VERSION_FILE.fullmatch(p.stem)), key=lambda p: version_key(p.stem)
    )
    if not files:
        raise SystemExit(f"no <version>.json files in {source}")
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in files}


def _parse_replacement(text: str) -> tuple[list[str], str | None, str | None]:
    """Split a ``deprecated_for`` text into (options, value, placeholder).

    ``--cuda-graph-backend-{decode,prefill}=disabled`` -> (two options, "disabled", None);
    ``--attn-dp-size <dp-size>`` -> (["--attn-dp-size"], None, "<dp-size>").
    """
    head, _, placeholder = text.partition(" ")
    option, eq, value = head.partition("=")
    match = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", option)
    options = [f"{match[1]}{alt}{match[3]}" for alt in match[2].split(",")] if match else [option]
    return options, (value if eq else None), (placeholder.strip() or None)


def build_table(source: Path) -> dict[str, Any]:
    raw = load_sources(source)
    versions = list(raw)

    groups = _Groups()
    for entries in raw.values():
        for entry in entries.values():
            if entry["action"] in _DEPRECATED_VALUE_ACTIONS or entry["action"] in _REJECTING_ACTIONS:
                continue
            for spelling in _positive_spellings(entry):
                groups.union(snake(spelling), entry["dest"])

    # The name a group carries in the newest release that has it. 0.5.9 stores --tp-size under the
    # dest tensor_parallel_size but its ServerArgs field (and /server_info) says tp_size; this is
    # how that field name is recovered without a hand-written list.
    newest_name: dict[str, str] = {}
    for version in reversed(versions):
        for entry in raw[version].values():
            if not _is_deprecated(entry):
                newest_name.setdefault(groups.find(entry["dest"]), entry["dest"])

    table_versions: dict[str, Any] = {}
    value_maps: dict[str, Any] = {}
    for version in versions:
        flags, maps = _version_flags(version, raw[version], groups, newest_name)
        table_versions[version] = {"flags": flags}
        for name, record in maps.items():
            known = value_maps.get(name)
            if known is None:
                value_maps[name] = {**record, "versions": [version]}
            elif {k: v for k, v in known.items() if k != "versions"} == record:
                known["versions"].append(version)
            else:
                raise SystemExit(f"{name}: replacement changed between versions: {known} vs {record}")

    digests = {version: hashlib.sha256((source / f"{version}.json").read_bytes()).hexdigest() for version in versions}
    return {
        "format": FORMAT,
        "sources": digests,
        "renames": groups.groups(),
        "value_maps": dict(sorted(value_maps.items())),
        "versions": table_versions,
    }


def _version_flags(
    version: str, entries: Mapping[str, Any], groups: _Groups, newest_name: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    by_dest: dict[str, list[Mapping[str, Any]]] = {}
    for entry in entries.values():
        by_dest.setdefault(entry["dest"], []).append(entry)
    option_dest = {s: e["dest"] for e in entries.values() for s in e["option_strings"]}

    def field_name(dest: str) -> str:
        spelled = {snake(s) for e in by_dest[dest] if not _is_deprecated(e) for s in _positive_spellings(e)}
        newest = newest_name.get(groups.find(dest), dest)
        return newest if newest in spelled else dest

    fields = {dest: field_name(dest) for dest in by_dest}
    flags: dict[str, Any] = {}
    maps: dict[str, Any] = {}
    for dest, dest_entries in by_dest.items():
        current = [e for e in dest_entries if not _is_deprecated(e)]
        aliases = [e for e in dest_entries if _is_deprecated(e) and e["action"] not in _DEPRECATED_VALUE_ACTIONS]
        for entry in dest_entries:
            record = _value_map(entry, entries, option_dest, fields)
            if record is not None:
                maps[snake(entry["option_strings"][0])] = record
        if len(current) > 1:
            raise SystemExit(f"{version}: {dest} has several non-deprecated options: {current}")
        if current:
            primary = current[0]
            extra: dict[str, Any] = {"deprecated_aliases": sorted(s for e in aliases for s in e["option_strings"])}
        else:
            own = [e for e in aliases if snake(e["option_strings"][0]) == dest]
            primary = (own or aliases or dest_entries)[0]
            if primary["action"] in _DEPRECATED_VALUE_ACTIONS:
                continue
            extra = {"deprecated_for": primary["deprecated_for"] or ""}
            others = sorted(s for e in aliases if e is not primary for s in e["option_strings"])
            if others:
                extra["deprecated_aliases"] = others
        record = _flag_record(primary)
        record.update({k: v for k, v in extra.items() if v})
        if fields[dest] != dest:
            record["dest"] = dest
        flags[fields[dest]] = record
    return dict(sorted(flags.items())), maps


def _flag_record(entry: Mapping[str, Any]) -> dict[str, Any]:
    spellings = _positive_spellings(entry)
    record: dict[str, Any] = {"opt": spellings[0]}
    action, nargs = entry["action"], entry["nargs"]
    if action in _REJECTING_ACTIONS:
        record["kind"] = "rejected"
    elif action in _SWITCH_ACTIONS:
        record["kind"] = "switch"
    elif action == "BooleanOptionalAction":
        record["kind"] = "boolopt"
        record["no"] = next(s for s in entry["option_strings"] if s.startswith("--no-"))
    elif nargs in ("+", "*"):
        record["kind"] = "list"
        record["nargs"] = nargs
    elif nargs == "?":
        record["kind"] = "optional"
        record["const"] = entry["const"]
    elif nargs is None:
        record["kind"] = "value"
    else:
        raise SystemExit(f"{spellings[0]}: unsupported nargs {nargs!r} with action {action}")
    if record["kind"] in ("list", "optional", "value"):
        record["type"] = entry["type"] or "str"
        if entry["choices"]:
            record["choices"] = entry["choices"]
    if len(spellings) > 1:
        record["aliases"] = spellings[1:]
    return record


def _value_map(
    entry: Mapping[str, Any],
    entries: Mapping[str, Any],
    option_dest: Mapping[str, str],
    fields: Mapping[str, str],
) -> dict[str, Any] | None:
    """The ``{setting: value}`` a deprecated option stands for, when its text names one."""
    text = entry["deprecated_for"]
    if not text or not _is_deprecated(entry):
        return None
    options, value, placeholder = _parse_replacement(text)
    if any(option not in option_dest for option in options):
        return None
    targets: dict[str, Any] = {}
    for option in options:
        target = next(e for e in entries.values() if option in e["option_strings"])
        name = fields[option_dest[option]]
        if value is not None:
            targets[name] = value
        elif placeholder is not None:
            targets[name] = placeholder
        elif target["nargs"] == 0 and target["action"] in _SWITCH_ACTIONS:
            targets[name] = True
        else:
            # A value-taking option renamed in place is a rename; one whose values mean something
            # else (--dsa-prefill-cp-mode vs --cp-strategy) has no mechanical replacement.
            return None
    if option_dest[options[0]] == entry["dest"] and entry["action"] not in _DEPRECATED_VALUE_ACTIONS:
        return None
    record: dict[str, Any] = {"replacement": text, "targets": targets}
    if entry["nargs"] == 0:
        record["source"] = "switch"
    else:
        record["source"] = "value"
        if entry["choices"]:
            record["source_choices"] = entry["choices"]
    return record


def dump_table(table: Mapping[str, Any]) -> str:
    """Serialise with one flag per line: small diffs when a dump is regenerated."""

    def one(value: Any) -> str:
        return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))

    def block(items: Iterable[tuple[str, Any]], indent: str) -> str:
        lines = [f"{indent}{json.dumps(key)}: {one(value)}" for key, value in items]
        return "{\n" + ",\n".join(lines) + "\n" + indent[:-2] + "}"

    parts = [
        f'  "format": {one(table["format"])}',
        f'  "sources": {block(table["sources"].items(), "    ")}',
        '  "renames": [\n' + ",\n".join(f"    {one(group)}" for group in table["renames"]) + "\n  ]",
        f'  "value_maps": {block(table["value_maps"].items(), "    ")}',
    ]
    version_blocks = [
        f'    {json.dumps(version)}: {{\n      "flags": {block(data["flags"].items(), "        ")}\n    }}'
        for version, data in table["versions"].items()
    ]
    parts.append('  "versions": {\n' + ",\n".join(version_blocks) + "\n  }")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("source", nargs="?", type=Path, default=DEFAULT_SOURCE)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = dump_table(build_table(args.source))
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale; run tools/gen_flag_table.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
