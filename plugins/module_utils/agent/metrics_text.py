# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Prometheus text exposition, as an instance's ``/metrics`` serves it: the values of the metrics
asked for, one figure per metric over its series (TP/DP ranks, modes, ``is_streaming``)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def metric_values(text: str, gauges: Mapping[str, str], counters: Mapping[str, str]) -> dict[str, float]:
    """``{key: value}`` for each metric named in ``gauges`` (the largest value over its series) or
    ``counters`` (the sum over its series), keyed by the mapping's value; a metric the text lacks
    (or gives only as NaN or garbage) is absent."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        name = match.group(1)
        key = gauges.get(name) or counters.get(name)
        if key is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if math.isnan(value):
            continue
        if name in counters:
            out[key] = out.get(key, 0.0) + value
        else:
            out[key] = max(out.get(key, value), value)
    return out
