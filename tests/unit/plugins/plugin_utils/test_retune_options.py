"""The option table of the retune against what is derived from it or written apart from it: the
action's argument spec, Options, the documentation of the action (literal YAML), and the server
role's variables that some options follow."""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

from ansible_collections.sglang_ops.fleet.plugins.action import retune as retune_action
from ansible_collections.sglang_ops.fleet.plugins.modules import retune as retune_doc
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune import flow as _retune
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.options import (
    AGENT,
    BY_NAME,
    OPTIONS,
    RETUNE,
    ROLE,
    Options,
    agent_options,
)

REPO = Path(__file__).resolve().parents[4]
ACTION_OPTIONS = [o for o in OPTIONS if o.scope != ROLE]


def test_names_are_unique_and_variables_follow_the_pattern() -> None:
    names = [o.name for o in OPTIONS]
    assert len(set(names)) == len(names)
    for o in OPTIONS:
        assert o.var in (None, f"sglang_retune_{o.name}"), o.name
        # A role-only option is nothing but its variable.
        assert o.scope != ROLE or o.var, o.name


def test_the_action_validates_against_the_table() -> None:
    assert frozenset(o.name for o in ACTION_OPTIONS) == retune_action.ActionModule._VALID_ARGS
    validated = ArgumentSpecValidator(retune_action.ARGUMENT_SPEC).validate({"instances": []})
    assert validated.error_messages == []
    assert {k: v for k, v in validated.validated_parameters.items() if k != "instances"} == {
        o.name: o.default for o in ACTION_OPTIONS if o.name != "instances"
    }
    for o in ACTION_OPTIONS:
        assert retune_action.ARGUMENT_SPEC[o.name]["type"] == o.type, o.name
        assert retune_action.ARGUMENT_SPEC[o.name].get("elements") == o.elements, o.name
    assert ArgumentSpecValidator(retune_action.ARGUMENT_SPEC).validate({}).error_messages == [
        "missing required arguments: instances"
    ]


def test_the_documentation_of_the_action_is_the_table() -> None:
    documented = yaml.safe_load(retune_doc.DOCUMENTATION)["options"]
    assert sorted(documented) == sorted(o.name for o in ACTION_OPTIONS)
    for o in ACTION_OPTIONS:
        doc = documented[o.name]
        assert doc["type"] == o.type, o.name
        assert doc.get("elements") == o.elements, o.name
        assert doc.get("required", False) == o.required, o.name
        assert doc.get("default") == o.default, o.name
        # 300 and 300.0 compare equal; a bool documented as 1 would too.
        assert type(doc.get("default")) is type(o.default) or o.type == "float", o.name


def test_options_has_a_field_per_retune_option_with_its_default() -> None:
    table = {o.name: o.default for o in OPTIONS if o.scope == RETUNE}
    dataclass_fields = {
        f.name: f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default
        for f in fields(Options)
        if f.name != "agent"
    }
    assert dataclass_fields == table
    # A list default is a fresh copy per Options, never the table's own list.
    assert Options().client_units is not BY_NAME["client_units"].default
    # The flow imports the same class.
    assert _retune.Options is Options


def test_options_from_the_action_arguments_splits_flow_and_agent() -> None:
    args = (
        ArgumentSpecValidator(retune_action.ARGUMENT_SPEC)
        .validate({"instances": [], "stop_timeout": 7, "poll_interval": 2, "canary": "gpu1", "state_dir": "/srv/state"})
        .validated_parameters
    )
    options = Options.from_args(args)
    assert options.stop_timeout == 7
    assert options.canary == "gpu1"
    assert options.start_timeout == 3600
    assert sorted(options.agent) == sorted(o.name for o in OPTIONS if o.scope == AGENT)
    assert options.agent["poll_interval"] == 2
    assert options.agent["state_dir"] == "/srv/state"
    assert (options.client_units, options.client_drain, options.client_drain_timeout) == (
        ["sglang-fleet-generate.service"],
        True,
        120.0,
    )


def test_pause_units_is_gone_renamed_client_units() -> None:
    assert "pause_units" not in BY_NAME
    client_units = BY_NAME["client_units"]
    assert (client_units.scope, client_units.var, client_units.default) == (
        RETUNE,
        "sglang_retune_client_units",
        ["sglang-fleet-generate.service"],
    )
    assert "sglang_retune_pause_units" in client_units.description
    assert (BY_NAME["client_drain"].default, BY_NAME["client_drain_timeout"].default) == (True, 120.0)


def _server_role(path: str) -> Any:
    return yaml.safe_load((REPO / "roles" / "server" / path).read_text())


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.server_var], ids=lambda o: o.name)
def test_an_option_that_follows_a_server_variable_has_its_default_and_says_so(option: Any) -> None:
    assert option.default == _server_role("defaults/main.yml")[option.server_var]
    spec = _server_role("meta/argument_specs.yml")["argument_specs"]["main"]["options"][option.server_var]
    assert spec["default"] == option.default
    assert option.server_var in option.description


def test_every_request_to_the_agent_carries_the_tables_agent_options() -> None:
    """The agent keeps no fallbacks: the retune and the advisor send every agent option, the
    table's default unless the caller gave its own."""
    sent = agent_options({"nvidia_smi": "/opt/bin/nvidia-smi", "window": 60})
    assert sorted(sent) == sorted(o.name for o in OPTIONS if o.scope == AGENT)
    assert sent["nvidia_smi"] == "/opt/bin/nvidia-smi"
    assert sent["poll_interval"] == BY_NAME["poll_interval"].default
    assert sent["secrets_file"] == _server_role("vars/main.yml")["_sglang_server_secrets_file"]
