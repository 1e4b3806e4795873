"""The settings table (``config.SETTINGS``) against what is derived from it or must agree with it:
the flags of ``sglang-fleet generate``, and the generation role's variables (defaults/main.yml and
meta/argument_specs.yml), the config it writes (tasks/configure.yml) and its environment file
(templates/generate.env.j2)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path
from typing import Any, get_origin

import jinja2
import pytest
import yaml

from sglang_fleet.cli import _generate_overrides, build_parser
from sglang_fleet.config import S3_ENV, SETTING, SETTINGS, Setting, build_config
from sglang_fleet.ids import ShardSpec

ROLE = Path(__file__).resolve().parents[2] / "roles" / "generation"

# A role variable is this prefix and the setting's flag destination (``s3.uri`` -> generation_s3_uri).
ROLE_PREFIX = "generation_"
# Role variables named for what they are on the host, not for the config key they set.
ROLE_RENAMED = {"prompts_file": "prompts", "output_dir": "output"}
# Role variables that set no client setting: installation, the service, secrets, and the parts from
# which the role builds the endpoint list.
ROLE_ONLY = {
    "prompts_src",
    "endpoint_host",
    "endpoint_base_port",
    "endpoint_count",
    "stop_margin",
    "s3_access_key_id",
    "s3_secret_access_key",
    "s3_session_token",
    "api_key",
    "secret_env",
    "python",
    "install_dir",
    "config_dir",
    "user",
    "manage_os_packages",
    "build_isolation",
    "pip_download_args",
    "build_cache_dir",
    "extra_config",
    "service_enabled",
    "service_state",
    "restart_sec",
    "start_limit_burst",
    "supervisor",
    "supervisor_root",
}
# Role defaults that differ from the client's on purpose. drain_timeout: the service gives requests in
# flight longer to finish on `systemctl stop` (its TimeoutStopSec grows with it). control_socket: the
# service always has one, in its runtime directory (the client alone has none unless asked).
ROLE_OWN_DEFAULT = {"drain_timeout", "control_socket"}


def role_var(s: Setting) -> str:
    return ROLE_PREFIX + {v: k for k, v in ROLE_RENAMED.items()}.get(s.dest, s.dest)


def setting_of(var: str) -> Setting | None:
    dest = var.removeprefix(ROLE_PREFIX)
    dest = ROLE_RENAMED.get(dest, dest)
    return next((s for s in SETTINGS if s.dest == dest), None)


def ansible_type(s: Setting) -> str:
    if len(s.value_types) > 1:
        return "raw"
    t = get_origin(s.value_types[0]) or s.value_types[0]
    names = {bool: "bool", int: "int", float: "float", str: "str", Path: "str", ShardSpec: "str", dict: "dict"}
    if t in names:
        return names[t]
    if t is list:
        return "list"
    return "dict" if dataclasses.is_dataclass(t) else "?"  # a dataclass is a nested mapping (reasoning)


def client_value(s: Setting, role_value: Any) -> Any:
    """A role value as the client reads it: the role writes "" for "not set"."""
    if role_value == "" and s.optional:
        return None
    (t,) = s.value_types if len(s.value_types) == 1 else (None,)
    if t is ShardSpec:
        return ShardSpec.parse(role_value)
    if t is not None and dataclasses.is_dataclass(t):
        return t(**role_value)  # type: ignore[operator]
    return role_value


def _load(rel: str) -> Any:
    return yaml.safe_load((ROLE / rel).read_text())


DEFAULTS: dict[str, Any] = _load("defaults/main.yml")
SPECS: dict[str, Any] = _load("meta/argument_specs.yml")["argument_specs"]["main"]["options"]
MAPPED = sorted((var, s) for var in SPECS if (s := setting_of(var)) is not None)


def test_every_role_variable_is_a_setting_or_declared_role_only() -> None:
    unmapped = {var.removeprefix(ROLE_PREFIX) for var in SPECS if setting_of(var) is None}
    assert unmapped == ROLE_ONLY
    assert set(DEFAULTS) | {v for v, spec in SPECS.items() if spec.get("required")} == set(SPECS)
    assert len(MAPPED) >= 20


def test_role_defaults_agree_with_argument_specs() -> None:
    for var, spec in SPECS.items():
        if spec.get("required"):
            assert var not in DEFAULTS and "default" not in spec, var
        elif "default" not in spec:
            # Computed by the role from other variables (a template): the description says it.
            assert "{{" in str(DEFAULTS[var]) and "Default" in str(spec["description"]), var
        else:
            assert spec["default"] == DEFAULTS[var], var


@pytest.mark.parametrize(("var", "s"), MAPPED, ids=[v for v, _ in MAPPED])
def test_role_variable_matches_its_setting(var: str, s: Setting) -> None:
    spec = SPECS[var]
    assert spec["type"] == ansible_type(s), f"{var}: type {spec['type']}, setting {s.key} is {s.type}"
    if s.choices:
        assert set(spec["choices"]) == set(s.choices) | ({""} if s.optional else set()), var
    if s.required or spec.get("required"):
        return  # the client has no default to agree with
    if "default" not in spec:
        return  # computed by the role per host (test_role_defaults_agree_with_argument_specs)
    role = client_value(s, spec["default"])
    name = var.removeprefix(ROLE_PREFIX)
    if name in ROLE_OWN_DEFAULT:
        assert role != s.default, f"{var} now has the client's default: drop it from ROLE_OWN_DEFAULT"
        return
    assert role == s.default, f"{var}: role default {spec['default']!r}, client default {s.default!r}"
    if isinstance(s.default, bool):
        assert isinstance(spec["default"], bool), var


def _config_keys(template: str) -> list[tuple[str, str]]:
    return re.findall(r"'(\w+)':\s*([\w']+)", template)


def test_the_config_the_role_writes_uses_setting_names() -> None:
    task = next(t for t in _load("tasks/configure.yml") if t["name"] == "Write the client config")
    pairs = _config_keys(task["vars"]["_generation_config"])
    s3_pairs = _config_keys(task["vars"]["_generation_s3"])
    assert len(pairs) >= 20 and len(s3_pairs) >= 3
    for section, found in (("", pairs), ("s3", s3_pairs)):
        for key, value in found:
            s = SETTING.get(f"{section}.{key}" if section else key)
            assert s is not None, f"configure.yml writes {key!r}, which is no setting"
            if value.startswith(ROLE_PREFIX):
                assert value == role_var(s), f"configure.yml sets {key!r} from {value}"
    literal = dict(pairs)
    env = dict(re.findall(r'^(\w+)="\{\{ (\w+) \}\}"$', (ROLE / "templates/generate.env.j2").read_text(), re.M))
    assert env[literal["api_key_env"].strip("'")] == "generation_api_key"
    for name, variable in S3_ENV.items():
        assert env[variable] == role_var(SETTING[f"s3.{name}"])


def test_the_stall_settings_are_role_variables_written_to_the_config() -> None:
    """How long a silent server is waited for is the operator's choice on a fleet too: each stall
    setting is a role variable (its default the client's, checked above) that the role writes."""
    task = next(t for t in _load("tasks/configure.yml") if t["name"] == "Write the client config")
    written = dict(_config_keys(task["vars"]["_generation_config"]))
    for key in ("stall_factor", "stall_min_s"):
        var = role_var(SETTING[key])
        assert var in SPECS and var in DEFAULTS, f"{key} has no role variable"
        assert written.get(key) == var, f"configure.yml does not write {key} from {var}"
        assert var in (ROLE / "README.md").read_text(), f"roles/generation/README.md does not name {var}"


def _role_vars() -> dict[str, Any]:
    """vars/main.yml with what can be rendered from the file alone rendered."""
    values: dict[str, Any] = dict(_load("vars/main.yml"))
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)  # noqa: S701  (paths, not HTML)
    for _ in range(5):
        for k, v in values.items():
            if isinstance(v, str) and "{{" in v:
                with contextlib.suppress(jinja2.TemplateError):  # needs a role variable or an Ansible filter
                    values[k] = env.from_string(v).render(values)
    return values


def test_the_control_socket_is_in_the_units_runtime_directory() -> None:
    """The retune finds a client's socket by its unit alone: /run/sglang-fleet/clients/UNIT/control.sock,
    in the unit's RuntimeDirectory (writable by its user under ProtectSystem=strict)."""
    v = _role_vars()
    unit = v["_generation_service"] + ".service"
    assert v["_generation_control_socket"] == f"/run/sglang-fleet/clients/{unit}/control.sock"
    assert v["_generation_control_socket"] == f"/run/{v['_generation_runtime_dir']}/control.sock"
    assert DEFAULTS["generation_control_socket"] == "{{ _generation_control_socket }}"
    assert v["_generation_control_socket"] in " ".join(SPECS["generation_control_socket"]["description"])
    template = (ROLE / "templates/sglang-fleet-generate.service.j2").read_text()
    assert "\nRuntimeDirectory={{ _generation_runtime_dir }}\n" in template
    assert "\nRuntimeDirectoryMode=0750\n" in template


# ---------------------------------------------------------------------- the flags
def _sample(s: Setting) -> tuple[list[str], Any]:
    """Arguments that set ``s`` to a value other than its default, and that value as configured."""
    assert s.flag is not None
    (t, *more) = s.value_types
    if more:  # concurrency: N or auto
        return [s.flag, "7"], 7
    if t is bool:
        return [s.flag], True
    if s.choices:
        value = next(c for c in s.choices if c != s.default)
        return [s.flag, value], value
    if t is ShardSpec:
        return [s.flag, "1/4"], ShardSpec(1, 4)
    if get_origin(t) is list:
        return [s.flag, "http://h:7/v1"], ["http://h:7"]
    if t is Path:
        return [s.flag, "sub/file"], Path("sub/file")
    if t in (int, float):
        return [s.flag, "77"], t(77)
    value = "s3://bucket/p" if s.key == "s3.uri" else "something"
    return [s.flag, value], value


def test_every_flag_sets_its_setting() -> None:
    flagged = [s for s in SETTINGS if s.flag is not None]
    args: list[str] = []
    expected = {}
    for s in flagged:
        a, v = _sample(s)
        args += a
        expected[s.key] = v
    cfg = build_config({}, _generate_overrides(build_parser().parse_args(["generate", *args])), environ={})
    for s in flagged:
        owner = getattr(cfg, s.section) if s.section else cfg
        assert getattr(owner, s.name) == expected[s.key], s.key
    assert len(flagged) >= 40


def test_absent_flags_leave_the_config_file_alone() -> None:
    file = {"prompts": "p", "output": "o", "endpoints": ["http://h:1"], "max_attempts": 9, "s3": {"part_size_mb": 8}}
    overrides = _generate_overrides(build_parser().parse_args(["generate", "--s3", "s3://b/p"]))
    cfg = build_config(file, overrides, environ={})
    assert cfg.max_attempts == 9
    assert cfg.s3 is not None and cfg.s3.part_size_mb == 8 and cfg.s3.uri == "s3://b/p"
