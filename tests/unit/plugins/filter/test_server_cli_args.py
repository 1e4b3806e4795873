"""The server_cli_args and server_instances filters, called directly and through ansible."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from unittest.mock import patch

import pytest
from ansible.errors import AnsibleFilterError
from cli_tools import cli

from ansible_collections.sglang_ops.fleet.plugins.filter import server_cli_args as cli_filter
from ansible_collections.sglang_ops.fleet.plugins.filter import server_instances as instances_filter
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._flags.table import load_table

REPO_ROOT = Path(__file__).resolve().parents[4]


def test_filter_is_registered_under_its_name() -> None:
    assert cli_filter.FilterModule().filters() == {"server_cli_args": cli_filter.server_cli_args}
    assert instances_filter.FilterModule().filters() == {"server_instances": instances_filter.server_instances}


def test_server_cli_args_renders_for_the_version() -> None:
    args = {"mamba_scheduler_strategy": "no_buffer", "max_running_requests": 128, "trust_remote_code": True}
    assert cli_filter.server_cli_args(args, "0.5.9") == [
        "--mamba-scheduler-strategy",
        "no_buffer",
        "--max-running-requests",
        "128",
        "--trust-remote-code",
    ]
    assert cli_filter.server_cli_args(args, "0.5.23")[:2] == ["--mamba-radix-cache-strategy", "no_buffer"]


def test_server_cli_args_warns_about_replaced_flags() -> None:
    with patch.object(cli_filter.display, "warning") as warning:
        words = cli_filter.server_cli_args({"disable_piecewise_cuda_graph": True}, "0.5.14")
    assert words == ["--cuda-graph-backend-prefill", "disabled"]
    warning.assert_called_once()
    assert "disable_piecewise_cuda_graph" in warning.call_args.args[0]


def test_server_cli_args_raises_a_filter_error_with_every_problem() -> None:
    with pytest.raises(AnsibleFilterError) as exc:
        cli_filter.server_cli_args({"max_mamba_cache_sze": 1, "trust_remote_code": "true"}, "0.5.23")
    text = str(exc.value)
    assert "2 problems" in text
    assert "server_cli_args.max_mamba_cache_sze: SGLang 0.5.23 has no setting" in text
    assert "did you mean max_mamba_cache_size?" in text
    assert "server_cli_args.trust_remote_code:" in text


def test_server_cli_args_rejects_an_unknown_version() -> None:
    supported = ", ".join(load_table().versions)
    assert supported == "0.5.9, 0.5.14, 0.5.18, 0.5.19, 0.5.20, 0.5.21, 0.5.22, 0.5.23"
    with pytest.raises(AnsibleFilterError, match=re.escape(f"supported: {supported}")):
        cli_filter.server_cli_args({}, "0.6.0")


def test_server_instances_reads_only_the_collection_variables() -> None:
    class Strict(dict):  # a hostvars view that fails on templating anything unrelated
        def __getitem__(self, key: str) -> object:
            if not key.startswith("sglang_server_"):
                raise AssertionError(f"read {key}")
            return super().__getitem__(key)

    hostvars = Strict(
        sglang_server_version="0.5.23",
        sglang_server_model_path="m",
        sglang_server_gpu_count=1,
        unrelated="{{ undefined_variable }}",
    )
    [instance] = instances_filter.server_instances(hostvars, "node1")
    assert instance["argv"][-2:] == ["--tp-size", "1"]


def test_server_instances_raises_a_filter_error() -> None:
    with pytest.raises(AnsibleFilterError, match="sglang_server_gpu_count is required"):
        instances_filter.server_instances({"sglang_server_version": "0.5.23", "sglang_server_model_path": "m"}, "n")
    with pytest.raises(AnsibleFilterError, match="expects the variables of one host"):
        instances_filter.server_instances(["x"], "n")  # type: ignore[arg-type]


def test_filter_through_ansible_by_its_fqcn(tmp_path: Path) -> None:
    """The FQCN resolves from the repository's collections/ symlink and renders in a real template."""
    env = {
        **os.environ,
        "ANSIBLE_COLLECTIONS_PATH": str(REPO_ROOT / "collections"),
        "ANSIBLE_CONFIG": str(tmp_path / "none.cfg"),
        "ANSIBLE_LOCAL_TEMP": str(tmp_path),
        "ANSIBLE_HOME": str(tmp_path),
        "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
        "ANSIBLE_NOCOLOR": "1",
    }
    expression = "{{ {'cuda_graph_max_bs': 8, 'enable_metrics': true} | sglang_ops.fleet.server_cli_args('0.5.23') }}"
    ansible = cli("ansible")
    completed = subprocess.run(
        [
            str(ansible),
            "localhost",
            "-i",
            "localhost,",
            "-c",
            "local",
            "-m",
            "ansible.builtin.debug",
            "-a",
            f"msg={expression}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    head, _unused, payload = completed.stdout.partition("=>")
    assert "localhost | SUCCESS" in head, completed.stdout
    assert json.loads(payload)["msg"] == ["--cuda-graph-max-bs-decode", "8", "--enable-metrics"]
