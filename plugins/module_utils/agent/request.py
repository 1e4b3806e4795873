# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The keys of a request. The controller sends every value an operation reads (the retune's
option table, plugins/plugin_utils/_retune/options.py, defines each once; the server role sends
its own paths); the agent keeps no fallbacks of its own, so no value is decided in two places. A
request that lacks a key the operation reads fails naming it, before anything is touched."""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """The request lacks a key the operation reads."""


def need(req: dict[str, Any], key: str) -> Any:
    """``req[key]``, or :class:`RequestError` naming the key."""
    if key not in req:
        raise RequestError(f"the request to the host agent has no {key!r} (its sender must give every key it reads)")
    return req[key]
