"""Instances of a host: layout, layers, environment, unchecked flags, versions and the one
ResolvedInstance (_instances.resolve, _instances.layout, _instances.deploy)."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from typing import Any
from unittest.mock import MagicMock

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.playbook.play_context import PlayContext
from ansible.template import Templar

from ansible_collections.sglang_ops.fleet.plugins.action.server_validate import ActionModule
from ansible_collections.sglang_ops.fleet.plugins.filter.server_instances import server_instances
from ansible_collections.sglang_ops.fleet.plugins.modules import server_validate as server_validate_doc
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.checks import ServerArgsError
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.table import load_table
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.deploy import LAUNCHER
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.render import (
    expected_server_info,
    fingerprint,
    unchecked_cli_words,
)
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.resolve import (
    ResolvedInstance,
    resolve_host,
    resolve_instances,
)

# --------------------------------------------------------------------------------------------------
# Instances of a host


def host(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "sglang_server_version": "0.5.23",
        "sglang_server_model_path": "Qwen/Qwen3.6-27B",
        "sglang_server_gpu_count": 2,
    }
    base.update(overrides)
    return base


def failure(hostvars: dict[str, Any], name: str = "node1") -> list[str]:
    with pytest.raises(ServerArgsError) as exc:
        resolve_instances(name, hostvars)
    return exc.value.problems


def test_default_layout_one_instance_per_gpu() -> None:
    instances = resolve_instances("node1", host(sglang_server_args={"max_running_requests": 32}))
    assert [i["name"] for i in instances] == ["gpu0", "gpu1"]
    first = instances[0]
    assert list(first) == [
        "name",
        "unit",
        "gpus",
        "port",
        "container",
        "version",
        "flag_table",
        "args",
        "args_unchecked",
        "argv",
        "env",
        "warnings",
        "fingerprint",
        "http_host",
        "health_url",
        "self_sigkill_on_stop",
        "expected_server_info",
        "user",
        "served_model_name",
    ]
    assert first["unit"] == "sglang-gpu0.service"
    assert (first["gpus"], first["port"], first["container"]) == ([0], 30000, None)
    assert instances[1]["port"] == 30001
    assert first["args"] == {
        "base_gpu_id": 0,
        "host": "127.0.0.1",
        "max_running_requests": 32,
        "model_path": "Qwen/Qwen3.6-27B",
        "port": 30000,
        "tp_size": 1,
    }
    assert first["argv"] == [
        "/opt/sglang/venv/bin/python",
        "-m",
        "sglang.launch_server",
        "--base-gpu-id",
        "0",
        "--host",
        "127.0.0.1",
        "--max-running-requests",
        "32",
        "--model-path",
        "Qwen/Qwen3.6-27B",
        "--port",
        "30000",
        "--tp-size",
        "1",
    ]
    assert first["env"] == {"CUDA_VISIBLE_DEVICES": "0"}
    assert instances[1]["env"] == {"CUDA_VISIBLE_DEVICES": "1"}
    assert first["warnings"] == []
    assert first["fingerprint"] == fingerprint("0.5.23", first["argv"], first["env"])
    assert re.fullmatch(r"[0-9a-f]{64}", first["fingerprint"])
    assert (first["http_host"], first["health_url"]) == ("127.0.0.1", "http://127.0.0.1:30000/health")
    assert (first["self_sigkill_on_stop"], first["user"], first["served_model_name"]) == (False, "sglang", None)
    assert first["expected_server_info"] == expected_server_info(first["args"], "0.5.23")


def test_host_settings_and_container() -> None:
    instances = resolve_instances(
        "pve",
        host(
            sglang_server_version="0.5.9",
            sglang_server_python="/srv/venv/bin/python3",
            sglang_server_listen_host="0.0.0.0",
            sglang_server_base_port=31000,
            sglang_server_served_model_name="qwen",
            sglang_server_lxc_container=200,
        ),
    )
    assert [(i["port"], i["container"]) for i in instances] == [(31000, 200), (31001, 200)]
    args = instances[1]["args"]
    assert (args["host"], args["served_model_name"], args["port"]) == ("0.0.0.0", "qwen", 31001)
    assert instances[0]["argv"][0] == "/srv/venv/bin/python3"
    assert "--tensor-parallel-size" in instances[0]["argv"]


def test_explicit_tensor_parallel_layout() -> None:
    instances = resolve_instances(
        "node1",
        host(
            sglang_server_gpu_count=8,
            sglang_server_instances=[
                {"name": "big", "gpus": [0, 1, 2, 3], "port": 30000, "args": {"tp_size": 4}},
                {"name": "dp", "gpus": [4, 5, 6, 7], "port": 30010, "args": {"dp_size": 2}, "container": 101},
            ],
        ),
    )
    big, dp = instances
    assert (big["args"]["tp_size"], big["env"]["CUDA_VISIBLE_DEVICES"], big["container"]) == (4, "0,1,2,3", None)
    assert (dp["args"]["tp_size"], dp["args"]["dp_size"], dp["env"]["CUDA_VISIBLE_DEVICES"]) == (2, 2, "4,5,6,7")
    assert dp["container"] == 101
    assert dp["unit"] == "sglang-dp.service"


def test_dp_attention_shares_the_tensor_parallel_gpus() -> None:
    [instance] = resolve_instances(
        "node1",
        host(
            sglang_server_version="0.5.18",
            sglang_server_gpu_count=4,
            sglang_server_instances=[
                {
                    "name": "moe",
                    "gpus": [0, 1, 2, 3],
                    "port": 30000,
                    "args": {"dp_size": 4, "enable_dp_attention": True},
                }
            ],
        ),
    )
    assert instance["args"]["tp_size"] == 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"sglang_server_instances": [{"name": "a", "gpus": [0], "port": 1}, {"name": "b", "gpus": [0], "port": 2}]},
            "host node1: GPU 0 is used by instances a and b",
        ),
        (
            {"sglang_server_instances": [{"name": "a", "gpus": [0], "port": 9}, {"name": "b", "gpus": [1], "port": 9}]},
            "host node1: port 9 is used by instances a and b",
        ),
        (
            {"sglang_server_instances": [{"name": "a", "gpus": [2], "port": 9}]},
            "host node1, instance a: sglang_server_instances[0].gpus names GPU 2, but sglang_server_gpu_count is 2 "
            "(GPUs 0-1)",
        ),
        (
            {"sglang_server_instances": [{"name": "a", "gpus": [], "port": 9}]},
            "sglang_server_instances[0].gpus is empty; every instance needs at least one GPU",
        ),
        (
            {"sglang_server_instances": [{"name": "a", "gpus": [0], "port": 1}, {"name": "a", "gpus": [1], "port": 2}]},
            "instance name a is used more than once",
        ),
        (
            {"sglang_server_instances": [{"name": "A_1", "gpus": [0], "port": 1}]},
            "sglang_server_instances[0].name expects a name of lowercase letters",
        ),
        (
            {"sglang_server_instances": [{"name": "a", "gpus": [0, 0], "port": 1}]},
            "sglang_server_instances[0].gpus lists GPU 0 twice",
        ),
        (
            {"sglang_server_instances": [{"name": "a", "gpus": [0], "port": 70000}]},
            "sglang_server_instances[0].port expects a TCP port number (1-65535), got the integer 70000",
        ),
        (
            {"sglang_server_instances": [{"name": "a", "gpus": [0], "port": 1, "gpu": [1]}]},
            "sglang_server_instances[0].gpu is not an instance key; did you mean gpus?",
        ),
        (
            {"sglang_server_instances": [{"name": "a", "gpus": [0, 1], "port": 1, "args": {"tp_size": 1}}]},
            "host node1, instance a: sglang_server_instances[0].args.tp_size: tp_size 1 needs 1 GPUs but the instance "
            "has 2 GPUs (sglang_server_instances[0].gpus: [0, 1]); tp_size follows the GPU list",
        ),
        (
            {"sglang_server_args": {"tp_size": 2}},
            "host node1: sglang_server_args.tp_size: tp_size 2 needs 2 GPUs but the instance has 1 GPU (GPU 0 in the "
            "default layout); "
            "the default layout runs one single-GPU instance per GPU",
        ),
        (
            {
                "sglang_server_instances": [
                    {"name": "a", "gpus": [0, 1], "port": 1, "args": {"dp_size": 2, "tp_size": 2}}
                ]
            },
            "tp_size 2 x dp_size 2 needs 4 GPUs but the instance has 2 GPUs",
        ),
        (
            {"sglang_server_instances": [{"name": "a", "gpus": [0, 1], "port": 1, "args": {"dp_size": 3}}]},
            "cannot be split into dp_size 3 x pp_size 1",
        ),
        (
            {"sglang_server_instances": [{"name": "a", "gpus": [0], "port": 1, "container": "200"}]},
            "sglang_server_instances[0].container expects a Proxmox container id (a positive integer) or null, got the "
            "string '200'",
        ),
        ({"sglang_server_lxc_container": "ct200"}, "sglang_server_lxc_container expects a Proxmox container id"),
        ({"sglang_server_instances": {"name": "a"}}, "sglang_server_instances expects a list of instances"),
        ({"sglang_server_gpu_count": 0}, "sglang_server_gpu_count is required"),
        ({"sglang_server_model_path": ""}, "sglang_server_model_path is required"),
        ({"sglang_server_python": "python3"}, "sglang_server_python expects an absolute path"),
        ({"sglang_server_base_port": "30000"}, "sglang_server_base_port expects a TCP port number"),
    ],
)
def test_layout_contradictions(overrides: dict[str, Any], message: str) -> None:
    problems = failure(host(**overrides))
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize(
    ("key", "variable"),
    [
        ("model_path", "sglang_server_model_path"),
        ("model", "sglang_server_model_path"),
        ("port", "sglang_server_base_port"),
        ("host", "sglang_server_listen_host"),
        ("base_gpu_id", "the instance's gpus"),
        ("api_key", "sglang_server_api_key"),
        ("admin_api_key", "sglang_server_api_key"),
        ("served_model_name", "sglang_server_served_model_name"),
    ],
)
def test_layout_owned_keys_name_the_variable_to_use(key: str, variable: str) -> None:
    problems = failure(
        host(sglang_server_instances=[{"name": "a", "gpus": [0], "port": 1, "args": {key: "x"}}]),
    )
    assert problems[0].startswith(f"host node1, instance a: sglang_server_instances[0].args.{key}: ")
    assert "is set by the instance layout; use " + variable in problems[0]


def test_tp_size_equal_to_the_gpu_count_is_allowed() -> None:
    instances = resolve_instances("node1", host(sglang_server_args={"tp_size": 1}))
    assert [i["args"]["tp_size"] for i in instances] == [1, 1]


def test_problems_name_host_instance_and_variable_path() -> None:
    problems = failure(
        host(
            sglang_server_gpu_count=3,
            sglang_server_args={"max_runing_requests": 8},
            sglang_server_instances=[
                {"name": "a", "gpus": [0], "port": 1},
                {"name": "b", "gpus": [1], "port": 2},
                {"name": "c", "gpus": [2], "port": 3, "args": {"max_mamba_cache_sze": 100}},
            ],
        )
    )
    assert problems == [
        "host node1: sglang_server_args.max_runing_requests: SGLang 0.5.23 has no setting 'max_runing_requests'; "
        "did you mean max_running_requests?",
        "host node1, instance c: sglang_server_instances[2].args.max_mamba_cache_sze: SGLang 0.5.23 has no setting "
        "'max_mamba_cache_sze'; did you mean max_mamba_cache_size?",
    ]


def test_layers_merge_key_by_key_and_null_removes() -> None:
    instances = resolve_instances(
        "node1",
        host(
            sglang_server_args={"max_running_requests": 8, "enable_metrics": True, "mem_fraction_static": 0.8},
            sglang_server_host_args={"max_running_requests": 16, "enable_metrics": None},
            sglang_server_instances=[
                {"name": "a", "gpus": [0], "port": 1, "args": {"mem_fraction_static": None}},
                {"name": "b", "gpus": [1], "port": 2, "args": {"max_running_requests": 32}},
            ],
        ),
    )
    a, b = (i["args"] for i in instances)
    assert (a.get("max_running_requests"), "enable_metrics" in a, "mem_fraction_static" in a) == (16, False, False)
    assert (b["max_running_requests"], b["mem_fraction_static"]) == (32, 0.8)


def test_layers_merge_renamed_settings_as_one() -> None:
    [instance, _other] = resolve_instances(
        "node1",
        host(
            sglang_server_args={"mamba_scheduler_strategy": "no_buffer"},
            sglang_server_host_args={"mamba_radix_cache_strategy": "extra_buffer"},
        ),
    )
    assert instance["args"]["mamba_radix_cache_strategy"] == "extra_buffer"
    removed = resolve_instances(
        "node1",
        host(
            sglang_server_args={"mamba_scheduler_strategy": "no_buffer"},
            sglang_server_host_args={"mamba_radix_cache_strategy": None},
        ),
    )
    assert "mamba_radix_cache_strategy" not in removed[0]["args"]


def test_an_instance_overrides_a_group_value_map() -> None:
    [instance, other] = resolve_instances(
        "node1",
        host(
            sglang_server_args={"disable_cuda_graph": True},
            sglang_server_instances=[
                {"name": "a", "gpus": [0], "port": 1, "args": {"cuda_graph_backend_prefill": "full"}},
                {"name": "b", "gpus": [1], "port": 2},
            ],
        ),
    )
    assert instance["args"]["cuda_graph_backend_prefill"] == "full"
    assert instance["args"]["cuda_graph_backend_decode"] == "disabled"
    assert other["args"]["cuda_graph_backend_prefill"] == "disabled"
    assert any("disable_cuda_graph" in w for w in other["warnings"])


def test_same_setting_twice_in_one_layer() -> None:
    problems = failure(host(sglang_server_args={"cuda_graph_max_bs": 8, "cuda_graph_max_bs_decode": 16}))
    assert any("same setting as" in p and "cuda_graph_max_bs_decode" in p for p in problems), problems


def test_environment_layers() -> None:
    instances = resolve_instances(
        "node1",
        host(
            sglang_server_env={"HF_HUB_OFFLINE": True, "A": 1, "DROP": "x"},
            sglang_server_host_env={"A": 2.5, "DROP": None},
            sglang_server_instances=[{"name": "a", "gpus": [1, 0], "port": 1, "env": {"NCCL_DEBUG": "WARN"}}],
        ),
    )
    assert instances[0]["env"] == {
        "A": "2.5",
        "CUDA_VISIBLE_DEVICES": "1,0",
        "HF_HUB_OFFLINE": "1",
        "NCCL_DEBUG": "WARN",
    }


def test_environment_problems() -> None:
    problems = failure(host(sglang_server_env={"CUDA_VISIBLE_DEVICES": "3", "BAD-NAME": "x", "LIST": [1]}))
    text = "\n".join(problems)
    assert "CUDA_VISIBLE_DEVICES is set from the instance's gpus" in text
    assert "'BAD-NAME' is not a valid environment variable name" in text
    assert "environment values must be strings, numbers or booleans, got a list" in text


def test_unchecked_args_are_rendered_verbatim_with_a_warning() -> None:
    [instance, other] = resolve_instances(
        "node1",
        host(
            sglang_server_args_unchecked={"enable_future_thing": True, "future_size": 3, "off_switch": False},
            sglang_server_instances=[
                {"name": "a", "gpus": [0], "port": 1, "args_unchecked": {"future_size": None, "blob": {"k": 1}}},
                {"name": "b", "gpus": [1], "port": 2},
            ],
        ),
    )
    assert instance["args_unchecked"] == {"blob": {"k": 1}, "enable_future_thing": True, "off_switch": False}
    assert instance["argv"][-3:] == ["--blob", '{"k":1}', "--enable-future-thing"]
    assert other["argv"][-3:] == ["--enable-future-thing", "--future-size", "3"]
    assert (
        "host node1, instance a: sglang_server_instances[0].args_unchecked.blob is passed unchecked as "
        '--blob {"k":1}' in instance["warnings"]
    )
    assert (
        "host node1, instance b: sglang_server_args_unchecked.future_size is passed unchecked as --future-size 3"
        in (other["warnings"])
    )
    assert any("off_switch is passed unchecked as nothing (false)" in w for w in other["warnings"])


def test_unchecked_args_that_the_table_knows_suggest_moving_them() -> None:
    [instance, _unused] = resolve_instances("node1", host(sglang_server_args_unchecked={"enable_metrics": True}))
    assert instance["warnings"] == [
        "host node1, instance gpu0: sglang_server_args_unchecked.enable_metrics is passed unchecked as "
        "--enable-metrics; SGLang 0.5.23 knows this flag as enable_metrics, move it to args to have it checked"
    ]


def test_unchecked_args_cannot_duplicate_or_own_layout_keys() -> None:
    problems = failure(
        host(
            sglang_server_args={"enable_metrics": True},
            sglang_server_args_unchecked={"enable_metrics": True, "port": 1, "Bad": 1},
        )
    )
    text = "\n".join(problems)
    assert "sglang_server_args_unchecked.enable_metrics: enable_metrics is also set in args" in text
    assert "sglang_server_args_unchecked.port: port is set by the instance layout" in text
    assert "'Bad' is not a snake_case flag name" in text


def test_unchecked_words() -> None:
    assert unchecked_cli_words({"b": [1, "x"], "a": -2.5, "c": "-x"}) == ["--a", "-2.5", "--b", "1", "x", "--c=-x"]


def test_version_is_required_and_must_be_supported() -> None:
    assert any("sglang_server_version is required" in p for p in failure(host(sglang_server_version=None)))
    problems = failure(host(sglang_server_version=None, sglang_server_flag_table_version="0.5.18"))
    assert any("sglang_server_version is required" in p for p in problems)
    problems = failure(host(sglang_server_version="0.5.11"))
    assert problems == [
        "host node1: sglang_server_version '0.5.11' is not supported; supported: 0.5.9, 0.5.14, 0.5.18, 0.5.19, "
        "0.5.20, 0.5.21, 0.5.22, 0.5.23. "
        "For a release in between, set sglang_server_flag_table_version to the nearest supported version and its "
        "flag table is used"
    ]
    assert any("not a known flag table" in p for p in failure(host(sglang_server_flag_table_version="0.6.0")))


def test_flag_table_escape_hatch_warns() -> None:
    instances = resolve_instances(
        "node1",
        host(
            sglang_server_version="0.5.16",
            sglang_server_flag_table_version="0.5.14",
            sglang_server_args={"cuda_graph_max_bs": 8},
        ),
    )
    first = instances[0]
    assert (first["version"], first["flag_table"]) == ("0.5.16", "0.5.14")
    assert "--cuda-graph-max-bs-decode" in first["argv"]
    assert first["warnings"][0].startswith("host node1: SGLang 0.5.16 is checked against the flag table of 0.5.14")


@pytest.mark.parametrize("version", ["0.5.19", "0.5.20", "0.5.21", "0.5.22"])
def test_0_5_19_to_0_5_22_need_no_flag_table_override(version: str) -> None:
    instances = resolve_instances(
        "node1", host(sglang_server_version=version, sglang_server_args={"max_running_requests": 8})
    )
    assert [(i["version"], i["flag_table"], i["warnings"]) for i in instances] == [(version, version, [])] * 2


@pytest.mark.parametrize(
    "version", ["0.5.10", "0.5.11", "0.5.12", "0.5.13", "0.5.15", "0.5.16", "0.5.17", "0.5.24", "0.6.0"]
)
def test_releases_without_a_dump_are_refused_unless_a_table_is_named(version: str) -> None:
    problems = failure(host(sglang_server_version=version))
    supported = ", ".join(load_table().versions)
    assert problems == [
        f"host node1: sglang_server_version '{version}' is not supported; supported: {supported}. "
        "For a release in between, set sglang_server_flag_table_version to the nearest supported version and its "
        "flag table is used"
    ]
    instances = resolve_instances(
        "node1", host(sglang_server_version=version, sglang_server_flag_table_version="0.5.22")
    )
    assert instances[0]["flag_table"] == "0.5.22"
    assert instances[0]["warnings"][0].startswith(
        f"host node1: SGLang {version} is checked against the flag table of 0.5.22"
    )


def test_tc_piecewise_refusal_quotes_the_converter_and_lists_the_choices() -> None:
    problems = failure(
        host(sglang_server_version="0.5.22", sglang_server_host_args={"cuda_graph_backend_prefill": "tc_piecewise"})
    )
    assert problems == [
        "host node1: sglang_server_host_args.cuda_graph_backend_prefill: 'tc_piecewise' is refused by "
        "--cuda-graph-backend-prefill on SGLang 0.5.22, whose parser answers 'tc_piecewise was removed; select "
        "breakable, full, or disabled'; choose one of: full, breakable, disabled ('tc_piecewise' is accepted by "
        "SGLang 0.5.14, 0.5.18, 0.5.19, 0.5.20, 0.5.21)"
    ]


def test_fingerprint_changes_with_argv_env_and_version_only() -> None:
    base = host(sglang_server_args={"max_running_requests": 8})
    one = resolve_instances("node1", base)[0]["fingerprint"]
    assert resolve_instances("node1", copy.deepcopy(base))[0]["fingerprint"] == one
    assert resolve_instances("other-name", base)[0]["fingerprint"] == one
    assert (
        resolve_instances("node1", {**base, "sglang_server_args": {"max_running_requests": 9}})[0]["fingerprint"] != one
    )
    assert resolve_instances("node1", {**base, "sglang_server_env": {"X": 1}})[0]["fingerprint"] != one
    assert (
        resolve_instances("node1", {**base, "sglang_server_version": "0.5.18"})[0]["fingerprint"] != one
    )  # same argv, other version


def test_resolve_does_not_mutate_its_input() -> None:
    hostvars = host(
        sglang_server_args={"context_length": "32Ki"}, sglang_server_instances=[{"name": "a", "gpus": [0], "port": 1}]
    )
    snapshot = copy.deepcopy(hostvars)
    resolve_instances("node1", hostvars)
    assert hostvars == snapshot


# --------------------------------------------------------------------------------------------------
# One ResolvedInstance, whoever asks for it


def test_a_resolved_instance_is_frozen_and_its_dict_a_copy() -> None:
    [instance, _unused] = resolve_host("node1", host(sglang_server_args={"cuda_graph_bs": [1, 2]}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        instance.port = 1  # type: ignore[misc]
    as_dict = instance.to_dict()
    assert (as_dict["gpus"], as_dict["argv"][:2]) == ([0], ["/opt/sglang/venv/bin/python", "-m"])
    as_dict["argv"].append("--extra")
    as_dict["args"]["cuda_graph_bs_decode"].append(4)
    as_dict["env"]["X"] = "1"
    as_dict["expected_server_info"]["port"] = 1
    assert instance.to_dict() == resolve_instances("node1", host(sglang_server_args={"cuda_graph_bs": [1, 2]}))[0]


def test_the_action_documents_every_field_in_order() -> None:
    documented = yaml.safe_load(server_validate_doc.RETURN)["instances"]["contains"]
    assert list(documented) == [field.name for field in dataclasses.fields(ResolvedInstance)]


def test_secrets_start_the_server_through_the_launcher_and_never_enter_the_instance() -> None:
    instances = resolve_instances(
        "node1",
        host(
            sglang_server_api_key="key-Zx81qP",
            sglang_server_secret_env={"HF_TOKEN": "tok-Q7wLm"},
            sglang_server_user="svc",
        ),
    )
    first = instances[0]
    assert first["argv"][:3] == ["/opt/sglang/venv/bin/python", LAUNCHER, "--base-gpu-id"]
    assert first["env"] == {
        "CUDA_VISIBLE_DEVICES": "0",
        "SGLANG_FLEET_API_KEY_REQUIRED": "1",
        "SGLANG_FLEET_SECRET_VARS": "HF_TOKEN,SGLANG_API_KEY",
    }
    assert first["fingerprint"] == fingerprint("0.5.23", first["argv"], first["env"])
    assert first["user"] == "svc"
    text = json.dumps(instances)
    assert "key-Zx81qP" not in text
    assert "tok-Q7wLm" not in text


def test_the_filter_returns_what_the_action_returns() -> None:
    """Both return resolve_instances: with secrets too, where the filter used to show a launch
    command that no unit runs."""
    hostvars = host(
        sglang_server_api_key="key-Zx81qP",
        sglang_server_served_model_name="qwen",
        sglang_server_args={"max_running_requests": 8},
    )
    task = MagicMock(args={}, check_mode=False, async_val=0, action="sglang_ops.fleet.server_validate")
    connection = MagicMock()
    connection._shell.tmpdir = None
    loader = DataLoader()
    action = ActionModule(task, connection, PlayContext(), loader, Templar(loader=loader), None)
    result = action.run(task_vars={"inventory_hostname": "node1", **hostvars})
    assert not result.get("failed"), result
    assert server_instances(hostvars, "node1") == result["instances"] == resolve_instances("node1", hostvars)
    assert result["instances"][0]["argv"][1] == LAUNCHER
