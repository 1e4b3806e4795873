"""The controller-side resolution applies exactly the server role's defaults (_instances.role_defaults)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.deploy import LIBEXEC
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.resolve import (
    HOST_VARIABLES,
    resolve_instances,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.role_defaults import ROLE_DEFAULTS, ROLE_VARS

ROLE = Path(__file__).resolve().parents[4] / "roles" / "server"


def role_file(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROLE / name).read_text(encoding="utf-8"))
    return loaded


def test_the_table_is_read_from_the_role_with_every_variable_the_resolution_reads() -> None:
    defaults = role_file("defaults/main.yml")
    non_empty = {name: value for name, value in defaults.items() if value not in (None, "", [], {})}
    assert dict(ROLE_DEFAULTS) == non_empty
    assert {name for name in HOST_VARIABLES if name in non_empty} <= set(ROLE_DEFAULTS)
    assert ROLE_DEFAULTS["sglang_server_release_threshold_mib"] == defaults["sglang_server_release_threshold_mib"]


def test_the_role_paths_are_the_plain_values_of_its_vars() -> None:
    assert ROLE_VARS["_sglang_server_secrets_file"] == role_file("vars/main.yml")["_sglang_server_secrets_file"]
    assert all("{{" not in str(value) for value in ROLE_VARS.values())


def test_the_role_defaults_given_explicitly_change_nothing() -> None:
    """What the role passes when a variable is left alone resolves like the variable being unset."""
    defaults = role_file("defaults/main.yml")
    required = {
        "sglang_server_version": "0.5.23",
        "sglang_server_model_path": "Qwen/Qwen3.6-27B",
        "sglang_server_gpu_count": 2,
    }
    with_defaults = {**{name: defaults[name] for name in HOST_VARIABLES if name in defaults}, **required}
    assert set(with_defaults) == set(HOST_VARIABLES)
    assert resolve_instances("node1", with_defaults) == resolve_instances("node1", required)


def test_the_launcher_is_where_the_role_installs_it() -> None:
    assert role_file("vars/main.yml")["_sglang_server_libexec"] == LIBEXEC
