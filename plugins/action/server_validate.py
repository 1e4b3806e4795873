"""Action sglang_ops.fleet.server_validate: check a host's SGLang variables on the controller.

Documentation: plugins/modules/server_validate.py (where ansible-doc looks for it).
"""

from __future__ import annotations

from typing import Any

from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.checks import ServerArgsError
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.resolve import (
    HOST_VARIABLES,
    resolve_instances,
)

display = Display()


# No options: everything is read from the host's variables.
ARGUMENT_SPEC: dict[str, Any] = {}


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False
    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        result: dict[str, Any] = super().run(tmp, task_vars)
        task_vars = task_vars or {}
        hostname = str(task_vars.get("inventory_hostname", "localhost"))

        # Inventory values may hold templates ("{{ model_root }}/Qwen3"); resolve them the way tasks see them.
        templar = self._templar.copy_with_new_env(available_variables=task_vars)
        hostvars = {name: templar.template(task_vars[name]) for name in HOST_VARIABLES if name in task_vars}

        try:
            instances = resolve_instances(hostname, hostvars)
        except ServerArgsError as exc:
            result.update(failed=True, changed=False, msg=str(exc), problems=exc.problems)
            return result

        for warning in dict.fromkeys(w for instance in instances for w in instance["warnings"]):
            display.warning(warning)
        result.update(
            changed=False,
            instances=instances,
            sglang_server_instances_resolved=instances,
            ansible_facts={"sglang_server_instances_resolved": instances},
        )
        return result
