"""Every action plugin's documentation (plugins/modules/<name>.py, where ansible-doc looks for it)
says what its argument spec accepts: the same options, each with the same type, default, choices,
elements and required. validate-modules compares a module's documentation with its
AnsibleModule; an action plugin's spec is known only here."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml

PLUGINS = Path(__file__).resolve().parents[3] / "plugins"
ACTIONS = sorted(p.stem for p in (PLUGINS / "action").glob("*.py") if not p.stem.startswith("_"))
PACKAGE = "ansible_collections.sglang_ops.fleet.plugins"


def spec_fields(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": spec.get("type", "str"),
        "default": spec.get("default"),
        "choices": spec.get("choices"),
        "elements": spec.get("elements"),
        "required": spec.get("required", False),
    }


def documented_options(name: str) -> dict[str, Any]:
    doc = yaml.safe_load(importlib.import_module(f"{PACKAGE}.modules.{name}").DOCUMENTATION)
    return doc.get("options") or {}


def test_every_action_plugin_is_documented_and_has_a_spec() -> None:
    assert ACTIONS == ["advise", "advise_report", "host_lock", "retune", "server_validate"]
    for name in ACTIONS:
        assert (PLUGINS / "modules" / f"{name}.py").is_file(), name
        assert isinstance(importlib.import_module(f"{PACKAGE}.action.{name}").ARGUMENT_SPEC, dict), name


@pytest.mark.parametrize("name", ACTIONS)
def test_documentation_and_argument_spec_agree(name: str) -> None:
    spec = importlib.import_module(f"{PACKAGE}.action.{name}").ARGUMENT_SPEC
    docs = documented_options(name)
    assert sorted(docs) == sorted(spec), "options documented but not accepted, or accepted but not documented"
    for option, accepted in spec.items():
        assert spec_fields(docs[option]) == spec_fields(accepted), option
        # 300 and 300.0 compare equal: the documented default has the option's type too.
        default = docs[option].get("default")
        if default is not None and accepted.get("type") != "float":
            assert type(default) is type(accepted["default"]), option
