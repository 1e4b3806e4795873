"""The Grafana dashboard (roles/monitoring/files/grafana/sglang-fleet.json): every panel's PromQL
parses, reads only metrics SGLang's /metrics has and labels the role's targets carry, and every
templating variable is used."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

# Each panel the issue asks for, by the metric it must show.
REQUIRED = {
    "up": "up",
    "running": "sglang:num_running_reqs",
    "queue": "sglang:num_queue_reqs",
    "kv": "sglang:full_token_usage",
    "mamba": "sglang:mamba_usage",
    "throughput": "sglang:generation_tokens_total",
    "ttft": "sglang:time_to_first_token_seconds_bucket",
    "e2e": "sglang:e2e_request_latency_seconds_bucket",
}


@pytest.fixture(scope="module")
def dashboard(promql: SimpleNamespace) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        (promql.role / "files" / "grafana" / "sglang-fleet.json").read_text(encoding="utf-8")
    )
    return data


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows
    return [p for p in out if p.get("type") != "row"]


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in panels(dashboard) for target in panel["targets"]]


def variables(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return list(dashboard["templating"]["list"])


def test_panels_have_queries_on_the_chosen_datasource(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["targets"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_every_required_view_is_there(dashboard: dict[str, Any], promql: SimpleNamespace) -> None:
    shown = {m for e in exprs(dashboard) for m in promql.metric_names(e)}
    assert sorted(set(REQUIRED.values()) - shown) == []


def test_panels_read_only_metrics_sglang_exposes(dashboard: dict[str, Any], promql: SimpleNamespace) -> None:
    for expr in exprs(dashboard):
        used = promql.metric_names(expr)
        assert used, expr
        assert sorted(used - promql.sglang_metrics - {"up"}) == [], expr


def test_panels_select_the_role_job_and_the_chosen_instances(
    dashboard: dict[str, Any], promql: SimpleNamespace
) -> None:
    sglang_labels = {"engine_type", "model_name", "tp_rank", "is_streaming", "priority"}
    for expr in exprs(dashboard):
        assert 'job="sglang-fleet"' in expr, expr
        for variable in ("host", "model", "instance"):
            assert f"${variable}" in expr, expr
        assert sorted(promql.label_names(expr) - promql.target_labels - sglang_labels - {"job", "le"}) == [], expr


def test_every_templating_variable_is_used(dashboard: dict[str, Any]) -> None:
    names = [v["name"] for v in variables(dashboard)]
    assert names == ["datasource", "host", "model", "instance"]
    text = json.dumps(dashboard["panels"]) + json.dumps([v.get("query") for v in variables(dashboard)])
    unused = [n for n in names if not re.search(rf"\$(?:{n}\b|\{{{n}\}})", text)]
    assert unused == []
    # And no panel or variable refers to one that does not exist (Grafana's own start with $__).
    referred = set(re.findall(r"\$\{?([A-Za-z]\w*)", text))
    assert sorted(referred - set(names)) == []


def test_variable_queries_read_labels_the_role_gives(dashboard: dict[str, Any], promql: SimpleNamespace) -> None:
    for variable in variables(dashboard):
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["definition"])
        assert match, variable["definition"]
        assert match.group(2) in promql.target_labels, variable["name"]
        assert variable["query"]["query"] == variable["definition"]


def test_every_expression_parses(dashboard: dict[str, Any], promtool: Any, tmp_path: Path) -> None:
    # promtool parses PromQL in rule files: one recording rule per panel query, with Grafana's
    # variables replaced by values they take.
    values = {"$__rate_interval": "5m", "$host": ".*", "$model": ".*", "$instance": ".*"}
    rules = []
    for panel in panels(dashboard):
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in values.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, expr
            rules.append({"record": f"dashboard:panel_{panel['id']}_{target['refId']}", "expr": expr})
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}), encoding="utf-8")
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_request_counts_are_the_totals_with_priority_scheduling(dashboard: dict[str, Any]) -> None:
    """With priority scheduling the request-count gauges hold the total under priority="" beside
    one series per priority (0.5.23 observability/metrics_collector.py:1417-1428): a sum over the
    series would count every request twice."""
    for expr in exprs(dashboard):
        for gauge in ("sglang:num_running_reqs", "sglang:num_queue_reqs"):
            if gauge in expr:
                assert 'priority=""' in expr and not expr.startswith("sum"), expr


def test_the_kv_panel_reads_full_token_usage_where_the_release_has_it(dashboard: dict[str, Any]) -> None:
    [kv] = [p for p in panels(dashboard) if p["title"] == "KV cache usage"]
    [expr] = [t["expr"] for t in kv["targets"]]
    assert expr.index("sglang:full_token_usage") < expr.index(" or ") < expr.index("sglang:token_usage")
