"""The CLI from a fleet repository: the collection it drives found where ansible looks and of its
own version, and ansible-playbook's own error shown (exit 1) when it ends before any task. Real
ansible-galaxy and ansible-playbook runs, on a collection tree made here."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from sglang_fleet_ops import cli, collection
from sglang_fleet_ops.runner import run_playbook

VERSION = collection.own_version()
PLAY = """
- name: A play
  hosts: all
  gather_facts: false
  tasks:
    - name: Nothing
      ansible.builtin.debug:
        msg: hello
"""


def installed(root: Path, version: str = VERSION, playbooks: dict[str, str] | None = None) -> Path:
    """A collection sglang_ops.fleet installed under ``root`` (as ansible-galaxy lays it out)."""
    path = root / "ansible_collections" / "sglang_ops" / "fleet"
    (path / "playbooks").mkdir(parents=True)
    info = {"namespace": "sglang_ops", "name": "fleet", "version": version}
    (path / "MANIFEST.json").write_text(json.dumps({"collection_info": info, "format": 1}))
    (path / "FILES.json").write_text(json.dumps({"files": [], "format": 1}))
    for name, text in (playbooks or {}).items():
        (path / "playbooks" / f"{name}.yml").write_text(text)
    return path


@pytest.fixture
def fleet_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fleet repository (no ansible.cfg, no retune.yml), the working directory, with an inventory."""
    repo = tmp_path / "fleet"
    (repo / "inventory").mkdir(parents=True)
    host = f"local1:\n      ansible_connection: local\n      ansible_python_interpreter: {sys.executable}\n"
    (repo / "inventory" / "hosts.yml").write_text(f"all:\n  hosts:\n    {host}")
    monkeypatch.delenv("ANSIBLE_CONFIG", raising=False)
    monkeypatch.setenv("ANSIBLE_COLLECTIONS_PATH", str(tmp_path / "collections"))
    monkeypatch.chdir(repo)
    return repo


def run(argv: list[str], check: bool = True) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    # The real check (conftest.py stands it in for the tests that replay recorded runs).
    checker = collection.collection_problem if check else (lambda project: None)
    code = cli.main(argv, runner=run_playbook, out=out, err=err, check_collection=checker)
    return code, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------------------------------------
# The collection check


def test_the_installed_collection_of_the_same_version_passes(fleet_repo: Path, tmp_path: Path) -> None:
    path = installed(tmp_path / "collections")
    assert collection.installed_version(fleet_repo) == (VERSION, str(path))
    assert collection.collection_problem(fleet_repo) is None


def test_no_collection_installed_says_how_to_install_it(fleet_repo: Path) -> None:
    code, out, err = run(["plan", "-i", "inventory"])
    assert code == 1 and out == ""
    assert err.startswith(
        "error: the collection sglang_ops.fleet is not installed where ansible looks "
        "(ansible-galaxy collection list finds no sglang_ops.fleet); install the collection"
    )
    assert "ansible-galaxy collection install sglang_ops-fleet-*.tar.gz" in err
    # Nothing was run, nothing written.
    assert not (fleet_repo / ".sglang-fleet-ops").exists()


def test_another_version_of_the_collection_is_refused(fleet_repo: Path, tmp_path: Path) -> None:
    path = installed(tmp_path / "collections", version="0.0.9")
    code, _, err = run(["plan", "-i", "inventory"])
    assert code == 1
    assert f"error: the collection sglang_ops.fleet at {path} is 0.0.9, but sglang-fleet-ops is {VERSION}" in err


def test_a_project_dir_inside_the_installed_collection_is_refused(fleet_repo: Path, tmp_path: Path) -> None:
    path = installed(tmp_path / "collections")
    code, _, err = run(["plan", "--project-dir", str(path)])
    assert code == 1 and "is inside an installed collection" in err
    assert not (path / ".sglang-fleet-ops").exists()


def test_the_version_is_the_collections() -> None:
    galaxy = (Path(__file__).resolve().parents[2] / "galaxy.yml").read_text()
    assert f"\nversion: {VERSION}\n" in galaxy
    out = io.StringIO()
    with pytest.raises(SystemExit) as done, pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stdout", out)
        cli.main(["--version"])
    assert done.value.code == 0
    assert out.getvalue() == f"sglang-fleet-ops {VERSION} (drives the collection sglang_ops.fleet)\n"


# ---------------------------------------------------------------------------------------------
# ansible-playbook ending before any task: its own line, exit 1


def test_a_playbook_run_by_fqcn_from_the_fleet_repository(fleet_repo: Path, tmp_path: Path) -> None:
    installed(tmp_path / "collections", playbooks={"status": PLAY})
    code, out, err = run(["status", "-i", "inventory"])
    # The play gives no status result: exit 1, but ansible ran it from the installed collection.
    (run_dir,) = (fleet_repo / ".sglang-fleet-ops" / "runs").iterdir()
    assert out.splitlines()[-1] == f"artifacts: {run_dir}"
    command = json.loads((run_dir / "artifacts" / "status" / "command").read_text())
    assert command["command"][-1] == "sglang_ops.fleet.status" and command["cwd"] == str(fleet_repo)
    assert "ended before any task" not in err and code == 1


def test_a_playbook_not_found(fleet_repo: Path, tmp_path: Path) -> None:
    installed(tmp_path / "collections", playbooks={"retune": PLAY})
    code, _, err = run(["status", "-i", "inventory"])
    assert code == 1
    assert "error: [ERROR]: the playbook: sglang_ops.fleet.status could not be found\n" in err
    (run_dir,) = (fleet_repo / ".sglang-fleet-ops" / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["problems"] == ["[ERROR]: the playbook: sglang_ops.fleet.status could not be found"]


def test_a_syntax_error(fleet_repo: Path, tmp_path: Path) -> None:
    installed(tmp_path / "collections", playbooks={"retune": "- name: broken\n  hosts: [all\n"})
    code, _, err = run(["plan", "-i", "inventory"])
    assert code == 1
    assert "error: [ERROR]: YAML parsing failed" in err, err


def test_an_inventory_that_does_not_parse(fleet_repo: Path, tmp_path: Path) -> None:
    installed(tmp_path / "collections", playbooks={"retune": PLAY})
    (fleet_repo / "bad.yml").write_text("all:\n  hosts: [\n")
    code, _, err = run(["drift", "-i", "bad.yml"])
    assert code == 1
    assert f"error: [ERROR]: Completely failed to parse inventory source {fleet_repo / 'bad.yml'}\n" in err


def test_a_missing_collection(fleet_repo: Path) -> None:
    """Without the collection check (it catches this first), ansible's own line still shows."""
    code, _, err = run(["plan", "-i", "inventory"], check=False)
    assert code == 1
    assert "error: [ERROR]: the playbook: sglang_ops.fleet.retune could not be found\n" in err
    assert "no failed task was recorded" not in err and "reached no host" not in err
