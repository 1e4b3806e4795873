"""The runner plumbing for real: ansible_runner.run on a tiny local playbook, in a private data
dir under the project's .sglang-fleet-ops/runs/, results from the job events."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from sglang_fleet_ops.events import by_host
from sglang_fleet_ops.runner import Request, new_run_dir, run_playbook

HIDDEN_VALUE = "s3cr3t-value-not-for-artifacts"

PLAYBOOK = """
- name: A tiny play
  hosts: all
  gather_facts: false
  tasks:
    - name: Say hello
      ansible.builtin.command: echo hello
      changed_when: false
    - name: Use a secret
      ansible.builtin.debug:
        msg: "{{ secret }}"
      no_log: true
    - name: Fail, ignored
      ansible.builtin.fail:
        msg: ignored failure
      ignore_errors: true
"""


def test_ansible_runner_runs_a_playbook_into_the_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "play.yml").write_text(PLAYBOOK)
    # The secret comes from the inventory (as Vault would give it), never from extra vars.
    (project / "inventory").write_text(
        f"local1 ansible_connection=local ansible_python_interpreter={sys.executable} secret={HIDDEN_VALUE}\n"
    )
    (project / "ansible.cfg").write_text("[defaults]\nretry_files_enabled = False\n")
    os.environ["SGLANG_OPS_TEST_CREDENTIAL"] = HIDDEN_VALUE  # the caller's environment holds a credential
    try:
        run_dir = new_run_dir(project, "test")
        request = Request("play.yml", "t1", extravars={"x": 1}, progress=True)
        run = run_playbook(run_dir, project, str(project / "inventory"), None, request)
    finally:
        del os.environ["SGLANG_OPS_TEST_CREDENTIAL"]
    assert run_dir.parent == project / ".sglang-fleet-ops" / "runs" and run_dir.name.endswith("Z-test")
    assert (run.rc, run.status) == (0, "successful")
    assert run.artifact_dir == run_dir / "artifacts" / "t1"
    for name in ("job_events", "stdout", "status", "rc", "command"):
        assert (run.artifact_dir / name).exists(), name
    assert (run.artifact_dir / "rc").read_text().strip() == "0"
    command = json.loads((run.artifact_dir / "command").read_text())
    assert command["command"][-1] == "play.yml" and command["cwd"] == str(project)
    assert command["env"]["ANSIBLE_CONFIG"] == str(project / "ansible.cfg")
    view = by_host(run.events)["local1"]
    hello = view.last("ansible.builtin.command")
    assert hello is not None and hello.ok and hello.res["stdout"] == "hello" and hello.task == "Say hello"
    (ignored,) = [r for r in view.results if r.failed]
    assert ignored.ignore_errors and view.failures() == []
    # A no_log result is censored in the events, and no file of the run holds the secret.
    assert "censored" in view.last("ansible.builtin.debug").res  # type: ignore[union-attr]
    leaks = [p for p in run_dir.rglob("*") if p.is_file() and HIDDEN_VALUE in p.read_text(errors="replace")]
    assert leaks == []
    progress = capsys.readouterr().err.splitlines()
    assert progress == [
        "[local1] ok: Say hello",
        "[local1] ok: Use a secret",
        "[local1] FAILED (ignored): Fail, ignored",
    ]


CHECK_PLAYBOOK = """
- name: Report check mode
  hosts: all
  gather_facts: false
  tasks:
    - name: Check mode
      ansible.builtin.debug:
        msg: "check={{ ansible_check_mode }} x={{ x | default('unset') }}"
"""


def test_a_check_run_does_not_make_the_next_run_in_the_same_dir_a_check(tmp_path: Path) -> None:
    """apply --plan runs a check, then the apply, in one run dir: the runner must not carry the
    check's --check --diff (or its extra vars) over to the apply."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "play.yml").write_text(CHECK_PLAYBOOK)
    (project / "inventory").write_text(f"local1 ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    run_dir = new_run_dir(project, "test")

    def said(run: object) -> str:
        oks = [e for e in run.events if e.get("event") == "runner_on_ok"]  # type: ignore[attr-defined]
        return str(oks[-1]["event_data"]["res"]["msg"])

    check = run_playbook(
        run_dir, project, str(project / "inventory"), None, Request("play.yml", "check", check=True, extravars={"x": 1})
    )
    real = run_playbook(run_dir, project, str(project / "inventory"), None, Request("play.yml", "apply"))
    assert said(check) == "check=True x=1"
    assert said(real) == "check=False x=unset"
