"""The filters that describe the files the server role installs."""

from __future__ import annotations

from pathlib import Path

from ansible_collections.sglang_ops.fleet.plugins.filter import server_files
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.bundle import bundle_source

REPO_ROOT = Path(__file__).resolve().parents[4]


def test_host_agent_file_installs_the_agent_package_in_one_file() -> None:
    entry = server_files.host_agent_file("/usr/local/libexec/sglang-fleet/sglang_fleet_agent.py")
    assert entry == {
        "path": "/usr/local/libexec/sglang-fleet/sglang_fleet_agent.py",
        "content": bundle_source(),
        "mode": "0644",
    }


def test_filters_are_registered_under_their_names() -> None:
    assert server_files.FilterModule().filters() == {
        "desired_record": server_files.desired_record,
        "place_file": server_files.place_file,
        "host_agent_file": server_files.host_agent_file,
    }
