"""The instance unit as the server role renders it (its defaults and vars, the validated
instances): the start guard before SGLang, the start budget and the start-rate window; and the
supervisord program a pod gets instead, from the same settings."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from cli_tools import cli

from ansible_collections.sglang_ops.fleet.plugins.module_utils import agent
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent import evidence, nvidia, procfs  # noqa: F401  # pylint: disable=unused-import
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.supervisord import Supervisord

REPO_ROOT = Path(__file__).resolve().parents[5]
ROLE = REPO_ROOT / "roles/server"
DEFAULTS = yaml.safe_load((ROLE / "defaults/main.yml").read_text(encoding="utf-8"))

PLAYBOOK = """
- name: Render the instance units of the server role
  hosts: localhost
  gather_facts: false
  vars_files:
    - "{{ role }}/defaults/main.yml"
    - "{{ role }}/vars/main.yml"
  tasks:
    - name: Validate and resolve the instances
      sglang_ops.fleet.server_validate:
      register: sglang_server_resolved
    - name: Render each unit
      ansible.builtin.copy:
        content: "{{ lookup('ansible.builtin.template', role ~ '/templates/sglang-instance.service.j2') }}"
        dest: "{{ out }}/{{ instance.unit }}"
        mode: "0644"
      loop: "{{ sglang_server_resolved.instances }}"
      loop_control:
        loop_var: instance
    - name: Render each supervisord program (a pod)
      ansible.builtin.copy:
        content: "{{ lookup('ansible.builtin.template', role ~ '/templates/sglang-instance.program.conf.j2') }}"
        dest: "{{ out }}/{{ instance.unit | sglang_ops.fleet.supervisord_program }}.conf"
        mode: "0644"
      loop: "{{ sglang_server_resolved.instances }}"
      loop_control:
        loop_var: instance
"""

HOST = {
    "sglang_server_version": "0.5.23",
    "sglang_server_model_path": "Qwen/Qwen3.6-27B",
    "sglang_server_gpu_count": 4,
    "sglang_server_api_key": "test-key-Zx81qP",
    "sglang_server_instances": [
        {"name": "gpu0", "gpus": [0], "port": 30000},
        {"name": "tp", "gpus": [2, 3], "port": 30010},
    ],
}


def render(tmp_path: Path, **overrides: object) -> dict[str, str]:
    """Each rendered unit's text, by instance name."""
    out = tmp_path / "units"
    out.mkdir(parents=True)
    (tmp_path / "render.yml").write_text(PLAYBOOK, encoding="utf-8")
    extra = {**HOST, **overrides, "role": str(ROLE), "out": str(out), "ansible_python_interpreter": sys.executable}
    env = {
        **os.environ,
        "ANSIBLE_COLLECTIONS_PATH": str(REPO_ROOT / "collections"),
        "ANSIBLE_CONFIG": str(tmp_path / "none.cfg"),
        "ANSIBLE_LOCAL_TEMP": str(tmp_path),
        "ANSIBLE_HOME": str(tmp_path),
        "ANSIBLE_NOCOLOR": "1",
    }
    done = subprocess.run(
        [
            cli("ansible-playbook"),
            *("-i", "localhost,", "-c", "local"),
            *("-e", json.dumps(extra)),
            str(tmp_path / "render.yml"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return {
        path.name.removeprefix("sglang-").removesuffix(".service"): path.read_text()
        for path in out.iterdir()
        if path.suffix == ".service"
    } | {
        "program:" + path.name.removeprefix("sglang-").removesuffix(".conf"): path.read_text()
        for path in out.iterdir()
        if path.suffix == ".conf"
    }


def settings(unit: str) -> dict[str, list[str]]:
    """Key=value lines of a unit (continuation lines joined), every value of a repeated key."""
    values: dict[str, list[str]] = {}
    logical = unit.replace("\\\n", " ")
    for line in logical.splitlines():
        if "=" in line and not line.startswith(("#", " ")):
            key, _unused, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return values


@pytest.fixture(scope="module")
def default_units(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return render(tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="module")
def guard() -> ModuleType:
    sys.modules.setdefault("sglang_fleet_agent", agent)
    saved_path, saved_bytecode = list(sys.path), sys.dont_write_bytecode
    loader = importlib.machinery.SourceFileLoader("unit_start_guard", str(ROLE / "files/sglang-fleet-start-guard"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.path[:], sys.dont_write_bytecode = saved_path, saved_bytecode
    return module


def test_the_start_guard_runs_before_sglang_with_the_instance_gpus_and_port(default_units) -> None:
    for name, gpus, port in (("gpu0", "0", 30000), ("tp", "2,3", 30010)):
        unit = default_units[name]
        values = settings(unit)
        assert values["ExecStartPre"] == [
            "+/usr/bin/python3 /usr/local/libexec/sglang-fleet/sglang-fleet-start-guard "
            f"--gpus {gpus} --port {port} "
            f"--threshold-mib {DEFAULTS['sglang_server_release_threshold_mib']} "
            f"--timeout {DEFAULTS['sglang_server_start_guard_timeout']} "
            f"--interval {DEFAULTS['sglang_server_start_poll_interval']} "
            "--secrets-file /etc/sglang-fleet/secrets.env"
        ]
        assert unit.index("ExecStartPre=") < unit.index("ExecStart=") < unit.index("ExecStartPost=")
        assert values["Restart"] == ["on-failure"]


def test_the_defaults_are_the_documented_ones() -> None:
    assert DEFAULTS["sglang_server_release_threshold_mib"] == 1024
    specs = yaml.safe_load((ROLE / "meta/argument_specs.yml").read_text(encoding="utf-8"))
    options = specs["argument_specs"]["main"]["options"]
    for name in ("sglang_server_release_threshold_mib", "sglang_server_start_guard_timeout"):
        assert options[name]["type"] == "int"
        assert options[name]["default"] == DEFAULTS[name]
        assert options[name]["description"]


def test_timeout_start_covers_the_guard_deadline_and_the_model_load(default_units) -> None:
    values = settings(default_units["gpu0"])
    guard_timeout = DEFAULTS["sglang_server_start_guard_timeout"]
    load_timeout = DEFAULTS["sglang_server_start_timeout"]
    assert values["TimeoutStartSec"] == [str(guard_timeout + load_timeout)]
    # The health wait keeps the model load's own deadline.
    assert values["ExecStartPost"][0].endswith(
        f"--timeout {load_timeout} --interval {DEFAULTS['sglang_server_start_poll_interval']}"
    )


def test_start_limit_window_holds_burst_failed_starts(default_units) -> None:
    values = settings(default_units["gpu0"])
    burst = int(values["StartLimitBurst"][0])
    longest_cycle = int(values["TimeoutStartSec"][0]) + int(values["TimeoutStopSec"][0]) + int(values["RestartSec"][0])
    assert burst == DEFAULTS["sglang_server_start_limit_burst"]
    # Burst starts failing in a row always fall in one window: the next one is refused.
    assert int(values["StartLimitIntervalSec"][0]) >= burst * longest_cycle
    # A crash, then a release of several minutes: one restart, whose guard waits it out.
    assert DEFAULTS["sglang_server_start_guard_timeout"] >= 300
    assert burst >= 2


def test_overrides_reach_the_unit(tmp_path: Path) -> None:
    units = render(
        tmp_path,
        sglang_server_release_threshold_mib=2048,
        sglang_server_start_guard_timeout=45,
        sglang_server_start_timeout=120,
        sglang_server_stop_timeout=60,
        sglang_server_restart_sec=10,
        sglang_server_start_limit_burst=4,
        sglang_server_start_poll_interval=0.2,
    )
    values = settings(units["gpu0"])
    assert "--threshold-mib 2048 --timeout 45 --interval 0.2 " in values["ExecStartPre"][0]
    assert values["ExecStartPost"][0].endswith("--timeout 120 --interval 0.2")
    assert values["TimeoutStartSec"] == ["165"]
    assert values["StartLimitBurst"] == ["4"]
    assert values["StartLimitIntervalSec"] == [str(4 * (165 + 60 + 10))]
    explicit = settings(render(tmp_path / "explicit", sglang_server_start_limit_interval=999)["gpu0"])
    assert explicit["StartLimitIntervalSec"] == ["999"]


def test_the_guard_accepts_the_command_line_the_unit_gives_it(default_units, guard, monkeypatch, capsys) -> None:
    words = shlex.split(settings(default_units["tp"])["ExecStartPre"][0].removeprefix("+"))
    assert words[:2] == ["/usr/bin/python3", "/usr/local/libexec/sglang-fleet/sglang-fleet-start-guard"]
    gpus = {i: {"index": i, "uuid": f"GPU-{i}", "used_mib": 0, "total_mib": 183359} for i in range(4)}
    monkeypatch.setattr(guard.nvidia, "query_gpus", lambda nvidia_smi, timeout: gpus)
    monkeypatch.setattr(guard.procfs, "listening_sockets", dict)
    monkeypatch.setattr(guard.evidence, "read_env_file", lambda path: {})
    assert guard.main(words[2:]) == 0
    assert "GPU 2,3 and port 30010 free after" in capsys.readouterr().out


def test_the_role_installs_the_agent_where_the_guard_imports_it() -> None:
    tasks = (ROLE / "tasks/main.yml").read_text(encoding="utf-8")
    assert "(_sglang_server_libexec ~ '/sglang_fleet_agent.py') | sglang_ops.fleet.host_agent_file" in tasks
    assert "{{ _sglang_server_libexec }}/sglang-fleet-start-guard" in tasks
    guard_source = (ROLE / "files/sglang-fleet-start-guard").read_text(encoding="utf-8")
    assert "from sglang_fleet_agent import" in guard_source


def test_a_pods_program_runs_the_units_command_line_through_its_start_command(default_units, tmp_path) -> None:
    """One source for the command line: the program's words after ``--`` are the unit's ExecStart,
    and before them the start limit, the start guard (as the unit's ExecStartPre gives it), the
    secrets file and the user."""
    for name in ("gpu0", "tp"):
        program = default_units[f"program:{name}"]
        command = settings(program)["command"][0].replace("%%", "%")
        words = shlex.split(command)
        split = words.index("--")
        assert words[split + 1 :] == shlex.split(settings(default_units[name])["ExecStart"][0])
        start, guard = words[:split], shlex.split(settings(default_units[name])["ExecStartPre"][0].removeprefix("+"))
        assert start[:2] == ["/usr/bin/python3", "/workspace/sglang-fleet/bin/sglang-fleet-supervised-start"]
        assert ["--guard", guard[1]] == start[start.index("--guard") : start.index("--guard") + 2]
        assert [w.removeprefix("--guard-arg=") for w in start if w.startswith("--guard-arg=")] == guard[2:]
        assert start[start.index("--burst") + 1] == str(DEFAULTS["sglang_server_start_limit_burst"])
        assert start[start.index("--env-file") + 1] == "/etc/sglang-fleet/secrets.env"
        assert start[start.index("--user") + 1] == DEFAULTS["sglang_server_user"]
        assert settings(program)["directory"] == [f"/workspace/sglang-fleet/services/sglang-{name}"]
        # The secrets are read by the start command, never written here.
        assert HOST["sglang_server_api_key"] not in program


def test_supervisords_own_parser_accepts_the_programs(tmp_path) -> None:
    root = tmp_path / "root"
    checker = Supervisord(str(root))
    Path(checker.paths["logs"]).mkdir(parents=True)  # the role makes it before the programs
    checker.paths["venv"] = sys.prefix  # supervisor, as requirements/dev.txt pins it
    units = render(tmp_path / "pod", sglang_server_supervisor_root=str(root))
    for name in ("gpu0", "tp"):
        assert checker.verify(f"sglang-{name}.conf", units[f"program:{name}"]) is None
    assert checker.verify("bad.conf", units["program:gpu0"].replace("startsecs=1", "startsecs=x")) is not None
