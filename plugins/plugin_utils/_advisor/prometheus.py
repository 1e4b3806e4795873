"""Reading an instance's SGLang metrics over a window from Prometheus's HTTP API (a range query
per metric), as the same samples the host agent's ``observe`` takes from ``/metrics``.

Each gauge is the largest value over the instance's series (TP/DP ranks; with priority
scheduling the request-count gauges hold the total under ``priority=""`` beside one series per
priority, so the largest is the total), each counter the sum over its series (``is_streaming``,
...), as ``observe`` does. KV usage is ``sglang:full_token_usage`` from 0.5.14 on (there
``sglang:token_usage`` is the fullest pool); both are read, and the window takes the release's.
The instance's series are chosen by a label selector: by default
``host="{inventory_hostname}",instance_name="{name}"``, the labels the collection's monitoring
role gives every target; ``instance="{host}:{port}"`` (the scrape target) suits a Prometheus set
up otherwise. Its placeholders are ``{host}`` (``ansible_host``, else the
inventory name), ``{inventory_hostname}``, ``{port}`` and ``{name}`` (the instance name).

Requests go through ansible-core's ``open_url``: an https Prometheus is verified against a CA bundle
(``Access.ca_path``, else the system's), and basic authentication is sent from ``Access`` rather
than from credentials in the URL, which is recorded with the task's arguments.
"""

from __future__ import annotations

import functools
import json
import math
import urllib.error
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ansible.module_utils.urls import ConnectionError as UrlsConnectionError
from ansible.module_utils.urls import open_url

DEFAULT_SELECTOR = 'host="{inventory_hostname}",instance_name="{name}"'

# Sample key -> (metric, how the series of one instance combine).
QUERIES: Mapping[str, tuple[str, str]] = {
    "num_running_reqs": ("sglang:num_running_reqs", "max"),
    "num_queue_reqs": ("sglang:num_queue_reqs", "max"),
    "num_used_tokens": ("sglang:num_used_tokens", "max"),
    "token_usage": ("sglang:token_usage", "max"),
    "full_token_usage": ("sglang:full_token_usage", "max"),
    "mamba_usage": ("sglang:mamba_usage", "max"),
    "gen_throughput": ("sglang:gen_throughput", "max"),
    "max_total_num_tokens": ("sglang:max_total_num_tokens", "max"),
    "context_len": ("sglang:context_len", "max"),
    "generation_tokens_total": ("sglang:generation_tokens_total", "sum"),
}

Fetch = Callable[[str, float], tuple[int | None, str]]


class PrometheusError(Exception):
    """Prometheus did not answer a query usefully; the message quotes the query and the answer."""


@dataclass(frozen=True)
class Access:
    """How to reach Prometheus: the CA bundle an https URL is verified against (None: the
    system's), whether to verify at all, and basic authentication (sent only when a user is set)."""

    ca_path: str | None = None
    validate_certs: bool = True
    username: str | None = None
    password: str | None = None


def http_get(url: str, timeout: float, access: Access = Access()) -> tuple[int | None, str]:
    """(status, body); status None when the connection failed (body says why)."""
    if not url.startswith(("http://", "https://")):
        raise PrometheusError(f"refusing to fetch {url!r}: only http:// or https:// Prometheus URLs")
    try:
        resp = open_url(
            url,
            headers={"Accept": "application/json"},
            timeout=timeout,
            validate_certs=access.validate_certs,
            ca_path=access.ca_path,
            url_username=access.username,
            url_password=access.password,
            force_basic_auth=access.username is not None,
            follow_redirects="safe",
        )
        with resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")
    except (urllib.error.URLError, UrlsConnectionError, OSError) as exc:
        return None, f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def selector_for(template: str, **values: Any) -> str:
    """The label selector of one instance (``template`` with its placeholders filled)."""
    try:
        return template.format(**values)
    except (KeyError, IndexError, ValueError) as exc:
        raise PrometheusError(
            f"prometheus selector {template!r}: {exc!r}; use the placeholders {{host}}, "
            "{inventory_hostname}, {port}, {name}"
        ) from None


def range_query(
    base_url: str, query: str, start: float, end: float, step: float, timeout: float = 30.0, fetch: Fetch = http_get
) -> list[tuple[float, float]]:
    """``/api/v1/query_range`` of one query that yields at most one series: [(unix time, value)]."""
    params = urllib.parse.urlencode({"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"})
    url = base_url.rstrip("/") + "/api/v1/query_range?" + params
    status, body = fetch(url, timeout)
    if status != 200:
        raise PrometheusError(f"GET {url}: {status if status is not None else 'no answer'}: {body[:300]}")
    try:
        answer = json.loads(body)
        if answer.get("status") != "success":
            raise ValueError(f"status {answer.get('status')!r}: {answer.get('error')}")
        data = answer["data"]
        if data.get("resultType") != "matrix":
            raise ValueError(f"resultType {data.get('resultType')!r}, expected 'matrix'")
        series = data["result"]
        if len(series) > 1:
            raise ValueError(f"{len(series)} series; the query must aggregate them into one")
        points = [(float(t), float(v)) for t, v in series[0]["values"]] if series else []
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise PrometheusError(f"GET {url}: unusable answer ({exc}): {body[:300]}") from None
    return [(t, v) for t, v in points if not math.isnan(v)]


def read_samples(
    base_url: str,
    selector: str,
    start: float,
    end: float,
    step: float,
    timeout: float = 30.0,
    fetch: Fetch | None = None,
    access: Access = Access(),
) -> tuple[list[dict[str, float]], list[str]]:
    """One instance's samples over [start, end], every ``step`` seconds: ``{"t": seconds since
    start, <key>: value, ...}`` (the keys of :data:`QUERIES` Prometheus has), and the problems.
    ``fetch`` (default: :func:`http_get` with ``access``) makes the requests."""
    fetch = fetch or functools.partial(http_get, access=access)
    by_time: dict[float, dict[str, float]] = {}
    problems: list[str] = []
    for key, (metric, how) in QUERIES.items():
        query = f"{how}({metric}{{{selector}}})"
        try:
            points = range_query(base_url, query, start, end, step, timeout, fetch)
        except PrometheusError as exc:
            problems.append(str(exc))
            continue
        for t, value in points:
            by_time.setdefault(t, {})[key] = value
    samples = [{"t": round(t - start, 3), **values} for t, values in sorted(by_time.items())]
    if not any("num_running_reqs" in s for s in samples) and not problems:
        problems.append(f"Prometheus has no sglang:num_running_reqs{{{selector}}} between {start:.0f} and {end:.0f}")
    return samples, problems
