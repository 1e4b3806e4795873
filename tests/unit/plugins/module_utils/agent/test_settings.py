"""The one settings comparison: how a running instance differs from its desired settings."""

from __future__ import annotations

from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.evidence import Redactor
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.settings import (
    describe_server_info,
    differences,
    process_evidence,
)

ARGV = ["/opt/sglang/venv/bin/python", "-m", "sglang.launch_server", "--max-running-requests", "64"]
DESIRED = {
    "argv": [*ARGV, "--api-key", "${SGLANG_API_KEY}"],
    "env": {"CUDA_VISIBLE_DEVICES": "0"},
    "user": "sglang",
    "expected_server_info": {"max_running_requests": 64},
}


def running(argv: list[str], environ: dict[str, str], **more: object) -> dict:
    evidence = process_evidence(DESIRED, argv, environ, Redactor(["sk-secret"]).argv)
    return {**evidence, **more}


def test_an_instance_serving_its_desired_settings_has_no_differences() -> None:
    live = running([*ARGV, "--api-key", "sk-secret"], {"CUDA_VISIBLE_DEVICES": "0", "HOME": "/"})
    assert live["argv"][-1] == "********"  # the secret never leaves the host
    found = differences(DESIRED, {**live, "user": "sglang", "server_info": {"max_running_requests": 64.0}})
    assert found == {"flag_diff": None, "env": {}, "user": None, "server_info": []}


def test_every_kind_of_difference_is_returned_as_data() -> None:
    argv = [*ARGV[:-1], "16", "--api-key", "sk-secret"]
    live = running(argv, {"CUDA_VISIBLE_DEVICES": "1"}, user="root", server_info={"max_running_requests": 16})
    found = differences(DESIRED, live)
    # The diff is of the masked command line: a secret's word differs from its ${VAR} too.
    assert found["flag_diff"]["changed"] == {
        "--api-key": ["********", "${SGLANG_API_KEY}"],
        "--max-running-requests": ["16", "64"],
    }
    assert found["env"] == {"CUDA_VISIBLE_DEVICES": {"expected": "0", "running": "1"}}
    assert found["user"] == {"expected": "sglang", "running": "root"}
    assert found["server_info"] == [{"arg": "max_running_requests", "expected": 64, "reported": 16}]
    assert describe_server_info(found["server_info"], "desired") == (
        "/server_info reports other settings: max_running_requests=16 (desired 64)"
    )


def test_evidence_that_was_not_read_is_not_compared() -> None:
    live = running([*ARGV, "--api-key", "x"], {"CUDA_VISIBLE_DEVICES": "0"})
    found = differences(DESIRED, {**live, "user": None, "server_info": None})
    assert (found["user"], found["server_info"]) == (None, [])


def test_the_hosts_verdict_on_the_command_line_stands_on_the_controller() -> None:
    """The controller sees the masked command line only: whether the unmasked one matched is
    the host's verdict, carried in the evidence."""
    masked = {"argv": [*ARGV, "--api-key", "********"], "argv_matches": True, "env_mismatches": {}}
    assert differences(DESIRED, masked)["flag_diff"] is None
    assert differences(DESIRED, {**masked, "argv_matches": False})["flag_diff"] is not None
