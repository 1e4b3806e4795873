# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Filters that write values into systemd unit files safely."""

from __future__ import annotations

import re
from typing import Any

DOCUMENTATION = r"""
name: systemd_exec_word
short_description: Quote one word of a systemd ExecStart= command line
version_added: 0.1.0
author: sglang-fleet contributors
description:
  - Escapes C(%) (unit specifiers) and C($) (environment substitution) and double-quotes the word
    when it holds whitespace, quotes or backslashes, so that systemd passes it to the program
    exactly as given.
  - A word that is exactly C(${NAME}) is kept as a substitution, on purpose, for values taken from
    an EnvironmentFile.
positional: _input
options:
  _input:
    description: The word.
    type: str
    required: true
"""

EXAMPLES = r"""
- name: One flag per line
  ansible.builtin.debug:
    msg: "{{ ['--served-model-name', 'my model'] | map('sglang_ops.fleet.systemd_exec_word') | join(' ') }}"
"""

RETURN = r"""
_value:
  description: The word, escaped for ExecStart=.
  type: str
"""

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
