"""Resolved instances: what one host's variables make of each of its SGLang instances.

:func:`resolve_host` is the one producer of :class:`ResolvedInstance`. It reads the host's
variables (:data:`HOST_VARIABLES`), applies the role's defaults (:mod:`_instances.role_defaults`) and the
instance layout (:mod:`_instances.layout`), merges and checks the settings layers (:mod:`_flags.checks`),
renders argv and environment (:mod:`_instances.render`) and adds what the unit and the retune need
(:mod:`_instances.deploy`). :func:`resolve_instances` is the same list as mappings: what the
``server_validate`` action registers and sets as a fact, what the ``server_instances`` filter
returns, and what the server role's templates, the desired-settings record and the retune read.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.checks import (
    Checked,
    ServerArgsError,
    check_items,
    merge_layers,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.names import resolve_name
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.table import FlagTable, load_table
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.values import describe, plain
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.deploy import (
    DEPLOY_VARIABLES,
    deployment_fields,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.layout import (
    LAYOUT_OWNED,
    TP_SIZE,
    Layout,
    check_layout,
    host_scalar,
    instance_layouts,
    is_int,
    parallel_problem,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.render import (
    LAUNCH_MODULE,
    env_value,
    render_cli_args,
    unchecked_cli_words,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._releases.facts import (
    scheduler_port_warning,
    startup_refusals,
)

# The host variables resolve_host reads; callers pass just these (templating others is wasted work).
HOST_VARIABLES: tuple[str, ...] = (
    "sglang_server_version",
    "sglang_server_flag_table_version",
    "sglang_server_python",
    "sglang_server_model_path",
    "sglang_server_served_model_name",
    "sglang_server_listen_host",
    "sglang_server_base_port",
    "sglang_server_gpu_count",
    "sglang_server_instances",
    "sglang_server_lxc_container",
    "sglang_server_args",
    "sglang_server_host_args",
    "sglang_server_args_unchecked",
    "sglang_server_env",
    "sglang_server_host_env",
    *DEPLOY_VARIABLES,
)

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_UNCHECKED_NAME = re.compile(r"[a-z0-9][a-z0-9_]*")


@dataclass(frozen=True)
class ResolvedInstance:
    """One SGLang instance of a host, as the unit runs it and the retune compares it.

    Made by :func:`resolve_host` only; :meth:`to_dict` is the form plays and templates see.
    """

    name: str
    unit: str  # sglang-<name>.service
    gpus: tuple[int, ...]  # GPU indexes of the host (or container)
    port: int
    container: int | None  # Proxmox CT id, None on the bare host
    version: str  # SGLang release installed
    flag_table: str  # flag table the settings were checked against
    args: Mapping[str, Any]  # every launch setting, under the names that table uses
    args_unchecked: Mapping[str, Any]
    argv: tuple[str, ...]  # the complete command line, as /proc/PID/cmdline reads it
    env: Mapping[str, str]
    warnings: tuple[str, ...]
    fingerprint: str  # sha256 of version, argv and env
    http_host: str
    health_url: str
    self_sigkill_on_stop: bool
    expected_server_info: Mapping[str, Any]
    user: str
    served_model_name: str | None

    def to_dict(self) -> dict[str, Any]:
        """Every field, in builtin types (lists, fresh dicts), in the declared order."""
        out: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = copy.deepcopy(dict(value))
            out[item.name] = value
        return out


@dataclass(frozen=True)
class _Host:
    """The host-wide values all instances of the host share."""

    where: str  # "host <name>", the head of every message
    version: str | None
    flag_version: str | None  # whose flag table applies
    python: Any
    model_path: Any
    served: Any
    listen: Any
    base_port: Any
    gpu_count: int | None
    container: Any
    warnings: list[str]


def _host(hostname: str, hostvars: Mapping[str, Any], table: FlagTable, problems: list[str]) -> _Host:
    """The host-wide values, each checked; problems in the order the variables are documented."""
    where = f"host {hostname}"
    host_warnings: list[str] = []
    version, flag_version = _release(where, hostvars, table, problems, host_warnings)
    python = host_scalar(hostvars, "sglang_server_python", where, problems, *_PYTHON)
    model_path = _model_path(where, hostvars, problems)
    served, listen, base_port = (
        host_scalar(hostvars, name, where, problems, check, expected) for name, check, expected in _SERVING
    )
    gpu_count = _gpu_count(where, hostvars, problems)
    container = host_scalar(hostvars, "sglang_server_lxc_container", where, problems, *_CONTAINER)
    return _Host(
        where,
        version,
        flag_version,
        python,
        model_path,
        served,
        listen,
        base_port,
        gpu_count,
        container,
        host_warnings,
    )


# Each optional host variable: how it is checked, and what a message says it expects.
_PYTHON = (lambda v: isinstance(v, str) and v.startswith("/"), "an absolute path to a python")
_SERVING = (
    ("sglang_server_served_model_name", lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
    ("sglang_server_listen_host", lambda v: isinstance(v, str) and bool(v), "an address or host name"),
    ("sglang_server_base_port", lambda v: is_int(v) and 1 <= v <= 65535, "a TCP port number (1-65535)"),
)
_CONTAINER = (lambda v: is_int(v) and v > 0, "a Proxmox container id (a positive integer)")


def _release(
    where: str, hostvars: Mapping[str, Any], table: FlagTable, problems: list[str], host_warnings: list[str]
) -> tuple[str | None, str | None]:
    """The SGLang release installed, and whose flag table applies to it."""
    version = hostvars.get("sglang_server_version")
    table_version = hostvars.get("sglang_server_flag_table_version")
    supported = ", ".join(table.versions)
    if not isinstance(version, str) or not version:
        problems.append(
            f"{where}: sglang_server_version is required: the SGLang release installed, "
            f'as a string such as "{table.versions[-1]}" (supported: {supported})'
        )
        version = None
    if table_version is not None:
        if not isinstance(table_version, str) or not table.supports(table_version):
            problems.append(
                f"{where}: sglang_server_flag_table_version {table_version!r} is not a known flag "
                f"table; use one of {supported}"
            )
            table_version = None
        elif version is not None and table_version != version:
            host_warnings.append(
                f"{where}: SGLang {version} is checked against the flag table of {table_version} "
                "(sglang_server_flag_table_version); flags added, renamed or removed in between are not caught"
            )
    elif version is not None and not table.supports(version):
        problems.append(
            f"{where}: sglang_server_version {version!r} is not supported; supported: {supported}. For a "
            "release in between, set sglang_server_flag_table_version to the nearest supported version "
            "and its flag table is used"
        )
    if table_version is not None:
        return version, str(table_version)
    if version is not None and table.supports(version):
        return version, version
    return version, None


def _model_path(where: str, hostvars: Mapping[str, Any], problems: list[str]) -> Any:
    model_path = hostvars.get("sglang_server_model_path")
    if not isinstance(model_path, str) or not model_path.strip():
        problems.append(
            f"{where}: sglang_server_model_path is required: a Hugging Face repo id or a local path, "
            f"got {describe(model_path)}"
        )
    return model_path


def _gpu_count(where: str, hostvars: Mapping[str, Any], problems: list[str]) -> int | None:
    gpu_count = hostvars.get("sglang_server_gpu_count")
    if not is_int(gpu_count) or gpu_count < 1:
        problems.append(
            f"{where}: sglang_server_gpu_count is required: the number of GPUs on the host "
            f"(or in its container), got {describe(gpu_count)}"
        )
        return None
    return int(gpu_count)


def _launch_args(
    table: FlagTable, host: _Host, flag_version: str, hostvars: Mapping[str, Any], layout: Layout, problems: list[str]
) -> tuple[dict[str, Any], Checked]:
    """The instance's launch settings: its merged, checked layers plus what the layout writes."""
    where = host.where
    label = f"{where}, instance {layout.name}"
    layers = [
        (hostvars.get("sglang_server_args"), f"{where}: sglang_server_args"),
        (hostvars.get("sglang_server_host_args"), f"{where}: sglang_server_host_args"),
        (layout.args, f"{label}: {layout.path('args')}"),
    ]
    items = merge_layers(table, flag_version, layers, problems)
    owned = []
    for item in items:
        name = resolve_name(table, flag_version, item.key)
        setting = (name.setting if name.status == "setting" else None) or item.key
        if setting in LAYOUT_OWNED:
            problems.append(f"{item.place}: {setting} is set by the instance layout; use {LAYOUT_OWNED[setting]}")
            owned.append(item)
    checked = check_items(table, flag_version, [i for i in items if i not in owned])
    problems.extend(checked.problems)
    if not checked.problems:
        problems.extend(startup_refusals(flag_version, checked.args, label))
        port_warning = scheduler_port_warning(flag_version, layout.port, checked.args, label)
        if port_warning:
            checked.warnings.append(port_warning)
    tp, problem = parallel_problem(layout, checked, label)
    if problem:
        problems.append(problem)

    launch: dict[str, Any] = {
        "model_path": plain(host.model_path),
        "host": host.listen,
        "port": layout.port,
        "base_gpu_id": 0,
        TP_SIZE: tp,
    }
    if host.served is not None:
        launch["served_model_name"] = host.served
    return dict(sorted({**checked.args, **launch}.items())), checked


def _environment(
    host: _Host, flag_version: str, hostvars: Mapping[str, Any], layout: Layout, problems: list[str]
) -> dict[str, str]:
    where = host.where
    label = f"{where}, instance {layout.name}"
    env_items = merge_layers(
        None,
        flag_version,
        [
            (hostvars.get("sglang_server_env"), f"{where}: sglang_server_env"),
            (hostvars.get("sglang_server_host_env"), f"{where}: sglang_server_host_env"),
            (layout.env, f"{label}: {layout.path('env')}"),
        ],
        problems,
    )
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in layout.gpus)}
    for item in sorted(env_items, key=lambda i: i.key):
        text = env_value(item.value)
        if not _ENV_NAME.fullmatch(item.key):
            problems.append(f"{item.place}: '{item.key}' is not a valid environment variable name")
        elif item.key == "CUDA_VISIBLE_DEVICES":
            problems.append(
                f"{item.place}: CUDA_VISIBLE_DEVICES is set from the instance's gpus; "
                f"change {layout.path('gpus')} or sglang_server_instances instead"
            )
        elif text is None:
            problems.append(
                f"{item.place}: environment values must be strings, numbers or booleans, got {describe(item.value)}"
            )
        else:
            env[item.key] = text
    return dict(sorted(env.items()))


def _unchecked(
    table: FlagTable,
    host: _Host,
    flag_version: str,
    hostvars: Mapping[str, Any],
    layout: Layout,
    args: Mapping[str, Any],
    checked: Checked,
    problems: list[str],
) -> tuple[dict[str, Any], list[str]]:
    """The instance's unchecked flags, and a warning for each (passed verbatim, never validated)."""
    where = host.where
    label = f"{where}, instance {layout.name}"
    unchecked_items = merge_layers(
        None,
        flag_version,
        [
            (hostvars.get("sglang_server_args_unchecked"), f"{where}: sglang_server_args_unchecked"),
            (layout.args_unchecked, f"{label}: {layout.path('args_unchecked')}"),
        ],
        problems,
    )
    unchecked: dict[str, Any] = {}
    warnings: list[str] = []
    for item in sorted(unchecked_items, key=lambda i: i.key):
        known = resolve_name(table, flag_version, item.key)
        known_as = known.setting if known.status == "setting" else None
        if not _UNCHECKED_NAME.fullmatch(item.key):
            problems.append(f"{item.place}: '{item.key}' is not a snake_case flag name")
            continue
        if known_as in LAYOUT_OWNED or known_as == TP_SIZE or item.key in LAYOUT_OWNED:
            owner = LAYOUT_OWNED.get(known_as or item.key, f"the instance's gpus ({layout.path('gpus')})")
            problems.append(f"{item.place}: {known_as or item.key} is set by the instance layout; use {owner}")
            continue
        if known_as is not None and known_as in args:
            problems.append(
                f"{item.place}: {known_as} is also set in args ({checked.origins[known_as].place}); "
                "keep it in args only"
            )
            continue
        value = plain(item.value)
        if not isinstance(value, (str, int, float, bool, list, dict)):
            problems.append(
                f"{item.place}: unchecked values must be strings, numbers, booleans, lists or "
                f"mappings, got {describe(item.value)}"
            )
            continue
        unchecked[item.key] = value
        words = unchecked_cli_words({item.key: value})
        shown = " ".join(words) if words else "nothing (false)"
        note = (
            f"; SGLang {flag_version} knows this flag as {known_as}, move it to args to have it checked"
            if known_as
            else ""
        )
        warnings.append(f"{label}: {item.place.split(': ', 1)[1]} is passed unchecked as {shown}{note}")
    return unchecked, warnings


def resolve_host(hostname: str, hostvars: Mapping[str, Any]) -> list[ResolvedInstance]:
    """Every SGLang instance of one host, fully resolved, from that host's variables.

    Applies the role's defaults, the default layout (one instance per GPU, ``gpu{i}`` on port
    ``sglang_server_base_port + i``) or the explicit ``sglang_server_instances``, merges the
    settings layers (``sglang_server_args`` < ``sglang_server_host_args`` < instance ``args``,
    likewise for env and args_unchecked; null removes), checks all of it and adds the deployment
    fields (:func:`_instances.deploy.deployment_fields`). Raises :class:`ServerArgsError` listing every
    problem of the host.
    """
    problems: list[str] = []
    table = load_table()
    host = _host(hostname, hostvars, table, problems)
    layouts = instance_layouts(hostname, hostvars, host.gpu_count, host.base_port, host.container, problems)
    check_layout(hostname, layouts, host.gpu_count, problems)
    version, flag_version = host.version, host.flag_version
    if flag_version is None or version is None:
        raise ServerArgsError(problems, subject=f"SGLang settings of host {hostname}")

    resolved = []
    for layout in layouts:
        args, checked = _launch_args(table, host, flag_version, hostvars, layout, problems)
        env = _environment(host, flag_version, hostvars, layout, problems)
        unchecked, unchecked_warnings = _unchecked(table, host, flag_version, hostvars, layout, args, checked, problems)
        # Rendering needs valid settings; with problems anywhere on the host, only the checks go on.
        if problems:
            continue
        launch = {
            "name": layout.name,
            "port": layout.port,
            "version": version,
            "flag_table": flag_version,
            "args": args,
            "argv": [
                str(host.python),
                "-m",
                LAUNCH_MODULE,
                *render_cli_args(args, flag_version),
                *unchecked_cli_words(unchecked),
            ],
            "env": env,
        }
        deployed = deployment_fields(launch, hostvars)
        resolved.append(
            ResolvedInstance(
                name=layout.name,
                unit=f"sglang-{layout.name}.service",
                gpus=tuple(layout.gpus),
                port=layout.port,
                container=layout.container,
                version=version,
                flag_table=flag_version,
                args=args,
                args_unchecked=unchecked,
                argv=tuple(deployed["argv"]),
                env=deployed["env"],
                warnings=tuple(dict.fromkeys([*host.warnings, *checked.warnings, *unchecked_warnings])),
                fingerprint=deployed["fingerprint"],
                http_host=deployed["http_host"],
                health_url=deployed["health_url"],
                self_sigkill_on_stop=deployed["self_sigkill_on_stop"],
                expected_server_info=deployed["expected_server_info"],
                user=deployed["user"],
                served_model_name=deployed["served_model_name"],
            )
        )
    if problems:
        raise ServerArgsError(problems, subject=f"SGLang settings of host {hostname}")
    return resolved


def resolve_instances(hostname: str, hostvars: Mapping[str, Any]) -> list[dict[str, Any]]:
    """:func:`resolve_host` as mappings (:meth:`ResolvedInstance.to_dict`), for Ansible."""
    return [instance.to_dict() for instance in resolve_host(hostname, hostvars)]
