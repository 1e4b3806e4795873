"""The kept patch written into the inventory files (inventory_edit.py): the layer the patch names,
comments, order and quoting kept, a value changed vs added, bad layers refused before anything is
written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sglang_fleet_ops.inventory_edit import (
    HOST_ARGS,
    INSTANCES,
    InventoryEditError,
    plan_edits,
    proven_variables,
    write_edits,
)

HOST_FILE = """---
# b200-node: the big box in rack 4
ansible_host: 10.0.0.4   # the management network
sglang_server_host_args:
  # sized by hand after the OOM of 2026-11-02
  max_mamba_cache_size: 80
  chunked_prefill_size: "4096"  # quoted on purpose
sglang_server_gpu_count: 1
"""

INSTANCES_FILE = """---
sglang_server_instances:
  - name: gpu0
    gpus: [0]
    port: 30000
  # gpu1 serves the long-context jobs
  - name: gpu1
    gpus: [1]
    port: 30001
    args: {max_running_requests: 32}
"""


def inventory(tmp_path: Path, files: dict[str, str]) -> Path:
    inv = tmp_path / "inventory"
    (inv / "host_vars").mkdir(parents=True)
    (inv / "hosts.yml").write_text("all:\n  hosts:\n    b200-node: {}\n")
    for name, text in files.items():
        path = inv / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return inv


def new_host_args(**changes: Any) -> dict[tuple[str, str], dict[str, Any]]:
    args = {"max_mamba_cache_size": 80, "chunked_prefill_size": "4096", **changes}
    return {("host_vars", "b200-node"): {HOST_ARGS: args}}


def test_a_changed_value_keeps_every_other_line_byte_for_byte(tmp_path: Path) -> None:
    inv = inventory(tmp_path, {"host_vars/b200-node.yml": HOST_FILE})
    (edit,) = plan_edits(inv, new_host_args(max_mamba_cache_size=156))
    assert edit.path == inv / "host_vars" / "b200-node.yml"
    assert edit.after == HOST_FILE.replace("max_mamba_cache_size: 80", "max_mamba_cache_size: 156")


def test_an_added_value_goes_at_the_end_of_its_mapping(tmp_path: Path) -> None:
    inv = inventory(tmp_path, {"host_vars/b200-node.yml": HOST_FILE})
    (edit,) = plan_edits(inv, new_host_args(max_mamba_cache_size=156, mamba_radix_cache_strategy="no_buffer"))
    expected = HOST_FILE.replace("max_mamba_cache_size: 80", "max_mamba_cache_size: 156").replace(
        '"4096"  # quoted on purpose\n', '"4096"  # quoted on purpose\n  mamba_radix_cache_strategy: no_buffer\n'
    )
    assert edit.after == expected


def test_a_value_set_back_to_sglangs_default_is_removed(tmp_path: Path) -> None:
    inv = inventory(tmp_path, {"host_vars/b200-node.yml": HOST_FILE})
    variables = {("host_vars", "b200-node"): {HOST_ARGS: {"max_mamba_cache_size": 80}}}
    (edit,) = plan_edits(inv, variables)
    assert "chunked_prefill_size" not in edit.after
    assert "# sized by hand after the OOM" in edit.after and "ansible_host: 10.0.0.4   # the management" in edit.after


def test_nothing_is_written_until_write_edits(tmp_path: Path) -> None:
    inv = inventory(tmp_path, {"host_vars/b200-node.yml": HOST_FILE})
    edits = plan_edits(inv, new_host_args(max_mamba_cache_size=156))
    assert (inv / "host_vars" / "b200-node.yml").read_text() == HOST_FILE
    write_edits(edits)
    assert "max_mamba_cache_size: 156" in (inv / "host_vars" / "b200-node.yml").read_text()


def test_the_instances_list_is_updated_in_place_by_name(tmp_path: Path) -> None:
    inv = inventory(tmp_path, {"host_vars/b200-node.yaml": INSTANCES_FILE})
    layout = [
        {"name": "gpu0", "gpus": [0], "port": 30000, "args": {"max_mamba_cache_size": 156}},
        {"name": "gpu1", "gpus": [1], "port": 30001, "args": {"max_running_requests": 32}},
    ]
    (edit,) = plan_edits(inv, {("host_vars", "b200-node"): {INSTANCES: layout}})
    assert edit.path.name == "b200-node.yaml"
    assert edit.after == INSTANCES_FILE.replace(
        "    port: 30000\n", "    port: 30000\n    args:\n      max_mamba_cache_size: 156\n"
    )


def test_a_host_without_a_file_gets_a_new_one(tmp_path: Path) -> None:
    inv = inventory(tmp_path, {})
    (edit,) = plan_edits(inv, new_host_args(max_mamba_cache_size=156))
    assert edit.before is None and edit.path == inv / "host_vars" / "b200-node.yml"
    assert edit.after.startswith("---\nsglang_server_host_args:\n  max_mamba_cache_size: 156\n")


def test_the_file_in_a_host_directory_that_holds_the_variable(tmp_path: Path) -> None:
    inv = inventory(
        tmp_path,
        {"host_vars/b200-node/main.yml": "---\nansible_host: 10.0.0.4\n", "host_vars/b200-node/tuning.yml": HOST_FILE},
    )
    (edit,) = plan_edits(inv, new_host_args(max_mamba_cache_size=156))
    assert edit.path == inv / "host_vars" / "b200-node" / "tuning.yml"


@pytest.mark.parametrize(
    ("files", "variables", "said"),
    [
        ({}, {("hosts", "b200-node"): {HOST_ARGS: {}}}, "only host_vars and group_vars"),
        ({}, {("host_vars", "../etc"): {HOST_ARGS: {}}}, "not a host or group name"),
        (
            {"host_vars/b200-node.yml": "$ANSIBLE_VAULT;1.1;AES256\n6231\n"},
            new_host_args(max_mamba_cache_size=156),
            "vault-encrypted",
        ),
        (
            {"host_vars/b200-node.yml": "sglang_server_host_args: !vault |\n  $ANSIBLE_VAULT;1.1;AES256\n  6231\n"},
            new_host_args(max_mamba_cache_size=156),
            "sglang_server_host_args is vault-encrypted",
        ),
        (
            {"host_vars/b200-node/a.yml": HOST_FILE, "host_vars/b200-node/b.yml": HOST_FILE},
            new_host_args(max_mamba_cache_size=156),
            "defined in several files",
        ),
        (
            {"host_vars/b200-node.yml": "sglang_server_host_args:\n   max_mamba_cache_size: 80\n"},
            new_host_args(max_mamba_cache_size=156),
            "would not be written back as it is",
        ),
        ({"host_vars/b200-node.yml": "- a list\n"}, new_host_args(), "not a mapping of variables"),
    ],
)
def test_a_bad_layer_or_file_is_refused_before_anything_is_written(
    tmp_path: Path, files: dict[str, str], variables: Any, said: str
) -> None:
    inv = inventory(tmp_path, files)
    before = {p: p.read_bytes() for p in inv.rglob("*") if p.is_file()}
    with pytest.raises(InventoryEditError, match=said):
        plan_edits(inv, variables)
    assert {p: p.read_bytes() for p in inv.rglob("*") if p.is_file()} == before


REPORT: dict[str, Any] = {
    "patch": {
        "host_vars": {
            "a": {HOST_ARGS: {"max_mamba_cache_size": 156}, "_changes": {}},
            "b": {INSTANCES: [], "_changes_by_instance": {}},
        }
    },
    "layouts": {
        "a": [{"name": "gpu0"}, {"name": "gpu1"}],
        "b": [{"name": "gpu0", "args": {"x": 1}}, {"name": "gpu1", "args": {"y": 2}}],
    },
    "instances": [
        {"host": "b", "name": "gpu0", "args_after": {"x": 1, "max_mamba_cache_size": 156}},
        {"host": "b", "name": "gpu1", "args_after": {"y": 2, "max_mamba_cache_size": 99}},
    ],
}


def test_the_variables_proven_are_the_tried_groups_only() -> None:
    found = proven_variables(REPORT, ["a/gpu0", "a/gpu1", "b/gpu0"])
    assert found[("host_vars", "a")] == {HOST_ARGS: {"max_mamba_cache_size": 156}}
    # b/gpu1 was not in the group tried: its entry stays as the inventory has it.
    assert found[("host_vars", "b")] == {
        INSTANCES: [{"name": "gpu0", "args": {"x": 1, "max_mamba_cache_size": 156}}, {"name": "gpu1", "args": {"y": 2}}]
    }


def test_host_args_of_a_host_not_wholly_tried_become_per_instance_args() -> None:
    report = {**REPORT, "instances": [{"host": "a", "name": "gpu0", "args_after": {"max_mamba_cache_size": 156}}]}
    found = proven_variables(report, ["a/gpu0"])
    assert found[("host_vars", "a")] == {
        INSTANCES: [{"name": "gpu0", "args": {"max_mamba_cache_size": 156}}, {"name": "gpu1"}]
    }
