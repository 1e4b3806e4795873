"""Shared by the monitoring role's tests: promtool (Debian's prometheus package, installed by
`make setup`), the metric names SGLang exposes (every supported release's, read from its own
source), and a small reader of the metric and label names a PromQL expression uses."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[4]
ROLE = REPO / "roles" / "monitoring"
FACTS = REPO / "tests" / "doubles" / "gpusim" / "src" / "gpusim" / "facts"

# What /metrics of an SGLang instance has: every metric a supported release defines (its own
# source, vendored by tools/gen_sglang_facts.py), histograms by their sample names.
SGLANG_METRICS = frozenset(
    name + suffix
    for path in FACTS.glob("*.json")
    for name, metric in json.loads(path.read_text(encoding="utf-8"))["metrics"].items()
    for suffix in (("_bucket", "_sum", "_count") if metric["type"] == "histogram" else ("",))
)

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}
_GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"


def _strip(expr: str) -> str:
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    return re.sub(r"\boffset\s+\w+", " ", expr)


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (not functions, aggregations or keywords)."""
    text = re.sub(_GROUPING, " ", re.sub(r"\{[^}]*\}", "", _strip(expr)))
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        if text[match.end() :].lstrip().startswith("(") or match.group() in _KEYWORDS:
            continue
        names.add(match.group())
    return names


def label_names(expr: str) -> set[str]:
    """The label names an expression matches on or groups by."""
    text = _strip(expr)
    names = {n for body in re.findall(r"\{([^}]*)\}", text) for n in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", body)}
    names |= {n.strip() for body in re.findall(_GROUPING, text) for n in body.split(",") if n.strip()}
    return names


def role_target_labels() -> set[str]:
    """The labels the role gives every SGLang target (the file_sd 'labels' it builds)."""
    text = (ROLE / "tasks" / "preflight.yml").read_text(encoding="utf-8")
    blocks = [set(re.findall(r"'(\w+)':", b)) for b in re.findall(r"'labels': \{(.*?)\}", text, re.S)]
    (labels,) = [b for b in blocks if "instance_name" in b] or [set()]
    assert labels, "no file_sd labels of the SGLang targets in tasks/preflight.yml"
    return labels


@pytest.fixture(scope="session")
def promtool() -> Callable[..., subprocess.CompletedProcess[str]]:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool is not installed (make setup installs Debian's prometheus package, which has it)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{message}: on CI the rules must be tested")
        pytest.skip(message)

    def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([path, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)

    return run


@pytest.fixture(scope="session")
def promql() -> SimpleNamespace:
    """The readers above, for the test modules (conftest is not importable under importlib mode)."""
    return SimpleNamespace(
        metric_names=metric_names,
        label_names=label_names,
        sglang_metrics=SGLANG_METRICS,
        target_labels=role_target_labels(),
        role=ROLE,
        repo=REPO,
    )
