# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Action plugin sglang_ops.fleet.advise_report: the fleet report from every host's result of
sglang_ops.fleet.advise, and the inventory patch written on the controller (documentation:
plugins/modules/advise_report.py). Nothing runs on a host."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from ansible.plugins.action import ActionBase

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor import patch, report

ARGUMENT_SPEC: dict[str, dict[str, Any]] = {
    "results": {"type": "dict", "required": True},
    "output": {"type": "path"},
}


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(ARGUMENT_SPEC)
    _requires_connection = False

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result = super().run(tmp, task_vars or {})
        del tmp
        _validation, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        result.update(fleet_report(args))
        result["changed"] = False
        return result


def fleet_report(args: dict[str, Any]) -> dict[str, Any]:
    """The fleet report from every host's result, and the patch file on the controller."""
    results: dict[str, Any] = args["results"] or {}
    advices: list[dict[str, Any]] = []
    inventory: dict[str, Any] = {}
    host_problems: dict[str, str] = {}
    meta: dict[str, Any] = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for host, given in sorted(results.items()):
        res = given if isinstance(given, dict) else {}
        if res.get("host_problem") or not res.get("instances"):
            host_problems[host] = str(res.get("host_problem") or res.get("msg") or "no result")
        advices.extend(a for a in res.get("instances") or [] if isinstance(a, dict))
        inventory[host] = res.get("inventory") or {}
        for key in ("window_s", "interval_s", "source"):
            if res.get(key) is not None:
                meta.setdefault(key, res[key])
    out_report = report.fleet_report(advices, inventory, meta, host_problems)
    output = args.get("output")
    patch_text = patch.patch_yaml(out_report)
    written = None
    if output:
        write_file(output, patch_text)
        written = output
    out_report["patch_path"] = written
    text = report.report_text(out_report, written)
    return {
        "report": out_report,
        "text": text,
        "report_lines": text.rstrip("\n").splitlines(),
        "patch_path": written,
        "patch_yaml": patch_text,
        "advice_produced": out_report["advice_produced"],
        "msg": f"advice for {len(advices)} instance(s)" + (f"; patch: {written}" if written else ""),
    }


def write_file(path: str, content: str) -> None:
    """Atomic write on the controller (the directory is made if missing)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".advice-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(content)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
