"""The part of the advisor's patch a kept trial proved, written into the inventory files themselves.

The patch names its layer per host (``host_vars/<host>.yml``: ``sglang_server_host_args`` or
``sglang_server_instances``, the whole variable, as Ansible replaces a dict or list variable).
Here it becomes an edit of the file of that layer in the inventory directory, made with a
round-trip YAML editor (ruamel.yaml): comments, key order, quoting and flow style of every line
the patch does not change are kept, and a mapping or a list of named instances is updated in
place (changed keys set, new keys added at the end, removed keys dropped) rather than replaced.

Everything is checked before anything is written (``plan_edits`` returns the new texts and
writes nothing): the layer is ``host_vars`` or ``group_vars``, the name is a plain file name,
the file is not vault-encrypted and not defined in several files of a directory, its values
touched are not vault-encrypted, and the file reads back exactly as it is when nothing changes
(else the rewrite would reformat lines the patch does not touch: it is refused, to edit by hand).
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError

LAYERS = ("host_vars", "group_vars")
HOST_ARGS = "sglang_server_host_args"
INSTANCES = "sglang_server_instances"
EXTENSIONS = (".yml", ".yaml", "")
# (mapping, sequence, offset) indents tried, the first that reads the file back unchanged wins.
INDENTS = ((2, 2, 0), (2, 4, 2), (4, 4, 0), (4, 6, 4), (4, 4, 2))
VAULT_HEADER = "$ANSIBLE_VAULT"
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class InventoryEditError(Exception):
    """The patch cannot be written where it says (nothing was written)."""


@dataclass(frozen=True)
class FileEdit:
    """One inventory file's new text (``before`` None: the file is new)."""

    path: Path
    layer: str
    name: str
    variables: tuple[str, ...]
    before: str | None
    after: str


def inventory_dir(inventory: Path) -> Path:
    """Where host_vars/ and group_vars/ of an inventory are: the directory, or the file's own."""
    return inventory if inventory.is_dir() else inventory.parent


def proven_variables(report: Mapping[str, Any], instances: Sequence[str]) -> dict[tuple[str, str], dict[str, Any]]:
    """``{("host_vars", host): {variable: value}}``: the report's patch for the hosts of the
    instances tried, limited to them. A host's ``sglang_server_host_args`` is taken when every
    instance of the host was tried; otherwise its ``sglang_server_instances`` with the tried
    instances' args with the proposal (``args_after``) and the others as the inventory has them."""
    patch_hosts = (report.get("patch") or {}).get("host_vars") or {}
    layouts = report.get("layouts") or {}
    after = {f"{i.get('host')}/{i.get('name')}": i.get("args_after") for i in report.get("instances") or []}
    tried: dict[str, set[str]] = {}
    for key in instances:
        host, _, name = str(key).rpartition("/")
        tried.setdefault(host, set()).add(name)
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for host, names in sorted(tried.items()):
        entry = patch_hosts.get(host) or {}
        layout = [dict(e) for e in layouts.get(host) or []]
        on_host = {str(e.get("name")) for e in layout}
        if HOST_ARGS in entry and (not layout or on_host <= names):
            out[("host_vars", host)] = {HOST_ARGS: entry[HOST_ARGS]}
            continue
        if not layout:
            raise InventoryEditError(f"the report has no patch and no instance layout of host {host}")
        for e in layout:
            name = str(e.get("name"))
            if name in names:
                new = after.get(f"{host}/{name}")
                if not isinstance(new, Mapping):
                    raise InventoryEditError(f"the report has no args with the proposal for {host}/{name}")
                e["args"] = dict(new)
        out[("host_vars", host)] = {INSTANCES: layout}
    return out


def _yaml(indent: tuple[int, int, int], explicit_start: bool) -> YAML:
    y = YAML()
    y.preserve_quotes = True
    y.width = 4096
    y.indent(mapping=indent[0], sequence=indent[1], offset=indent[2])
    y.explicit_start = explicit_start
    return y


def _dump(y: YAML, data: Any) -> str:
    buf = io.StringIO()
    y.dump(data, buf)
    return buf.getvalue()


def _load_faithfully(path: Path, text: str) -> tuple[YAML, Any]:
    """The file's data and the editor that writes it back exactly as it is."""
    if text.lstrip().startswith(VAULT_HEADER):
        raise InventoryEditError(f"{path} is vault-encrypted: the patch cannot be written into it")
    explicit = text.lstrip().startswith("---")
    for indent in INDENTS:
        y = _yaml(indent, explicit)
        try:
            data = y.load(text)
        except YAMLError as exc:
            raise InventoryEditError(f"{path} is not valid YAML: {exc}") from exc
        if data is None:
            return y, CommentedMap()
        if not isinstance(data, CommentedMap):
            raise InventoryEditError(f"{path} is not a mapping of variables")
        if _dump(y, data) == text:
            return y, data
    raise InventoryEditError(
        f"{path} would not be written back as it is (its indentation or line style): rewriting it would change "
        "lines the patch does not touch; copy the patch into it by hand"
    )


def _vaulted(value: Any) -> bool:
    tag = getattr(getattr(value, "tag", None), "value", None)
    return tag == "!vault"


def _named_list(value: Any) -> list[str] | None:
    if not isinstance(value, list) or not all(isinstance(e, Mapping) and "name" in e for e in value):
        return None
    return [str(e["name"]) for e in value]


def update_in_place(container: Any, key: Any, new: Any) -> None:
    """``container[key] = new``, keeping what ruamel.yaml holds of the old value (its comments,
    order, quoting) where the old and new values share their shape."""
    old = container[key] if _has(container, key) else None
    if old is not None and _plain(old) == _plain(new):
        return
    if isinstance(old, CommentedMap) and isinstance(new, Mapping):
        for k in [k for k in old if k not in new]:
            del old[k]
        for k, v in new.items():
            if k in old:
                update_in_place(old, k, v)
            else:
                _append(old, k, v)
        return
    same_names = _named_list(old) is not None and _named_list(old) == _named_list(new)
    if isinstance(old, CommentedSeq) and isinstance(new, list) and (same_names or len(old) == len(new)):
        for i, entry in enumerate(new):
            update_in_place(old, i, entry)
        return
    container[key] = new


def _has(container: Any, key: Any) -> bool:
    if isinstance(container, Mapping):
        return key in container
    return isinstance(container, list) and isinstance(key, int) and 0 <= key < len(container)


def _append(mapping: CommentedMap, key: Any, value: Any) -> None:
    """A new key at the end of ``mapping``. The comment lines below its last key (ruamel.yaml keeps
    them with that key: often the comment of what follows the mapping) move below the new key."""
    last = next(reversed(mapping), None) if len(mapping) else None
    token = mapping.ca.items.get(last, [None] * 4)[2] if last is not None else None
    mapping[key] = value
    if token is None or "\n" not in token.value.rstrip("\n"):
        return
    eol, rest = token.value.split("\n", 1)
    token.value = eol + "\n"
    holder, at = mapping, key
    while isinstance(holder[at], Mapping) and len(holder[at]):
        if not isinstance(holder[at], CommentedMap):
            holder[at] = CommentedMap(holder[at])
        holder, at = holder[at], next(reversed(holder[at]))
    if isinstance(holder[at], list):
        holder[at] = CommentedSeq(holder[at])
        holder, at = holder[at], len(holder[at]) - 1
    holder.yaml_add_eol_comment("\n" + rest.rstrip("\n"), at, column=0)
    # yaml_add_eol_comment writes "# " before the text: the lines are comments already.
    added = holder.ca.items[at][2]
    added.value = "\n" + rest


def _plain(value: Any) -> Any:
    """A value as plain data (a quoted string as its text), to compare old and new."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _candidates(base: Path, layer: str, name: str) -> tuple[list[Path], Path]:
    """The files of one layer's name that exist, and the file a new variable goes in."""
    files = [base / layer / f"{name}{ext}" for ext in EXTENSIONS if (base / layer / f"{name}{ext}").is_file()]
    folder = base / layer / name
    if folder.is_dir():
        files += sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".yml", ".yaml", ""))
        default = folder / "main.yml"
    else:
        default = base / layer / f"{name}.yml"
    return files, (files[0] if len(files) == 1 else default)


def plan_edits(inventory: Path, variables: Mapping[tuple[str, str], Mapping[str, Any]]) -> list[FileEdit]:
    """The new text of each file the variables go in; nothing is written. Raises
    InventoryEditError for a layer or a file the patch cannot be written into."""
    base = inventory_dir(inventory)
    if not base.is_dir():
        raise InventoryEditError(f"the inventory {inventory} is not in a directory here")
    edits = []
    for (layer, name), values in variables.items():
        if layer not in LAYERS:
            raise InventoryEditError(f"the patch names the layer {layer!r}: only {' and '.join(LAYERS)} are written")
        if not NAME.match(name) or name in (".", ".."):
            raise InventoryEditError(f"{layer}/{name}: not a host or group name a file can have")
        files, target = _candidates(base, layer, name)
        holders = []
        for path in files:
            _y, data = _load_faithfully(path, path.read_text(encoding="utf-8"))
            if set(values) & set(data):
                holders.append(path)
        if len(holders) > 1:
            raise InventoryEditError(
                f"{layer}/{name}: {', '.join(sorted(set(values)))} defined in several files "
                f"({', '.join(str(p) for p in holders)}): say which one by hand"
            )
        target = holders[0] if holders else target
        before = target.read_text(encoding="utf-8") if target.is_file() else None
        y, data = _load_faithfully(target, before) if before is not None else (_yaml(INDENTS[0], True), CommentedMap())
        for variable, value in values.items():
            if _vaulted(data.get(variable)):
                raise InventoryEditError(f"{target}: {variable} is vault-encrypted: the patch cannot replace it")
            update_in_place(data, variable, value)
        after = _dump(y, data)
        if after != before:
            edits.append(FileEdit(target, layer, name, tuple(values), before, after))
    return edits


def write_edits(edits: Sequence[FileEdit]) -> list[Path]:
    """Write each edit (its directory made where missing); the paths written."""
    for edit in edits:
        edit.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = edit.path.with_name(edit.path.name + ".tmp")
        tmp.write_text(edit.after, encoding="utf-8")
        tmp.replace(edit.path)
    return [e.path for e in edits]
