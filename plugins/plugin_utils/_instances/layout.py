"""Instance layout of one host: which instances run on which GPUs, ports and containers.

:func:`instance_layouts` reads ``sglang_server_instances`` (or makes the default layout, one
single-GPU instance per GPU, ``gpu{i}`` on port ``sglang_server_base_port + i``);
:func:`check_layout` finds names, ports and GPUs used twice and GPUs the host does not have;
:func:`parallel_problem` derives ``tp_size`` from an instance's GPUs and checks the parallel sizes
given against them. :data:`LAYOUT_OWNED` names the settings the layout writes itself.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.checks import Checked
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.values import describe, plain
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.role_defaults import ROLE_DEFAULTS

# Settings the instance layout writes; users set the variable named here instead.
LAYOUT_OWNED: Mapping[str, str] = {
    "model_path": "sglang_server_model_path",
    "served_model_name": "sglang_server_served_model_name",
    "host": "sglang_server_listen_host",
    "port": "sglang_server_base_port (default layout) or the instance's port in sglang_server_instances",
    "base_gpu_id": "the instance's gpus in sglang_server_instances (each instance sees only its own GPUs, "
    "renumbered from 0 by CUDA_VISIBLE_DEVICES)",
    "api_key": "sglang_server_api_key (keys are secrets and never go into args)",
    "admin_api_key": "sglang_server_api_key (keys are secrets and never go into args)",
}
# The layout's settings that place an instance (where it listens, its first GPU) without changing
# how it runs: instances alike in everything else run alike.
PLACEMENT: tuple[str, ...] = ("host", "port", "base_gpu_id")
# The layout sets tp_size from the GPU list; an equal value in args is harmless, any other is an error.
TP_SIZE = "tp_size"

INSTANCE_KEYS: tuple[str, ...] = ("name", "gpus", "port", "args", "args_unchecked", "env", "container")

_INSTANCE_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")


def is_int(value: Any) -> TypeGuard[int]:
    """An integer that is not a boolean (bool is a subclass of int)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Layout:
    """Where one instance runs, and its own layers, before any setting is checked."""

    index: int | None  # position in sglang_server_instances; None for the default layout
    name: str
    gpus: list[int]
    port: int
    container: int | None
    args: Any
    args_unchecked: Any
    env: Any

    def path(self, key: str) -> str:
        return f"sglang_server_instances[{self.index}].{key}" if self.index is not None else key


def host_scalar(
    hostvars: Mapping[str, Any],
    name: str,
    where: str,
    problems: list[str],
    check: Any,
    expected: str,
) -> Any:
    """One host variable; the role's default when it is unset, or when it fails ``check`` (a problem then)."""
    default = ROLE_DEFAULTS.get(name)
    value = hostvars.get(name)
    if value is None:
        return default
    if not check(value):
        problems.append(f"{where}: {name} expects {expected}, got {describe(value)}")
        return default
    return plain(value)


def instance_layouts(
    hostname: str,
    hostvars: Mapping[str, Any],
    gpu_count: int | None,
    base_port: int,
    host_container: int | None,
    problems: list[str],
) -> list[Layout]:
    """The host's instances as written in ``sglang_server_instances``, or the default layout."""
    where = f"host {hostname}"
    entries = hostvars.get("sglang_server_instances")
    if entries is None or (isinstance(entries, (list, tuple)) and not entries):
        count = gpu_count or 0
        return [Layout(None, f"gpu{i}", [i], base_port + i, host_container, None, None, None) for i in range(count)]
    if not isinstance(entries, (list, tuple)):
        problems.append(f"{where}: sglang_server_instances expects a list of instances, got {describe(entries)}")
        return []
    layouts: list[Layout] = []
    for index, entry in enumerate(entries):
        path = f"sglang_server_instances[{index}]"
        if not isinstance(entry, Mapping):
            problems.append(f"{where}: {path} expects a mapping with name, gpus and port, got {describe(entry)}")
            continue
        label = f"{where}, instance {entry.get('name', index)}"
        for key in entry:
            if key not in INSTANCE_KEYS:
                close = difflib.get_close_matches(str(key), INSTANCE_KEYS, n=1)
                hint = f"; did you mean {close[0]}?" if close else f"; known keys: {', '.join(INSTANCE_KEYS)}"
                problems.append(f"{label}: {path}.{key} is not an instance key{hint}")
        name = entry.get("name")
        if not isinstance(name, str) or not _INSTANCE_NAME.fullmatch(name):
            problems.append(
                f"{label}: {path}.name expects a name of lowercase letters, digits and '-' "
                f"(starting with a letter or digit), got {describe(name)}"
            )
            name = f"#{index}"
        gpus = entry.get("gpus")
        gpu_list: list[int] = []
        if not isinstance(gpus, (list, tuple)) or not all(is_int(g) for g in gpus):
            problems.append(f"{label}: {path}.gpus expects a list of GPU indexes, got {describe(gpus)}")
        elif not gpus:
            problems.append(f"{label}: {path}.gpus is empty; every instance needs at least one GPU")
        else:
            gpu_list = [int(g) for g in gpus]
            duplicated = sorted({g for g in gpu_list if gpu_list.count(g) > 1})
            if duplicated:
                problems.append(f"{label}: {path}.gpus lists GPU {', '.join(map(str, duplicated))} twice")
        port = entry.get("port")
        if not is_int(port) or not 1 <= port <= 65535:
            problems.append(f"{label}: {path}.port expects a TCP port number (1-65535), got {describe(port)}")
            port = -1 - index
        container = entry.get("container", host_container)
        if container is not None and (not is_int(container) or container <= 0):
            problems.append(
                f"{label}: {path}.container expects a Proxmox container id (a positive integer) or null, "
                f"got {describe(container)}"
            )
            container = None
        layouts.append(
            Layout(
                index,
                str(name),
                gpu_list,
                int(port),
                container,
                entry.get("args"),
                entry.get("args_unchecked"),
                entry.get("env"),
            )
        )
    return layouts


def check_layout(hostname: str, layouts: Sequence[Layout], gpu_count: int | None, problems: list[str]) -> None:
    """Names, ports and GPUs used by two instances, and GPUs beyond ``sglang_server_gpu_count``."""
    where = f"host {hostname}"
    by_name: dict[str, list[Layout]] = {}
    by_port: dict[int, list[Layout]] = {}
    by_gpu: dict[int, list[Layout]] = {}
    for layout in layouts:
        by_name.setdefault(layout.name, []).append(layout)
        if layout.port > 0:
            by_port.setdefault(layout.port, []).append(layout)
        for gpu in dict.fromkeys(layout.gpus):
            by_gpu.setdefault(gpu, []).append(layout)
            if gpu_count is not None and not 0 <= gpu < gpu_count:
                problems.append(
                    f"{where}, instance {layout.name}: {layout.path('gpus')} names GPU {gpu}, but "
                    f"sglang_server_gpu_count is {gpu_count} (GPUs 0-{gpu_count - 1})"
                )
    for name, group in by_name.items():
        if len(group) > 1 and not name.startswith("#"):
            paths = ", ".join(layout.path("name") for layout in group)
            problems.append(f"{where}: instance name {name} is used more than once ({paths}); names must be unique")
    for port, group in sorted(by_port.items()):
        if len(group) > 1:
            names = " and ".join(layout.name for layout in group)
            problems.append(f"{where}: port {port} is used by instances {names}; give each instance its own port")
    for gpu, group in sorted(by_gpu.items()):
        if len(group) > 1:
            names = " and ".join(layout.name for layout in group)
            problems.append(f"{where}: GPU {gpu} is used by instances {names}; an instance needs its GPUs to itself")


def parallel_problem(layout: Layout, checked: Checked, where: str) -> tuple[int, str | None]:
    """tp_size for the instance, and the problem when the parallel sizes do not fit its GPUs."""
    count = len(layout.gpus)
    args = checked.args
    tp = args.get(TP_SIZE)
    dp = args.get("dp_size")
    pp = args.get("pp_size") or 1
    # With DP attention the data-parallel ranks share the tensor-parallel GPUs.
    dp_attention = bool(args.get("enable_dp_attention")) or (args.get("attn_dp_size") or 1) > 1
    replicas = 1 if dp_attention or dp is None else dp
    if layout.index is None:
        gpus_text = f"1 GPU (GPU {layout.gpus[0]} in the default layout)"
    else:
        gpus_text = f"{count} GPU{'s' if count != 1 else ''} ({layout.path('gpus')}: {layout.gpus})"
    if not all(is_int(v) and v > 0 for v in (tp or 1, replicas, pp)):
        return count, f"{where}: tp_size, dp_size and pp_size must be positive integers"
    if tp is None:
        if count % (replicas * pp):
            origin = checked.origins.get("dp_size") or checked.origins.get("pp_size")
            place = origin.place if origin else where
            return count, f"{place}: {gpus_text} cannot be split into dp_size {replicas} x pp_size {pp}"
        return count // (replicas * pp), None
    if tp * replicas * pp == count:
        return tp, None
    place = checked.origins[TP_SIZE].place
    sizes = (
        f"tp_size {tp}" + (f" x dp_size {replicas}" if replicas > 1 else "") + (f" x pp_size {pp}" if pp > 1 else "")
    )
    if layout.index is None:
        fix = (
            "the default layout runs one single-GPU instance per GPU; list the instances in "
            "sglang_server_instances with the GPUs each one spans"
        )
    else:
        fix = f"tp_size follows the GPU list: drop the key or change {layout.path('gpus')}"
    return tp, f"{place}: {sizes} needs {tp * replicas * pp} GPUs but the instance has {gpus_text}; {fix}"
