"""The monitoring role's variables: every public one documented in meta/argument_specs.yml with
its default equal to defaults/main.yml's, every one the role reads documented, private ones in
vars/main.yml."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import yaml
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

# Read from the SGLang hosts' variables (hostvars), so it has no default in the role.
PER_SGLANG_HOST = {"monitoring_scrape_address"}


def load(promql: SimpleNamespace, path: str) -> Any:
    return yaml.safe_load((promql.role / path).read_text(encoding="utf-8"))


def options(promql: SimpleNamespace) -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = load(promql, "meta/argument_specs.yml")["argument_specs"]["main"]["options"]
    return result


def test_defaults_are_the_documented_ones(promql: SimpleNamespace) -> None:
    defaults = load(promql, "defaults/main.yml")
    specs = options(promql)
    assert sorted(set(specs) - set(defaults) - PER_SGLANG_HOST) == []
    assert sorted(set(defaults) - set(specs)) == []
    for name, spec in specs.items():
        assert spec.get("type"), name
        assert spec.get("description"), name
        if name not in PER_SGLANG_HOST:
            assert spec.get("default") == defaults[name], name
    result = ArgumentSpecValidator(specs).validate(defaults)
    assert result.error_messages == []


def test_every_variable_the_role_reads_is_documented(promql: SimpleNamespace) -> None:
    text = "\n".join(
        p.read_text(encoding="utf-8")
        for p in sorted(promql.role.rglob("*"))
        if p.is_file() and p.suffix in (".yml", ".j2")
    )
    text = re.sub(r"(?m)^\s*tags: .*$", "", text)  # tags are not variables
    read = set(re.findall(r"\bmonitoring_[a-z_]+", text))
    assert sorted(read - set(options(promql))) == []


def test_private_variables_are_prefixed(promql: SimpleNamespace) -> None:
    assert all(name.startswith("_monitoring_") for name in load(promql, "vars/main.yml"))
