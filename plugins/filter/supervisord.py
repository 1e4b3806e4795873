# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Filters that write values into supervisord program files safely, and where its files go."""

from __future__ import annotations

import shlex
from typing import Any

from ansible.errors import AnsibleFilterError

from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.supervisord import (
    directories,
    layout,
    program_name,
)


def supervisord_command(argv: list[Any]) -> str:
    """A ``command=`` value: supervisord expands ``%(name)s`` and splits the rest as a shell would
    (shlex), so each word is shell-quoted and every ``%`` doubled."""
    words = [str(word) for word in argv]
    if any("\n" in word for word in words):
        raise AnsibleFilterError("supervisord_command: a word of a command line cannot hold a newline")
    return shlex.join(words).replace("%", "%%")


def supervisord_environment(env: dict[str, Any]) -> str:
    """An ``environment=`` value: ``KEY="value",...``, each value double-quoted with its quotes and
    backslashes escaped and every ``%`` doubled."""
    pairs = []
    for key, value in sorted(env.items()):
        text = str(value)
        if "\n" in text:
            raise AnsibleFilterError(f"supervisord_environment: the value of {key} cannot hold a newline")
        text = text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
        pairs.append(f'{key}="{text}"')
    return ",".join(pairs)


def supervisord_paths(root: str) -> dict[str, str]:
    """Where supervisord's files go under the supervision root (the host agent's layout)."""
    return layout(str(root))


def supervisord_directories(root: str, services: list[Any]) -> list[dict[str, str]]:
    """The directories under the supervision root, with their modes and owner, and each service's
    working directory (the host agent's layout)."""
    return directories(str(root), [str(s) for s in services])


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "supervisord_command": supervisord_command,
            "supervisord_environment": supervisord_environment,
            "supervisord_directories": supervisord_directories,
            "supervisord_paths": supervisord_paths,
            "supervisord_program": program_name,
        }
