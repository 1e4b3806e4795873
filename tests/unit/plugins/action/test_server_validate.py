"""The server_validate action: controller-only, honest in check mode, one result contract."""

from __future__ import annotations

from typing import Any
from unittest.mock import MagicMock, patch

import pytest
import yaml
from ansible.errors import AnsibleActionFail
from ansible.parsing.dataloader import DataLoader
from ansible.playbook.play_context import PlayContext
from ansible.template import Templar, trust_as_template

from ansible_collections.sglang_ops.fleet.plugins.action import server_validate
from ansible_collections.sglang_ops.fleet.plugins.action.server_validate import ActionModule
from ansible_collections.sglang_ops.fleet.plugins.modules import server_validate as server_validate_doc


def make_action(args: dict[str, Any] | None = None, check_mode: bool = False) -> ActionModule:
    task = MagicMock()
    task.args = args or {}
    task.check_mode = check_mode
    task.async_val = 0
    task.action = "sglang_ops.fleet.server_validate"
    connection = MagicMock()
    connection._shell.tmpdir = None
    loader = DataLoader()
    action = ActionModule(task, connection, PlayContext(), loader, Templar(loader=loader), None)
    remote = AssertionError("server_validate must not run anything on the host")
    action._execute_module = MagicMock(side_effect=remote)  # type: ignore[method-assign]
    action._low_level_execute_command = MagicMock(side_effect=remote)  # type: ignore[method-assign]
    action._transfer_data = MagicMock(side_effect=remote)  # type: ignore[method-assign]
    return action


def task_vars(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "inventory_hostname": "b200-node",
        "sglang_server_version": "0.5.23",
        "sglang_server_model_path": "Qwen/Qwen3.6-27B",
        "sglang_server_gpu_count": 2,
        "unrelated_variable": "{{ this_is_never_templated }}",
    }
    base.update(overrides)
    return base


def test_plugin_contract() -> None:
    assert ActionModule.TRANSFERS_FILES is False
    assert ActionModule._requires_connection is False
    assert ActionModule._supports_check_mode is True


def test_documentation_stub_describes_what_the_action_returns() -> None:
    """ansible-doc reads plugins/modules/server_validate.py: it must document every key returned."""
    docs = yaml.safe_load(server_validate_doc.DOCUMENTATION)
    assert docs["module"] == "server_validate"
    assert yaml.safe_load(server_validate_doc.EXAMPLES)
    documented = set(yaml.safe_load(server_validate_doc.RETURN)["instances"]["contains"])
    action = make_action(check_mode=False)
    result = action.run(task_vars=task_vars())
    returned = set(result["instances"][0])
    assert returned <= documented, returned - documented


@pytest.mark.parametrize("check_mode", [False, True])
def test_success_returns_the_instances_and_sets_the_fact(check_mode: bool) -> None:
    action = make_action(check_mode=check_mode)
    result = action.run(task_vars=task_vars(sglang_server_args={"max_running_requests": 64}))
    assert result["changed"] is False
    assert not result.get("failed")
    instances = result["instances"]
    assert [i["name"] for i in instances] == ["gpu0", "gpu1"]
    assert result["sglang_server_instances_resolved"] == instances
    assert result["ansible_facts"] == {"sglang_server_instances_resolved": instances}
    assert "--max-running-requests" in instances[0]["argv"]
    action._execute_module.assert_not_called()  # type: ignore[attr-defined]


def test_failure_lists_every_problem_with_host_instance_and_variable() -> None:
    action = make_action()
    result = action.run(
        task_vars=task_vars(
            sglang_server_gpu_count=3,
            sglang_server_instances=[
                {"name": "a", "gpus": [0], "port": 30000},
                {"name": "b", "gpus": [0], "port": 30000},
                {"name": "c", "gpus": [2], "port": 30002, "args": {"max_mamba_cache_sze": 100}},
            ],
        )
    )
    assert result["failed"] is True
    assert result["changed"] is False
    assert "instances" not in result
    assert result["problems"] == [
        "host b200-node: port 30000 is used by instances a and b; give each instance its own port",
        "host b200-node: GPU 0 is used by instances a and b; an instance needs its GPUs to itself",
        "host b200-node, instance c: sglang_server_instances[2].args.max_mamba_cache_sze: SGLang 0.5.23 has no "
        "setting 'max_mamba_cache_sze'; did you mean max_mamba_cache_size?",
    ]
    assert result["msg"].startswith("SGLang settings of host b200-node: 3 problems\n- host b200-node: port 30000")


def test_warnings_are_displayed_once_each() -> None:
    action = make_action()
    with patch.object(server_validate.display, "warning") as warning:
        result = action.run(task_vars=task_vars(sglang_server_args={"disable_cuda_graph": True}))
    assert not result.get("failed")
    # The same group-level warning appears in both instances' lists but is shown once.
    assert warning.call_count == 1
    assert "disable_cuda_graph" in warning.call_args.args[0]
    assert all(len(i["warnings"]) == 1 for i in result["instances"])


def test_inventory_templates_are_resolved() -> None:
    action = make_action()
    result = action.run(
        task_vars=task_vars(
            model_root="/models",
            sglang_server_model_path=trust_as_template("{{ model_root }}/Qwen3.6-27B"),
        )
    )
    assert result["instances"][0]["args"]["model_path"] == "/models/Qwen3.6-27B"


def test_options_are_refused() -> None:
    with pytest.raises(AnsibleActionFail, match="hostvars_override"):
        make_action(args={"hostvars_override": {}}).run(task_vars=task_vars())


def test_settings_the_release_refuses_at_startup_fail_before_anything_runs() -> None:
    """retune.yml validates every host first: an explicit no_buffer without
    disable_overlap_schedule on 0.5.23 fails here, naming SGLang's own message and the fix, and
    nothing runs on the host (no PID changes)."""
    action = make_action()
    result = action.run(task_vars=task_vars(sglang_server_host_args={"mamba_radix_cache_strategy": "no_buffer"}))
    assert result["failed"] is True and "instances" not in result
    assert len(result["problems"]) == 2  # one per instance
    first = result["problems"][0]
    assert first.startswith("host b200-node, instance gpu0: SGLang 0.5.23 refuses to start with ")
    assert "no_buffer do not support overlap schedule. Try to set disable_overlap_schedule=True." in first
    assert "(sglang/srt/arg_groups/mamba_hook.py:158); add disable_overlap_schedule: true" in first
    action._execute_module.assert_not_called()  # type: ignore[attr-defined]
    fixed = {"mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True}
    result = make_action().run(task_vars=task_vars(sglang_server_host_args=fixed))
    assert not result.get("failed")
    assert "--disable-overlap-schedule" in result["instances"][0]["argv"]
