# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""What the server role and the retune plugin need beyond the resolved launch settings: the
command line as the unit runs it, where to reach the instance, and what to expect from it.

:func:`deployment_fields` is one step of :func:`._instances.resolve_host`, which makes every
resolved instance."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.table import version_key
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.render import (
    expected_server_info,
    fingerprint,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.role_defaults import ROLE_DEFAULTS

# The role's _sglang_server_libexec (roles/server/vars/main.yml), where it installs the launcher;
# tests/unit/plugins/plugin_utils/test_role_defaults.py holds the two equal.
LIBEXEC = "/usr/local/libexec/sglang-fleet"
LAUNCHER = f"{LIBEXEC}/sglang-fleet-launch"
# Up to 0.5.18 SGLang ends a clean, drained stop by SIGKILLing itself (sglang.md §2.3).
FIRST_CLEAN_EXIT = (0, 5, 19)
# Host variables read here, on top of the ones the launch settings come from.
DEPLOY_VARIABLES: tuple[str, ...] = ("sglang_server_api_key", "sglang_server_secret_env", "sglang_server_user")


def loopback_for(listen_host: str | None) -> str:
    """Where the host itself reaches a server listening on ``listen_host``."""
    if listen_host in (None, "", "0.0.0.0"):
        return "127.0.0.1"
    if listen_host == "::":
        return "::1"
    return str(listen_host)


def deployment_fields(instance: Mapping[str, Any], hostvars: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a resolved instance computed from its launch settings (``instance``: name,
    port, version, flag_table, args, argv, env) and the host's secrets and user.

    With secrets (an API key, a token) the unit starts SGLang through the launcher, which adds
    ``--api-key`` inside the process and masks the secrets in the server's output, so they are
    neither on a command line nor in the journal. ``argv`` is then what ``/proc/PID/cmdline`` of
    the running server reads, and ``env`` names (never holds) the secret variables; the
    fingerprint covers both. Secret values never enter the instance.
    """
    argv = list(instance["argv"])
    env = dict(instance["env"])
    api_key = bool(hostvars.get("sglang_server_api_key"))
    secret_names = sorted(hostvars.get("sglang_server_secret_env") or {})
    if api_key or secret_names:
        if argv[1:3] != ["-m", "sglang.launch_server"]:
            raise ValueError(f"unexpected launch command {argv[:3]}")
        argv = [argv[0], LAUNCHER, *argv[3:]]
        env["SGLANG_FLEET_SECRET_VARS"] = ",".join(sorted({*secret_names, *(["SGLANG_API_KEY"] if api_key else [])}))
        if api_key:
            env["SGLANG_FLEET_API_KEY_REQUIRED"] = "1"
    version = instance["version"]
    args = instance["args"]
    host = loopback_for(args.get("host"))
    return {
        "argv": argv,
        "env": env,
        "fingerprint": fingerprint(version, argv, env),
        "http_host": host,
        "health_url": f"http://{'[' + host + ']' if ':' in host else host}:{instance['port']}/health",
        "self_sigkill_on_stop": version_key(version) < FIRST_CLEAN_EXIT,
        "expected_server_info": expected_server_info(args, instance.get("flag_table") or version),
        "user": hostvars.get("sglang_server_user") or ROLE_DEFAULTS["sglang_server_user"],
        "served_model_name": args.get("served_model_name"),
    }
