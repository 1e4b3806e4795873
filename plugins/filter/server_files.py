# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Filters the server role uses to describe the files it installs."""

from __future__ import annotations

import json
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.bundle import bundle_source

RECORD_KEYS = (
    "name",
    "unit",
    "version",
    "gpus",
    "port",
    "container",
    "fingerprint",
    "argv",
    "env",
    "expected_server_info",
    "served_model_name",
)


def desired_record(instance: dict[str, Any]) -> str:
    """As the JSON text written to the host (sorted keys, so an unchanged record is unchanged)."""
    return json.dumps({key: instance.get(key) for key in RECORD_KEYS}, indent=2, sort_keys=True) + "\n"


def place_file(container: Any, path: str, content: str, mode: str = "0644") -> dict[str, Any]:
    """A file entry for sglang_ops.fleet.server_units, placed on the host (container null) or
    in a container."""
    return {"container": container, "path": path, "content": content, "mode": mode}


def host_agent_file(path: str) -> dict[str, Any]:
    """A file entry that installs the host agent at ``path``: the whole agent package in one
    Python file, which the units' start guard imports, so that it reads /proc and nvidia-smi
    exactly as the retune does (the same agent the retune runs inside LXC containers)."""
    # Built from the package's files on the controller (the collection is on disk here).
    return {"path": path, "content": bundle_source(), "mode": "0644"}


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"desired_record": desired_record, "place_file": place_file, "host_agent_file": host_agent_file}
