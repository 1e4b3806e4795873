# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Filters that write values into systemd unit files safely."""

from __future__ import annotations

import re
from typing import Any

_SUBSTITUTION = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")
_NEEDS_QUOTES = re.compile(r"[\s\"'\\;]")


def systemd_exec_word(word: Any) -> str:
    text = str(word)
    if _SUBSTITUTION.fullmatch(text):
        return text
    text = text.replace("%", "%%").replace("$", "$$")
    if text == "" or _NEEDS_QUOTES.search(text):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def systemd_exec_lines(argv: list[Any]) -> list[str]:
    """ExecStart= words grouped one flag (with its values) per line: the command first, then a
    line at each word that starts with ``--``."""
    lines: list[list[str]] = []
    for word in argv:
        text = str(word)
        if not lines or text.startswith("--"):
            lines.append([])
        lines[-1].append(systemd_exec_word(text))
    return [" ".join(words) for words in lines]


def systemd_env_assignment(key: str, value: Any) -> str:
    """``Environment="KEY=value"`` with the value escaped; systemd expands specifiers here."""
    text = f"{key}={value}".replace("%", "%%").replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "systemd_exec_word": systemd_exec_word,
            "systemd_exec_lines": systemd_exec_lines,
            "systemd_env_assignment": systemd_env_assignment,
        }
