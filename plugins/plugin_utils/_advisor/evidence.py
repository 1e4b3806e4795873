"""The advisor's evidence for one instance: what it was observed doing, what it runs (the
inventory's settings, and where it differs what /server_info reports), and its GPUs' memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.inputs import Settings

# Settings read from /server_info as SGLang resolved them, except those SGLang itself changes
# while resolving (they are derived again from what was asked).
_RESOLVED_BY_SGLANG = ("disable_overlap_schedule", "disable_radix_cache", "max_running_requests")
# Settings SGLang keeps as launched: where /server_info reports another value than the inventory's,
# the instance runs other settings than the inventory has (not relaunched since the inventory
# changed, or an extra-vars override such as advise --trial's canary): the running value counts.
_RUNNING_WINS = ("max_mamba_cache_size", "mem_fraction_static", "mamba_full_memory_ratio")


@dataclass(frozen=True)
class Evidence:
    """One instance as observed: the agent's ``observe`` result for it, and its inventory."""

    host: str
    name: str
    release: str
    flag_table: str  # the flag table the inventory's settings are checked against
    args: Mapping[str, Any]  # the resolved inventory settings (server_validate)
    observation: Mapping[str, Any]  # observe's per-instance result (server_info, journal, samples)
    gpu_total_mib: float | None
    gpu_used_mib_max: float | None
    env: Mapping[str, str] = field(default_factory=dict)
    window_s: float = 0.0
    interval_s: float = 0.0
    source: str = "sampled /metrics"  # or "prometheus"


def current_settings(
    args: Mapping[str, Any],
    server_info: Mapping[str, Any] | None,
    env: Mapping[str, str],
    drift: Mapping[str, tuple[Any, Any]],
) -> Settings:
    """What the instance runs: the inventory's settings, and for the ones it leaves unset the
    values the server resolved (mem_fraction_static, speculative_num_draft_tokens, ...); where it
    runs another value than the inventory has (``drift``: :func:`running_drift`), the running one."""
    merged: dict[str, Any] = {}
    for key, value in (server_info or {}).items():
        if key in _RESOLVED_BY_SGLANG or isinstance(value, (dict, list)):
            continue
        merged[key] = value
    merged.update({k: v for k, v in args.items() if v is not None})
    merged.update({k: running for k, (_inventory, running) in drift.items()})
    return Settings.from_args(merged, env)


def running_drift(args: Mapping[str, Any], server_info: Mapping[str, Any] | None) -> dict[str, tuple[Any, Any]]:
    """{setting: (the inventory's, the running)} where /server_info reports another value than the
    inventory sets, for the settings SGLang keeps as launched."""
    out: dict[str, tuple[Any, Any]] = {}
    for key in _RUNNING_WINS:
        wanted, running = args.get(key), (server_info or {}).get(key)
        if wanted is None or not isinstance(running, (int, float)) or isinstance(running, bool):
            continue
        try:
            same = math.isclose(float(wanted), float(running), rel_tol=1e-9, abs_tol=1e-9)
        except (TypeError, ValueError):
            same = False
        if not same:
            out[key] = (wanted, running)
    return out


def evidence_from_observation(
    host: str,
    instance: Mapping[str, Any],
    observation: Mapping[str, Any],
    gpus: Mapping[str, Mapping[str, Any]],
    window_s: float,
    interval_s: float,
    source: str = "sampled /metrics",
) -> Evidence:
    """:class:`Evidence` from a resolved instance (server_validate) and observe's result."""
    indexes = [str(g) for g in instance.get("gpus") or []]
    seen = [gpus[i] for i in indexes if i in gpus]
    total = min((float(g["total_mib"]) for g in seen), default=None)
    used = max((float(g["used_mib_max"]) for g in seen), default=None)
    return Evidence(
        host=host,
        name=str(instance["name"]),
        release=str(instance.get("version")),
        flag_table=str(instance.get("flag_table") or instance.get("version")),
        args=dict(instance.get("args") or {}),
        env=dict(instance.get("env") or {}),
        observation=observation,
        gpu_total_mib=total,
        gpu_used_mib_max=used,
        window_s=window_s,
        interval_s=interval_s,
        source=source,
    )


def client_demand_after(
    observation: Mapping[str, Any], demand_now: float | None, new_max: int
) -> tuple[float, list[str]] | None:
    """What the clients will send the instance once it runs ``new_max`` requests: each local
    client endpoint that follows the server's capacity (auto concurrency) sends ``new_max`` x its
    factor, a fixed one what it sends now, and clients the host does not know (elsewhere) what
    they sent over the window beyond the local ones. None when no local client said (observe's
    ``clients``), or one did not say whether it follows (an older client)."""
    clients = [c for c in observation.get("clients") or [] if isinstance(c, Mapping)]
    if not clients or any(not isinstance(c.get("follows_server"), bool) for c in clients):
        return None
    total, words = 0.0, []
    for c in clients:
        if c["follows_server"]:
            factor = float(c.get("factor") or 1.0)
            sends = math.ceil(new_max * factor)
            words.append(f"{c.get('unit')} follows the server's max (auto concurrency x{factor:g}): {sends}")
        else:
            sends = int(c.get("capacity") or 0)
            words.append(f"{c.get('unit')} has a fixed concurrency of {sends}")
        total += sends
    local_now = sum(float(c.get("capacity") or 0) for c in clients)
    elsewhere = (demand_now or 0.0) - local_now
    if elsewhere >= 1.0:
        total += elsewhere
        words.append(f"{elsewhere:.0f} more from clients elsewhere (what they sent over the window)")
    return total, words
