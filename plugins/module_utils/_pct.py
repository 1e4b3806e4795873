# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Run the host agent where an instance lives: in this process on a bare host, or inside a
Proxmox LXC container through ``pct exec`` from the node.

Inside a container the whole agent package goes to the container's python3 as one ``-c`` payload
(``agent.bundle.command_payload``) and the request goes in on stdin, so nothing has to be
installed in the container beforehand and no secret ever appears on a command line.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent import ops
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.bundle import command_payload


def run_agent(
    request: dict[str, Any], container: int | None, pct: str = "pct", timeout: float | None = None
) -> dict[str, Any]:
    """One agent operation; a container's result has the same shape as a local one, and a
    failure to run the agent at all is a failed result quoting what was run."""
    if container is None:
        return ops.run(request)
    argv = [pct, "exec", str(container), "--", "python3", "-c", command_payload()]
    shown = f"{pct} exec {container} -- python3 -c <sglang-fleet agent>"
    try:
        proc = subprocess.run(
            argv, input=json.dumps(request), capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError as exc:
        return {"failed": True, "msg": f"ran {shown!r}: {exc}", "rc": 127}
    except subprocess.TimeoutExpired:
        return {"failed": True, "msg": f"ran {shown!r}: timed out after {timeout}s", "rc": None}
    out = proc.stdout.strip().splitlines()
    try:
        result = json.loads(out[-1]) if out else None
    except ValueError:
        result = None
    if proc.returncode != 0 or not isinstance(result, dict):
        return {
            "failed": True,
            "msg": (
                f"ran {shown!r} in container {container}: rc={proc.returncode}, "
                f"stdout={proc.stdout[-2000:]!r}, stderr={proc.stderr[-2000:]!r}"
            ),
            "rc": proc.returncode,
        }
    return result


def group_by_container(items: list[dict[str, Any]]) -> dict[int | None, list[dict[str, Any]]]:
    groups: dict[int | None, list[dict[str, Any]]] = {}
    for item in items:
        groups.setdefault(item.get("container"), []).append(item)
    return groups
