"""The retune role's variables are the option table's: every sglang_retune_* variable in
defaults/main.yml and meta/argument_specs.yml (type, default, description), and passed by the
tasks to the action or used by the tasks themselves."""

from __future__ import annotations

import json
import re
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import yaml
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from cli_tools import cli

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.options import (
    ARGUMENT_SPEC,
    OPTIONS,
    ROLE,
    Option,
)

ROLE_DIR = Path(__file__).resolve().parents[4] / "roles" / "retune"
ROLE_OPTIONS = [o for o in OPTIONS if o.var]


def load(path: str) -> Any:
    return yaml.safe_load((ROLE_DIR / path).read_text())


def _plain(value: Any) -> Any:
    # Written as YAML prefers: 300 rather than 300.0.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def expected_spec(o: Option) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": o.type}
    if o.elements:
        spec["elements"] = o.elements
    if o.default is not None:
        spec["default"] = _plain(o.default)
    spec["description"] = o.description
    return spec


def expected_default(o: Option) -> Any:
    if o.server_var:
        return f"{{{{ {o.server_var} | default({json.dumps(_plain(o.default))}) }}}}"
    return o.default


def test_argument_specs_are_the_table() -> None:
    options = load("meta/argument_specs.yml")["argument_specs"]["main"]["options"]
    expected = {o.var: expected_spec(o) for o in ROLE_OPTIONS}
    assert options == expected, yaml.safe_dump(expected, sort_keys=False, width=100)


def test_defaults_are_the_table() -> None:
    defaults = load("defaults/main.yml")
    assert defaults == {o.var: expected_default(o) for o in ROLE_OPTIONS}


def _tasks(tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for task in tasks:
        out.append(task)
        for key in ("block", "rescue", "always"):
            out.extend(_tasks(task.get(key, [])))
    return out


def test_the_tasks_pass_every_option_to_the_action() -> None:
    (task,) = [t for t in _tasks(load("tasks/main.yml")) if "sglang_ops.fleet.retune" in t]
    args = task["sglang_ops.fleet.retune"]
    expected = {"instances": "{{ sglang_server_resolved.instances }}"}
    for o in OPTIONS:
        if o.scope == ROLE or o.name == "instances":
            continue
        if o.var:
            expected[o.name] = f"{{{{ {o.var} }}}}"
        elif o.server_var:
            expected[o.name] = f"{{{{ {o.server_var} | default({_plain(o.default)!r}) }}}}"
    # The others (the agent's paths on the host) are the action's own defaults.
    assert args == expected
    assert task["register"] == "sglang_retune_result"


def test_the_tasks_use_every_role_only_option() -> None:
    text = (ROLE_DIR / "tasks" / "main.yml").read_text()
    for o in OPTIONS:
        if o.scope == ROLE:
            assert re.search(r"\b" + o.var + r"\b", text), o.var


def test_the_retune_is_marked_and_the_lock_given_back_whatever_happened() -> None:
    tasks = load("tasks/main.yml")
    assert tasks[0]["ansible.builtin.set_fact"] == {"sglang_retune_host_state": "started"}
    assert tasks[-1]["ansible.builtin.set_fact"] == {"sglang_retune_host_state": "done"}
    # The renamed variables are refused before the lock is taken or anything is written.
    assert tasks[1]["ansible.builtin.import_tasks"] == "validate.yml"
    (locked,) = [t for t in tasks if "block" in t]
    assert "lock_run_id" in locked["module_defaults"]["sglang_ops.fleet.server_units"]
    assert locked["always"] == [
        {
            "name": "Give the host lock back",
            "sglang_ops.fleet.host_lock": {"state": "released"},
            # Under the fleet lock, retune.yml's last play gives every lease of the run back; a
            # host lost mid-retune (it stopped answering) is asked nothing more, this included.
            "when": [
                "not (sglang_retune_fleet_lock | bool)",
                "(sglang_retune_result | default({})).host_lost is not defined",
            ],
        }
    ]


def test_the_role_never_stops_the_clients_itself() -> None:
    """The clients are the action's: drained per wave, or stopped and started again by it in a
    finally. The role no longer stops every client for the host's whole retune."""
    all_tasks = _tasks(load("tasks/main.yml"))
    assert [t for t in all_tasks if "ansible.builtin.systemd_service" in t or "ansible.builtin.command" in t] == []
    text = (ROLE_DIR / "tasks" / "main.yml").read_text()
    assert "pause_units" not in text
    (task,) = [t for t in all_tasks if "sglang_ops.fleet.retune" in t]
    assert task["sglang_ops.fleet.retune"]["client_units"] == "{{ sglang_retune_client_units }}"
    assert task["sglang_ops.fleet.retune"]["client_drain"] == "{{ sglang_retune_client_drain }}"


def test_the_validation_refuses_the_renamed_pause_units() -> None:
    (check,) = load("tasks/validate.yml")
    assert check["ansible.builtin.assert"]["that"] == ["sglang_retune_pause_units is not defined"]
    assert "renamed to sglang_retune_client_units" in check["ansible.builtin.assert"]["fail_msg"]


def _validate_playbook(tmp_path: Path, extra: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    playbook = tmp_path / "validate.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Validate",
                    "hosts": "localhost",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "name": "Validate the retune variables",
                            "ansible.builtin.include_role": {
                                "name": "sglang_ops.fleet.retune",
                                "tasks_from": "validate",
                            },
                        }
                    ],
                }
            ]
        )
    )
    (tmp_path / "extra.json").write_text(json.dumps(extra))
    return subprocess.run(
        [
            cli("ansible-playbook"),
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            f"@{tmp_path / 'extra.json'}",
            str(playbook),
        ],
        cwd=ROLE_DIR.parents[1],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_playbook_setting_the_old_name_fails_in_the_validation(tmp_path: Path) -> None:
    refused = _validate_playbook(tmp_path, {"sglang_retune_pause_units": ["my-client.service"]})
    assert refused.returncode != 0
    assert "sglang_retune_pause_units was renamed to sglang_retune_client_units" in refused.stdout
    accepted = _validate_playbook(tmp_path, {"sglang_retune_client_units": ["my-client.service"]})
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr


def test_the_action_takes_the_role_defaults_as_its_own() -> None:
    # What the tasks pass when no variable is set (the server role's unset too): the action must
    # accept it (null for "no limit", "no check") and end with its own defaults.
    defaults = load("defaults/main.yml")
    by_var = {o.var: o for o in ROLE_OPTIONS}
    rendered = {var: by_var[var].default if by_var[var].server_var else value for var, value in defaults.items()}
    args = {o.name: rendered[o.var] for o in OPTIONS if o.var and o.scope != ROLE}
    validated = ArgumentSpecValidator(ARGUMENT_SPEC).validate({"instances": [], **args})
    assert validated.error_messages == []
    assert validated.validated_parameters == {
        "instances": [],
        **{n: s.get("default") for n, s in ARGUMENT_SPEC.items() if n != "instances"},
    }


def test_the_collection_artifact_carries_the_role(tmp_path: Path) -> None:
    galaxy = cli("ansible-galaxy")
    subprocess.run(
        [str(galaxy), "collection", "build", "--output-path", str(tmp_path), str(ROLE_DIR.parents[1])],
        check=True,
        capture_output=True,
    )
    (artifact,) = tmp_path.glob("sglang_ops-fleet-*.tar.gz")
    with tarfile.open(artifact) as tar:
        names = set(tar.getnames())
    role_files = {str(p.relative_to(ROLE_DIR.parents[1])) for p in ROLE_DIR.rglob("*") if p.is_file()}
    assert role_files <= names
    assert "plugins/plugin_utils/_retune/options.py" in names
