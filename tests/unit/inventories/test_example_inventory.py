"""inventories/example resolves, and every instance's argv is what its SGLang version parses back."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from ansible.inventory.manager import InventoryManager
from ansible.parsing.dataloader import DataLoader
from ansible.vars.manager import VariableManager

from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.settings import compare_server_info
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.checks import ServerArgsError
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.table import SWITCH, load_table
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.deploy import deployment_fields
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.render import (
    LAUNCH_MODULE,
    expected_server_info,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.resolve import (
    HOST_VARIABLES,
    resolve_instances,
)

INVENTORY = Path(__file__).resolve().parents[3] / "inventories" / "example" / "hosts.yml"


@pytest.fixture(scope="module")
def example_hostvars() -> dict[str, dict[str, Any]]:
    loader = DataLoader()
    inventory = InventoryManager(loader=loader, sources=[str(INVENTORY)])
    variables = VariableManager(loader=loader, inventory=inventory)
    result = {}
    for host in inventory.get_hosts():
        hostvars = variables.get_vars(host=host)
        result[host.name] = {name: hostvars[name] for name in HOST_VARIABLES if name in hostvars}
    return result


def parser_namespace(args: dict[str, Any], version: str) -> dict[str, Any]:
    """What the version's argparse must produce for these settings: dest -> value."""
    flags = load_table().flags(version)
    return {
        flags[name].dest: value for name, value in args.items() if not (flags[name].kind == SWITCH and value is False)
    }


def test_both_hosts_are_in_the_inventory(example_hostvars: dict[str, dict[str, Any]]) -> None:
    assert sorted(example_hostvars) == ["b200-node", "pve-rtx"]


def test_b200_node_resolves_to_seven_mtp_instances_on_0_5_23(example_hostvars: dict[str, dict[str, Any]]) -> None:
    instances = resolve_instances("b200-node", example_hostvars["b200-node"])
    assert [i["name"] for i in instances] == [f"gpu{i}" for i in range(7)]
    assert [i["port"] for i in instances] == list(range(30000, 30007))
    assert {i["container"] for i in instances} == {None}
    assert all(i["warnings"] == [] for i in instances)
    args = instances[3]["args"]
    assert args == {
        "base_gpu_id": 0,
        "enable_metrics": True,
        "host": "0.0.0.0",
        "mamba_full_memory_ratio": 0.6,
        "max_mamba_cache_size": 200,
        "max_running_requests": 64,
        "mem_fraction_static": 0.93,
        "model_path": "Qwen/Qwen3.6-27B",
        "port": 30003,
        "reasoning_parser": "qwen3",
        "served_model_name": "qwen3.6-27b",
        "speculative_algorithm": "EAGLE",
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
        "speculative_num_steps": 3,
        "tp_size": 1,
    }
    assert instances[3]["env"] == {"CUDA_VISIBLE_DEVICES": "3", "HF_HUB_OFFLINE": "1"}
    assert instances[3]["argv"][:3] == ["/workspace/sglang/venv/bin/python", "-m", LAUNCH_MODULE]


def test_b200_node_is_a_pod_on_a_mapped_ssh_port() -> None:
    """The seeds' B200 node as it was: a rented pod reached by SSH on a mapped port, data on /workspace."""
    loader = DataLoader()
    inventory = InventoryManager(loader=loader, sources=[str(INVENTORY)])
    hostvars = VariableManager(loader=loader, inventory=inventory).get_vars(host=inventory.get_host("b200-node"))
    assert (hostvars["ansible_port"], hostvars["ansible_user"]) == (36472, "root")
    assert hostvars["sglang_server_supervisor"] == "supervisord"
    assert hostvars["sglang_server_supervisor_root"].startswith("/workspace/")
    assert hostvars["sglang_server_python"].startswith("/workspace/")
    pve = VariableManager(loader=loader, inventory=inventory).get_vars(host=inventory.get_host("pve-rtx"))
    assert pve.get("sglang_server_supervisor", "systemd") == "systemd"


def test_pve_rtx_resolves_to_eight_instances_in_container_200_on_0_5_9(
    example_hostvars: dict[str, dict[str, Any]],
) -> None:
    instances = resolve_instances("pve-rtx", example_hostvars["pve-rtx"])
    assert [i["name"] for i in instances] == [f"gpu{i}" for i in range(8)]
    assert {i["container"] for i in instances} == {200}
    argv = instances[0]["argv"]
    assert argv[argv.index("--mamba-scheduler-strategy") + 1] == "no_buffer"
    assert argv[argv.index("--max-running-requests") + 1] == "128"
    assert "--mamba-radix-cache-strategy" not in argv
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1"


@pytest.mark.parametrize("hostname", ["b200-node", "pve-rtx"])
def test_every_instance_argv_parses_back_to_its_args(
    example_hostvars: dict[str, dict[str, Any]], sglang_argparse: Any, hostname: str
) -> None:
    instances = resolve_instances(hostname, example_hostvars[hostname])
    version = instances[0]["version"]
    assert version == {"b200-node": "0.5.23", "pve-rtx": "0.5.9"}[hostname]
    current = sglang_argparse.current_spellings(version)
    for instance in instances:
        words = instance["argv"][3:]
        assert all(w in current for w in words if w.startswith("--")), words
        assert sglang_argparse.parse(version, words) == parser_namespace(instance["args"], version)
        assert expected_server_info(instance["args"], version)["port"] == instance["port"]


def test_the_same_tuning_on_the_other_version_still_renders(example_hostvars: dict[str, dict[str, Any]]) -> None:
    """Moving pve-rtx to 0.5.23 needs no inventory change beyond the version: it writes
    disable_overlap_schedule down with no_buffer, which 0.5.14+ require."""
    upgraded = {**example_hostvars["pve-rtx"], "sglang_server_version": "0.5.23"}
    [first, *_unused] = resolve_instances("pve-rtx", upgraded)
    assert first["args"]["mamba_radix_cache_strategy"] == "no_buffer"
    assert first["args"]["disable_overlap_schedule"] is True
    assert "--mamba-radix-cache-strategy" in first["argv"]
    assert "--disable-overlap-schedule" in first["argv"]


def test_no_buffer_without_disable_overlap_schedule_would_not_start_on_0_5_23(
    example_hostvars: dict[str, dict[str, Any]],
) -> None:
    """What the inventory said before: 0.5.23 refuses it at startup, so the validator does."""
    args = {**example_hostvars["pve-rtx"]["sglang_server_host_args"], "disable_overlap_schedule": None}
    upgraded = {**example_hostvars["pve-rtx"], "sglang_server_version": "0.5.23", "sglang_server_host_args": args}
    with pytest.raises(ServerArgsError, match="no_buffer do not support overlap schedule"):
        resolve_instances("pve-rtx", upgraded)
    # 0.5.9 turns the overlap scheduler off itself: the same settings start there.
    assert resolve_instances("pve-rtx", {**upgraded, "sglang_server_version": "0.5.9"})


# --------------------------------------------------------------------------------------------------
# The simulator (tests/doubles/gpusim) starts with each real configuration, and reports it back.

SIMULATED_HOSTS = {
    "b200-node": {"sglang_version": "0.5.23", "gpus": {"count": 7, "name": "NVIDIA B200", "memory_total_mib": 183359}},
    "pve-rtx": {
        "sglang_version": "0.5.9",
        "gpus": {"count": 8, "name": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "memory_total_mib": 97887},
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("hostname", sorted(SIMULATED_HOSTS))
def test_the_simulator_starts_with_each_real_configuration(
    hostname: str, example_hostvars: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    instance = resolve_instances(hostname, example_hostvars[hostname])[-1]
    instance.update(deployment_fields(instance, example_hostvars[hostname]))
    port = _free_port()
    argv = [sys.executable, *instance["argv"][1:]]
    argv[argv.index("--port") + 1] = str(port)
    devices = tmp_path / "dev"
    config = dict(SIMULATED_HOSTS[hostname], devices_dir=str(devices), timing={"startup_s": 0.5, "warmup_poll_s": 0.1})
    (tmp_path / "config.json").write_text(json.dumps(config))
    env = dict(
        os.environ,
        GPUSIM_CONFIG=str(tmp_path / "config.json"),
        GPUSIM_STATE_DIR=str(tmp_path / "state"),
        **instance["env"],
    )
    subprocess.run([sys.executable, "-m", "gpusim.admin", "setup"], env=env, check=True, capture_output=True)
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        info = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                    if resp.status == 200:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=5) as r:
                            info = json.load(r)
                        break
            except OSError:
                pass
            time.sleep(0.2)
        assert info is not None, (tmp_path / "server.log").read_text()[-3000:]
        assert info["version"] == instance["version"]
        assert compare_server_info(dict(instance["expected_server_info"], port=port), info) == []
        assert info["internal_states"][0]["effective_max_running_requests_per_dp"] > 0
        if hostname == "b200-node":
            # The retune the project was started from: 200 Mamba slots, 5 per request with MTP.
            assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 40
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
        log.close()
