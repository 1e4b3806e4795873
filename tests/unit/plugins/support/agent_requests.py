"""Requests to the host agent as the controller sends them: every key an operation reads, with
the retune's option table's defaults (the agent keeps no fallbacks of its own)."""

from __future__ import annotations

from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.action.advise import ARGUMENT_SPEC as ADVISE_SPEC
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent import ops
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.host import Host
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.model_facts import JOURNAL_PATTERN
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.options import agent_options, default

# What the retune's phases add to the agent options (plugin_utils/_retune/flow.py, clients.py;
# journal_pattern with the inspect of check mode).
PHASE_KEYS = {
    "stop_timeout": default("stop_timeout"),
    "kill_timeout": default("kill_timeout"),
    "release_timeout": default("release_timeout"),
    "threshold_mib": default("release_threshold_mib"),
    "start_timeout": default("start_timeout"),
    "health_timeout": default("health_timeout"),
    "smoke_requests": default("smoke_requests"),
    "client_units": default("client_units"),
    "client_drain_timeout": default("client_drain_timeout"),
}
# What the advise action adds for the observe operation (plugins/action/advise.py).
OBSERVE_KEYS = {
    "window": ADVISE_SPEC["window"]["default"],
    "interval": ADVISE_SPEC["interval"]["default"],
    "sample_metrics": True,
    "journal_pattern": JOURNAL_PATTERN,
}
REQUEST: dict[str, Any] = {**agent_options({}), **PHASE_KEYS, **OBSERVE_KEYS}


def run_op(req: dict[str, Any], host: Host | None = None) -> dict[str, Any]:
    """``ops.run`` with a full request: the table's values, then the test's own."""
    return ops.run({**REQUEST, **req}, host)
