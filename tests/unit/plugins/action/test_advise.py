"""The advise action plugin with the connection patched (as test_retune.py does): the observe
module execution it makes, the advice per instance, the Prometheus path, and the fleet report
with the patch file written on the controller."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.playbook.play_context import PlayContext
from ansible.template import Templar
from simulated_instance import B200, MTP_AND_80_SLOTS, SIM_B200_JOURNAL

from ansible_collections.sglang_ops.fleet.plugins.action import advise as advise_action
from ansible_collections.sglang_ops.fleet.plugins.action.advise import ARGUMENT_SPEC, ActionModule
from ansible_collections.sglang_ops.fleet.plugins.action.advise_report import ActionModule as ReportAction
from ansible_collections.sglang_ops.fleet.plugins.modules import advise as advise_doc
from ansible_collections.sglang_ops.fleet.plugins.modules import advise_report as report_doc
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.model_facts import JOURNAL_PATTERN
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.resolve import resolve_instances

# inventories/demo/group_vars/sglang_servers.yml: the 7 x B200 run before its retune.
HOST_ARGS = {**MTP_AND_80_SLOTS, "reasoning_parser": "qwen3"}
HOSTVARS = {
    "sglang_server_version": "0.5.23",
    "sglang_server_model_path": "Qwen/Qwen3.6-27B",
    "sglang_server_gpu_count": 1,
    "sglang_server_args": {"enable_metrics": True},
    "sglang_server_host_args": HOST_ARGS,
}
# What the simulator prints and serves for it (simulated_instance): its startup lines from the
# weights loaded on, without the cap warning.
JOURNAL = [line for line in SIM_B200_JOURNAL[1:] if "is capped to" not in line]
SERVER_INFO = {
    **HOST_ARGS,
    "enable_metrics": True,
    "mamba_radix_cache_strategy": "auto",
    "mem_fraction_static": 0.854,
    "max_running_requests": 48,
    "max_total_num_tokens": 941074,
    "max_req_input_len": 262138,
    "internal_states": [{"effective_max_running_requests_per_dp": 16, "max_mamba_cache_size": 80}],
    "version": "0.5.23",
}


def samples(n: int = 13) -> list[dict[str, Any]]:
    return [
        {
            "t": 5.0 * i,
            "num_running_reqs": 16.0,
            "num_queue_reqs": 240.0,
            "token_usage": 0.03,
            "num_used_tokens": 28000.0,
            "mamba_usage": 1.0,
            "gen_throughput": 1200.0,
        }
        for i in range(n)
    ]


def observed(with_samples: bool = True) -> dict[str, Any]:
    return {
        "changed": False,
        "instances": {
            "gpu0": {
                "name": "gpu0",
                "running": True,
                "server_info": copy.deepcopy(SERVER_INFO),
                "journal": list(JOURNAL),
                "samples": samples() if with_samples else [],
                "metrics_errors": [],
            }
        },
        "containers": {
            "host": {
                "gpus": {"0": {"total_mib": B200, "used_mib_min": 150000, "used_mib_max": 158989, "samples": 13}},
                "gpu_error": None,
                "window_s": 60.0,
            }
        },
    }


def resolved() -> list[dict[str, Any]]:
    return resolve_instances("b200-node", HOSTVARS)


def make_action(args: dict[str, Any], action: type[ActionModule] = ActionModule) -> ActionModule:
    task = MagicMock()
    task.args = args
    task.check_mode = False
    task.diff = False
    task.async_val = 0
    task.action = "sglang_ops.fleet.advise" if action is ActionModule else "sglang_ops.fleet.advise_report"
    connection = MagicMock()
    connection._shell.tmpdir = None
    loader = DataLoader()
    return action(task, connection, PlayContext(), loader, Templar(loader=loader), None)


def task_vars(**more: Any) -> dict[str, Any]:
    return {"inventory_hostname": "b200-node", **copy.deepcopy(HOSTVARS), **more}


def test_the_observe_phase_and_the_advice_per_instance() -> None:
    action = make_action(
        {"instances": resolved(), "window": 60, "interval": 5, "client_units": ["sglang-fleet-generate.service"]}
    )
    action._execute_module = MagicMock(return_value=observed())  # type: ignore[method-assign]
    result = action.run(task_vars=task_vars())
    call = action._execute_module.call_args.kwargs
    assert call["module_name"] == "sglang_ops.fleet.advise_observe"
    assert call["module_args"]["instances"] == [
        {
            "name": "gpu0",
            "unit": "sglang-gpu0.service",
            "gpus": [0],
            "port": 30000,
            "container": None,
            "http_host": "127.0.0.1",
        }
    ]
    assert call["module_args"]["options"] == {
        "window": 60.0,
        "interval": 5.0,
        "sample_metrics": True,
        "journal_pattern": JOURNAL_PATTERN,
        "nvidia_smi": "nvidia-smi",
        "nvidia_smi_timeout": 20.0,
        "http_timeout": 30.0,
        "client_units": ["sglang-fleet-generate.service"],
        # The agent keeps no fallbacks: the rest of the agent's options, from the retune's table.
        "devices_dir": "/dev",
        "supervisor": "systemd",
        "supervisor_root": "/workspace/sglang-fleet",
        "poll_interval": 0.5,
        "stall_probe_s": 5.0,
        "secrets_file": "/etc/sglang-fleet/secrets.env",
        "state_dir": "/var/lib/sglang-fleet",
        "desired_dir": "/etc/sglang-fleet/instances",
    }
    assert result["changed"] is False and "failed" not in result
    assert result["inventory"] == {
        "sglang_server_args": {"enable_metrics": True},
        "sglang_server_host_args": HOST_ARGS,
        # The default layout written out as entries (advise --trial's canary override).
        "instances": [{"name": "gpu0", "gpus": [0], "port": 30000}],
    }
    (advice,) = result["instances"]
    assert advice["diagnosis"] == "mamba-bound" and advice["model_check"] is True
    assert advice["proposal"]["effective_max_before"] == 16 and advice["proposal"]["effective_max_after"] > 16
    assert result["source"] == "sampled /metrics"


def test_a_client_that_did_not_answer_is_named_in_the_advice() -> None:
    got = observed()
    got["containers"]["host"]["clients_problems"] = [
        "generation client gen.service runs but did not answer on its control socket: timed out"
    ]
    action = make_action({"instances": resolved(), "window": 60, "interval": 5, "client_units": ["gen.service"]})
    action._execute_module = MagicMock(return_value=got)  # type: ignore[method-assign]
    (advice,) = action.run(task_vars=task_vars())["instances"]
    assert advice["problems"][-1] == got["containers"]["host"]["clients_problems"][0]


def test_prometheus_replaces_the_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[Any, ...]] = []

    def read_samples(url: str, selector: str, start: float, end: float, step: float, timeout: float, **kw: Any) -> Any:
        asked.append((url, selector, round(end - start), step, timeout))
        return samples(), []

    monkeypatch.setattr(advise_action._prometheus, "read_samples", read_samples)
    action = make_action(
        {"instances": resolved(), "window": 600, "interval": 15, "prometheus_url": "http://prometheus:9090"}
    )
    action._execute_module = MagicMock(return_value=observed(with_samples=False))  # type: ignore[method-assign]
    result = action.run(task_vars=task_vars(ansible_host="10.1.2.7"))
    # A selector of one's own: the scrape target.
    other = make_action(
        {
            "instances": resolved(),
            "prometheus_url": "http://prometheus:9090",
            "prometheus_selector": 'instance="{host}:{port}"',
        }
    )
    other._execute_module = MagicMock(return_value=observed(with_samples=False))  # type: ignore[method-assign]
    other.run(task_vars=task_vars(ansible_host="10.1.2.7"))
    assert asked[-1][1] == 'instance="10.1.2.7:30000"'
    asked.pop()
    assert action._execute_module.call_args.kwargs["module_args"]["options"]["sample_metrics"] is False
    assert asked == [("http://prometheus:9090", 'host="b200-node",instance_name="gpu0"', 600, 15.0, 30.0)]
    assert result["source"] == "prometheus" and result["instances"][0]["diagnosis"] == "mamba-bound"


def test_prometheus_ca_bundle_and_credentials_reach_the_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    accesses: list[Any] = []

    def read_samples(*args: Any, access: Any, **kw: Any) -> Any:
        accesses.append(access)
        return samples(), []

    monkeypatch.setattr(advise_action._prometheus, "read_samples", read_samples)
    action = make_action(
        {
            "instances": resolved(),
            "prometheus_url": "https://prometheus:9090",
            "prometheus_ca_path": "/etc/ssl/prometheus-ca.pem",
            "prometheus_username": "advisor",
            "prometheus_password": "s3cret",
        }
    )
    action._execute_module = MagicMock(return_value=observed(with_samples=False))  # type: ignore[method-assign]
    result = action.run(task_vars=task_vars())
    assert accesses == [
        advise_action._prometheus.Access(
            ca_path="/etc/ssl/prometheus-ca.pem", validate_certs=True, username="advisor", password="s3cret"
        )
    ]
    assert "s3cret" not in repr(result)


def test_a_failed_observe_phase_is_a_host_problem_not_a_failed_task() -> None:
    action = make_action({"instances": resolved()})
    action._execute_module = MagicMock(return_value={"failed": True, "msg": "host: rc=1"})  # type: ignore[method-assign]
    result = action.run(task_vars=task_vars())
    assert "failed" not in result and result["instances"] == []
    assert result["host_problem"] == "the observe phase failed: host: rc=1"


def test_the_fleet_report_writes_the_patch_on_the_controller(tmp_path: Path) -> None:
    per_host = make_action({"instances": resolved(), "window": 60, "interval": 5})
    per_host._execute_module = MagicMock(return_value=observed())  # type: ignore[method-assign]
    host_result = per_host.run(task_vars=task_vars())
    out = tmp_path / "advice" / "sglang-fleet-advice.yml"
    action = make_action(
        {"results": {"b200-node": host_result, "pve-rtx": {"host_problem": "no result"}}, "output": str(out)},
        ReportAction,
    )
    action._execute_module = MagicMock(side_effect=AssertionError("the report runs nothing on a host"))  # type: ignore[method-assign]
    result = action.run(task_vars=task_vars())
    assert result["changed"] is False and result["advice_produced"] is True
    assert result["patch_path"] == str(out)
    patch = yaml.safe_load(out.read_text())
    host_args = patch["host_vars"]["b200-node"]["sglang_server_host_args"]
    assert host_args["reasoning_parser"] == "qwen3"
    assert host_args["max_mamba_cache_size"] > 80 or host_args.get("mamba_radix_cache_strategy") == "no_buffer"
    assert result["report"]["host_problems"] == {"pve-rtx": "no result"}
    assert result["report_lines"][2] == "b200-node/gpu0 (1 instance, SGLang 0.5.23): MAMBA-BOUND"
    assert "pve-rtx: no advice: no result" in result["report_lines"]
    assert result["text"].startswith(
        "sglang-fleet advice (sampled /metrics, window 60 s, every 5 s); nothing was changed"
    )


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ({}, "instances is required: the resolved instances of sglang_ops.fleet.server_validate"),
        ({"instances": [], "window": 0}, "window must be > 0"),
        ({"instances": [], "window": 5, "interval": 10}, "interval must not exceed window"),
        ({"instances": [], "policy": {"nope": 1}}, "policy: unknown key(s) ['nope']"),
        (
            {"instances": [], "prometheus_url": "prom:9090"},
            "prometheus_url 'prom:9090' must start with http:// or https://",
        ),
        ({"instances": [{"name": "gpu0"}]}, "instances[0] lacks ['unit', 'gpus', 'port', 'version', 'args']"),
    ],
)
def test_invalid_arguments(args: dict[str, Any], problem: str) -> None:
    result = make_action(args).run(task_vars=task_vars())
    assert result["failed"] is True and problem in result["msg"]


def test_the_documentation_stub_has_the_actions_options() -> None:
    doc = yaml.safe_load(advise_doc.DOCUMENTATION)
    options = doc["options"]
    assert set(options) == set(ARGUMENT_SPEC)
    for name, spec in ARGUMENT_SPEC.items():
        assert options[name]["type"] == spec["type"], name
        assert options[name].get("default") == spec.get("default"), name
        assert options[name].get("elements") == spec.get("elements"), name
    returned = yaml.safe_load(advise_doc.RETURN)
    assert {"instances", "inventory", "host_problem"} <= set(returned)
    reported = yaml.safe_load(report_doc.RETURN)
    assert {"report", "text", "report_lines", "patch_path", "patch_yaml", "advice_produced"} <= set(reported)
