"""The server role's defaults that the controller-side resolution applies itself.

A variable that is unset (or null) takes the value the role gives it in
``roles/server/defaults/main.yml``. Those defaults cannot be read from the task variables: the
``server_validate`` action also runs in plays that do not apply the role (``playbooks/deploy.yml``
and ``retune.yml`` validate every host first), and the ``server_instances`` filter reads
``hostvars``, which never hold role defaults. So the non-empty ones are repeated here, once, and
``tests/unit/plugins/plugin_utils/test_role_defaults.py`` holds this table equal to the role's
file. Empty defaults (null, ``""``, ``[]``, ``{}``) need no entry: the resolution treats them as
unset.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

ROLE_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "sglang_server_python": "/opt/sglang/venv/bin/python",
        "sglang_server_listen_host": "127.0.0.1",
        "sglang_server_base_port": 30000,
        "sglang_server_user": "sglang",
    }
)
