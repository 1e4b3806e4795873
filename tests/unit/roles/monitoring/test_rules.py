"""The monitoring role's Prometheus rules: valid for promtool, every alert tested firing and quiet
(sglang-fleet.rules.test.yml), written for operators, and reading only series that exist."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jinja2
import pytest
import yaml

HERE = Path(__file__).resolve().parent
TESTS = HERE / "sglang-fleet.rules.test.yml"
# Series from outside SGLang's /metrics: Prometheus's own, dcgm-exporter's, and the role's
# generated GPU ownership rules.
EXTERNAL = {"up", "DCGM_FI_DEV_FB_USED", "sglang_fleet:gpu_owner"}


def rules_file(promql: SimpleNamespace) -> Path:
    return promql.role / "files" / "prometheus" / "sglang-fleet.rules.yml"


def alerts(promql: SimpleNamespace) -> list[dict[str, Any]]:
    groups = yaml.safe_load(rules_file(promql).read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_accepts_the_rules(promtool: Any, promql: SimpleNamespace) -> None:
    result = promtool("check", "rules", str(rules_file(promql)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts(promql))} rules found" in result.stdout


def test_promtool_unit_tests_pass(promtool: Any) -> None:
    result = promtool("test", "rules", TESTS.name, cwd=HERE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_tested_firing_and_quiet(promql: SimpleNamespace) -> None:
    tests = yaml.safe_load(TESTS.read_text(encoding="utf-8"))
    assert tests["rule_files"] == ["../../../../roles/monitoring/files/prometheus/sglang-fleet.rules.yml"]
    cases = [case for test in tests["tests"] for case in test["alert_rule_test"]]
    names = {rule["alert"] for rule in alerts(promql)}
    assert len(names) == 7
    firing = {case["alertname"] for case in cases if case.get("exp_alerts")}
    quiet = {case["alertname"] for case in cases if not case.get("exp_alerts")}
    assert sorted(names - firing) == [], "alerts never tested firing"
    assert sorted(names - quiet) == [], "alerts never tested quiet"
    assert sorted({case["alertname"] for case in cases} - names) == [], "tests of alerts that do not exist"


def test_every_alert_speaks_to_an_operator(promql: SimpleNamespace) -> None:
    for rule in alerts(promql):
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert set(rule["annotations"]) == {"summary", "description"}, name
        assert (
            "$labels.instance_name" in rule["annotations"]["summary"] or "$labels.gpu" in rule["annotations"]["summary"]
        )
        assert "$labels.host" in rule["annotations"]["summary"], name
        assert len(rule["annotations"]["description"]) > 120, name
        assert rule.get("for"), f"{name} fires on a single evaluation"


def test_rules_read_only_series_that_exist(promql: SimpleNamespace) -> None:
    for rule in alerts(promql):
        used = promql.metric_names(rule["expr"])
        assert used, rule["alert"]
        assert sorted(used - promql.sglang_metrics - EXTERNAL) == [], rule["alert"]
        # Every SGLang series is selected by the role's job, so other SGLang scrapes do not alert twice.
        if used & promql.sglang_metrics or "up" in used:
            assert 'job="sglang-fleet"' in rule["expr"], rule["alert"]


def test_rules_join_on_labels_the_role_gives(promql: SimpleNamespace) -> None:
    sglang_labels = {"engine_type", "model_name", "tp_rank", "pp_rank", "moe_ep_rank", "is_streaming", "priority"}
    known = promql.target_labels | sglang_labels | {"job", "instance", "gpu", "le"}
    for rule in alerts(promql):
        assert sorted(promql.label_names(rule["expr"]) - known) == [], rule["alert"]


def render_gpu_rules(instances: list[dict[str, Any]], promql: SimpleNamespace) -> str:
    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined, autoescape=False)  # noqa: S701 (YAML, not HTML)
    env.filters["to_json"] = json.dumps
    source = (promql.role / "templates" / "sglang-fleet-gpus.rules.yml.j2").read_text(encoding="utf-8")
    return env.from_string(source).render(_monitoring_instances=instances, ansible_managed="Ansible managed")


def test_gpu_ownership_rules_give_one_series_per_gpu(promtool: Any, promql: SimpleNamespace, tmp_path: Path) -> None:
    instances = [
        {"host": "node-a", "name": "gpu0", "unit": "sglang-gpu0.service", "gpus": ["0"], "release_threshold_mib": 1024},
        {
            "host": "node-a",
            "name": "tp",
            "unit": "sglang-tp.service",
            "gpus": ["2", "3"],
            "release_threshold_mib": 1024,
        },
        {"host": "node-b", "name": "gpu0", "unit": "sglang-gpu0.service", "gpus": ["0"], "release_threshold_mib": 2048},
    ]
    text = render_gpu_rules(instances, promql)
    path = tmp_path / "sglang-fleet-gpus.rules.yml"
    path.write_text(text, encoding="utf-8")
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    (group,) = yaml.safe_load(text)["groups"]
    assert [r["record"] for r in group["rules"]] == ["sglang_fleet:gpu_owner"] * 4
    assert [(r["labels"]["host"], r["labels"]["gpu"], r["labels"]["instance_name"]) for r in group["rules"]] == [
        ("node-a", "0", "gpu0"),
        ("node-a", "2", "tp"),
        ("node-a", "3", "tp"),
        ("node-b", "0", "gpu0"),
    ]
    # Each series is its host's release threshold, which the alert compares GPU memory with.
    assert [r["expr"] for r in group["rules"]] == ["vector(1024)"] * 3 + ["vector(2048)"]
    # The alert joins this series on exactly these labels.
    (alert,) = [a for a in alerts(promql) if a["alert"] == "SGLangGPUMemoryHeldWithoutServer"]
    assert "> on (host, gpu) group_left (instance_name, unit)" in alert["expr"]
    assert "1024" not in alert["expr"]
    assert set(group["rules"][0]["labels"]) == {"host", "gpu", "instance_name", "unit"}


@pytest.mark.parametrize(
    ("expr", "metrics", "labels"),
    [
        (
            'sum by (le, host) (rate(sglang:x_bucket{job="j", host=~"$host"}[5m]))',
            {"sglang:x_bucket"},
            {"le", "host", "job"},
        ),
        ("up == 0 and on (host) sglang_fleet:gpu_owner", {"up", "sglang_fleet:gpu_owner"}, {"host"}),
        ("rate(a_total[10m] offset 1h) > 0.8 * b", {"a_total", "b"}, set()),
    ],
)
def test_the_promql_reader(promql: SimpleNamespace, expr: str, metrics: set[str], labels: set[str]) -> None:
    assert promql.metric_names(expr) == metrics
    assert promql.label_names(expr) == labels
