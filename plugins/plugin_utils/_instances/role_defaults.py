"""The server role's defaults and fixed paths, read from the role itself (one place for each).

A variable that is unset (or null) takes the value the role gives it in
``roles/server/defaults/main.yml``. Those defaults cannot be read from the task variables: the
``server_validate`` action also runs in plays that do not apply the role (``playbooks/deploy.yml``
and ``retune.yml`` validate every host first), and the ``server_instances`` filter reads
``hostvars``, which never hold role defaults. So they are read here from the role's file, which
travels in the collection with this code: the release threshold, the timeouts and the user are
written once, in the role. Empty defaults (null, ``""``, ``[]``, ``{}``) are left out: the
resolution treats them as unset.

The role's fixed paths on the host (``roles/server/vars/main.yml``: the secrets file, the state
and desired-record directories) are read the same way; the retune's option table takes them as
its defaults, and the host agent is told them in every request.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

SERVER_ROLE = Path(__file__).resolve().parents[3] / "roles" / "server"


def _role_file(name: str) -> dict[str, Any]:
    loaded = yaml.safe_load((SERVER_ROLE / name).read_text(encoding="utf-8"))
    if not isinstance(loaded, dict):
        raise RuntimeError(f"{SERVER_ROLE / name}: expected a mapping of variables")
    return loaded


ROLE_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {name: value for name, value in _role_file("defaults/main.yml").items() if value not in (None, "", [], {})}
)

# The role's private variables that are plain values (not templates).
ROLE_VARS: Mapping[str, Any] = MappingProxyType(
    {
        name: value
        for name, value in _role_file("vars/main.yml").items()
        if not (isinstance(value, str) and "{{" in value)
    }
)
