# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The API key of a generation client against the servers' own, on the host.

The servers' key is ``SGLANG_API_KEY`` of the server role's secrets file (``Host.api_key``). A
client's is ``SGLANG_API_KEY`` of its unit's environment file, which the generation role writes
(root-only) with ``SGLANG_FLEET_API_KEY_FOLLOWS=servers`` when the client's key is the servers'
(``generation_api_key`` left to its default) and ``=own`` when it is set apart. A retune hands the
servers' key to a client that follows them, with the resume of each wave's endpoints (its control
socket) and in its environment file (for its next start), so a key rotation never locks the client
out; a client whose key is its own and is not the servers' cannot reach a relaunched server, which
the retune refuses before it stops anything. No key ever leaves the host: only whether they match.
"""

from __future__ import annotations

from typing import Any

from .evidence import read_env_file
from .host import Host

KEY_VAR = "SGLANG_API_KEY"
FOLLOWS_VAR = "SGLANG_FLEET_API_KEY_FOLLOWS"
FOLLOWS_SERVERS = "servers"
ENV_FILE_MODE = 0o600


def with_key(text: str, key: str) -> str:
    """An environment file's text with ``KEY_VAR`` set to ``key`` (as the generation role writes
    it: ``KEY="value"``), in place of its line, or added at the end; nothing else changes."""
    line = f'{KEY_VAR}="{key}"'
    lines = text.splitlines()
    for i, raw in enumerate(lines):
        if raw.strip().partition("=")[0].strip() == KEY_VAR:
            lines[i] = line
            break
    else:
        lines.append(line)
    return "\n".join(lines) + "\n"


def client_key(host: Host, unit: str) -> dict[str, Any]:
    """How the client ``unit`` gets its API key: ``env_file`` (the last of its unit's environment
    files that sets it, else the last one), ``follows`` (it takes the servers' key) and ``matches``
    (its key is the servers' now)."""
    files = host.client_env_files(unit)
    env: dict[str, str] = {}
    key_file = None
    for path in files:
        values = read_env_file(path)
        env.update(values)
        if KEY_VAR in values or FOLLOWS_VAR in values:
            key_file = path
    return {
        "env_file": key_file or (files[-1] if files else None),
        "follows": env.get(FOLLOWS_VAR) == FOLLOWS_SERVERS,
        "matches": env.get(KEY_VAR, "") == host.api_key,
    }


def hand_over(host: Host, unit: str) -> str | None:
    """For a client that follows the servers' key: its environment file made to hold the servers'
    key now (rewritten, root-only, only if it differs), and the key to hand it on its control socket.
    None for a client whose key is its own (nothing is changed)."""
    found = client_key(host, unit)
    if not found["follows"]:
        return None
    path = found["env_file"]
    if path and not found["matches"]:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        host.write_file(path, with_key(text, host.api_key), ENV_FILE_MODE)
    return host.api_key
