"""The README's Layout names every room of the tree, and only rooms that exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def layout_lines() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    return [line for line in block.splitlines() if line.strip()]


def named_paths() -> set[str]:
    """Paths as the layout spells them: a top-level entry, or a name indented under its folder."""
    paths: set[str] = set()
    parents: list[tuple[int, str]] = []
    for line in layout_lines():
        match = re.match(r"^( *)(\S+)", line)
        assert match
        indent, word = len(match.group(1)), match.group(2).rstrip(",;")
        if indent >= 30:  # a continued description
            continue
        parents = [(i, p) for i, p in parents if i < indent]
        path = (parents[-1][1].rstrip("/") + "/" + word) if parents else word
        paths.add(path.rstrip("/"))
        if word.endswith("/"):
            parents.append((indent, path))
    return paths


def test_every_python_file_under_plugins_is_named() -> None:
    named = named_paths()
    files = {
        str(p.relative_to(REPO))
        for p in (REPO / "plugins").rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    assert sorted(files - named) == []


def test_every_role_and_every_named_path_exists() -> None:
    named = named_paths()
    for role in (REPO / "roles").iterdir():
        assert f"roles/{role.name}" in named, role.name
    missing = [p for p in named if "," not in p and not (REPO / p).exists()]
    assert missing == []
