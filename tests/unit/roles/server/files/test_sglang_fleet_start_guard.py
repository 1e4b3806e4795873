"""The units' start guard (ExecStartPre): its decisions as pure functions, its polling loop with
the host agent's readers replaced, and the installed script run for real against this machine's
/proc, with a stand-in nvidia-smi."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ansible_collections.sglang_ops.fleet.plugins.module_utils import agent
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent import evidence, nvidia, procfs
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.bundle import bundle_source

REPO_ROOT = Path(__file__).resolve().parents[5]
GUARD = REPO_ROOT / "roles/server/files/sglang-fleet-start-guard"
# The name the server role installs the agent under, next to the guard (roles/server/tasks).
AGENT_MODULE = "sglang_fleet_agent"


@pytest.fixture(scope="module")
def guard() -> ModuleType:
    """The guard as a module, importing the collection's agent package under its installed name
    (its modules already loaded, so the guard gets these very modules)."""
    saved_path, saved_bytecode = list(sys.path), sys.dont_write_bytecode
    sys.modules.setdefault(AGENT_MODULE, agent)
    loader = importlib.machinery.SourceFileLoader("sglang_fleet_start_guard", str(GUARD))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.path[:], sys.dont_write_bytecode = saved_path, saved_bytecode
    assert (module.evidence, module.nvidia, module.procfs) == (evidence, nvidia, procfs)
    return module


def proc(pid: int, cmdline: list[str], gpus=(), ports=(), cgroup: str = "/user.slice", state: str = "S") -> dict:
    return {
        "pid": pid,
        "ppid": 1,
        "state": state,
        "starttime": 1000 + pid,
        "cmdline": cmdline,
        "cgroup": cgroup,
        "gpus": list(gpus),
        "ports": list(ports),
    }


# --------------------------------------------------------------------------------------------
# blocking(): the decision to start
# --------------------------------------------------------------------------------------------


def test_free_gpu_and_port_start(guard: ModuleType) -> None:
    assert guard.blocking([0], 30000, 1024, {0: 0, 1: 90000}, None, {22, 30001}) == []


def test_threshold_is_inclusive_like_the_retune(guard: ModuleType) -> None:
    assert guard.blocking([0], 30000, 1024, {0: 1024}, None, set()) == []
    assert guard.blocking([0], 30000, 1024, {0: 1025}, None, set()) == [
        "GPU 0: 1025 MiB used > release threshold 1024 MiB"
    ]


def test_every_gpu_of_a_tensor_parallel_instance_must_be_free(guard: ModuleType) -> None:
    reasons = guard.blocking([2, 3], 30010, 1024, {2: 0, 3: 51200}, None, set())
    assert reasons == ["GPU 3: 51200 MiB used > release threshold 1024 MiB"]


def test_a_listener_on_the_port_blocks(guard: ModuleType) -> None:
    assert guard.blocking([0], 30000, 1024, {0: 0}, None, {30000}) == ["port 30000: something listens on it"]


def test_no_usable_nvidia_smi_answer_is_not_free(guard: ModuleType) -> None:
    reasons = guard.blocking([0], 30000, 1024, None, "GPU memory: ran 'nvidia-smi ...': timed out", set())
    assert reasons == ["GPU memory unknown: GPU memory: ran 'nvidia-smi ...': timed out"]
    assert guard.blocking([0], 30000, 1024, None, None, set()) != []


def test_unreadable_socket_tables_are_not_a_free_port(guard: ModuleType) -> None:
    reasons = guard.blocking([0], 30000, 1024, {0: 0}, None, None, "listening sockets: Permission denied")
    assert reasons == ["port 30000 unknown: listening sockets: Permission denied"]


def test_a_gpu_nvidia_smi_does_not_list_is_not_free(guard: ModuleType) -> None:
    assert guard.blocking([5], 30005, 1024, {0: 0, 1: 0}, None, set()) == ["nvidia-smi does not list GPU 5"]


# --------------------------------------------------------------------------------------------
# holders() and the journal lines
# --------------------------------------------------------------------------------------------

TABLE = {
    # An orphan scheduler outside any unit, holding GPU 1's device.
    4100: proc(4100, ["sglang::scheduler_TP0"], gpus=[1], cgroup="/user.slice/session-3.scope"),
    # Something unrelated listening on the instance's port.
    4200: proc(4200, ["python3", "-m", "http.server", "30001"], ports=[30001]),
    # A server of another instance on another GPU: not a holder of this one.
    4300: proc(4300, ["sglang::scheduler_TP0"], gpus=[0], cgroup="/system.slice/sglang-gpu0.service"),
    # A zombie holds nothing.
    4400: proc(4400, ["defunct"], gpus=[1], state="Z"),
    # Seen by nvidia-smi only (its compute apps, where PIDs are meaningful here).
    4500: proc(4500, ["python3", "train.py", "--api-key", "sk-secret-1234"]),
}


def test_holders_are_every_process_on_the_gpus_or_port_by_pid(guard: ModuleType) -> None:
    found = guard.holders(TABLE, {4500: [1]}, [1], 30001)
    assert [h["pid"] for h in found] == [4100, 4200, 4500]
    by_pid = {h["pid"]: h for h in found}
    assert by_pid[4100]["gpus"] == [1]
    assert by_pid[4100]["reason"] == "SGLang process outside the unit holding GPU [1]"
    assert by_pid[4200]["port"] == 30001
    assert by_pid[4200]["reason"] == "not an SGLang process, holding port 30001"
    assert by_pid[4500]["gpus"] == [1]


def test_journal_lines_name_pid_command_line_and_cgroup_with_secrets_masked(guard: ModuleType) -> None:
    found = guard.holders(TABLE, {4500: [1]}, [1], 30001)
    redact = evidence.Redactor(["sk-secret-1234"]).argv
    lines = guard.verdict_lines(["GPU 1: 90000 MiB used > release threshold 1024 MiB"], found, redact)
    assert lines[0] == "GPU 1: 90000 MiB used > release threshold 1024 MiB"
    assert lines[1] == (
        "held by: PID 4100 holds GPU 1 (SGLang process outside the unit holding GPU [1]; "
        "cgroup /user.slice/session-3.scope): sglang::scheduler_TP0"
    )
    assert "PID 4200 holds port 30001" in lines[2]
    assert "python3 -m http.server 30001" in lines[2]
    assert "PID 4500 holds GPU 1" in lines[3]
    assert "sk-secret-1234" not in "\n".join(lines)
    assert "--api-key ********" in lines[3]


def test_memory_held_by_no_process_here_says_so(guard: ModuleType) -> None:
    lines = guard.verdict_lines(["GPU 0: 90000 MiB used > release threshold 1024 MiB"], [], lambda argv: argv)
    assert lines == ["GPU 0: 90000 MiB used > release threshold 1024 MiB", guard.NO_HOLDER_HERE]
    # nvidia-smi failing is no claim about the memory: no such line then.
    assert guard.verdict_lines(["GPU memory unknown: x"], [], lambda argv: argv) == ["GPU memory unknown: x"]


# --------------------------------------------------------------------------------------------
# main(): the polling loop, the agent's readers replaced
# --------------------------------------------------------------------------------------------


class FakeHost:
    """nvidia-smi answers in order (the last one repeats), a process table, listening ports."""

    def __init__(self, answers: list[Any], table: dict | None = None, listening: dict | None = None):
        self.answers = list(answers)
        self.table = table or {}
        self.listening = listening or {}
        self.queries = 0

    def query_gpus(self, nvidia_smi: str, timeout: float) -> dict:
        self.queries += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return {i: {"index": i, "uuid": f"GPU-{i}", "used_mib": mib, "total_mib": 183359} for i, mib in answer.items()}

    def install(self, monkeypatch: pytest.MonkeyPatch, guard: ModuleType) -> None:
        monkeypatch.setattr(guard.nvidia, "query_gpus", self.query_gpus)
        monkeypatch.setattr(guard.nvidia, "query_compute_apps", lambda *a, **k: [])
        monkeypatch.setattr(guard.procfs, "listening_sockets", lambda: dict(self.listening))
        monkeypatch.setattr(guard.procfs, "process_table", lambda devices_dir="/dev": dict(self.table))
        monkeypatch.setattr(guard.evidence, "read_env_file", lambda path: {})

        def no_kill(*args: Any) -> None:
            raise AssertionError(f"the guard signalled a process: {args}")

        monkeypatch.setattr(os, "kill", no_kill)
        monkeypatch.setattr(os, "killpg", no_kill)


def nvsmi_error(what: str = "GPU memory", rc: int | None = None) -> Exception:
    return evidence.EvidenceError(what, ["nvidia-smi", "--query-gpu=index"], rc, "", "NVIDIA-SMI has failed")


ARGS = [
    *("--gpus", "1", "--port", "30001", "--threshold-mib", "1024", "--interval", "0.01"),
    *("--secrets-file", "/nonexistent/secrets.env"),
]


def test_waits_for_the_release_then_starts(guard, monkeypatch, capsys) -> None:
    host = FakeHost([{1: 90000}, {1: 40000}, {1: 2048}, {1: 300}])
    host.install(monkeypatch, guard)
    assert guard.main([*ARGS, "--timeout", "10"]) == 0
    assert host.queries == 4
    out = capsys.readouterr().out
    assert "waiting up to 10s for GPU 1 and port 30001" in out
    assert "GPU 1: 90000 MiB used > release threshold 1024 MiB" in out
    assert guard.NO_HOLDER_HERE in out
    assert "start guard: GPU 1 and port 30001 free after" in out
    assert "GPU 1 300 MiB, threshold 1024 MiB" in out


def test_starts_at_once_when_free(guard, monkeypatch, capsys) -> None:
    host = FakeHost([{0: 0, 1: 0}])
    host.install(monkeypatch, guard)
    t0 = time.monotonic()
    assert guard.main([*ARGS, "--timeout", "10"]) == 0
    assert time.monotonic() - t0 < 2
    assert host.queries == 1
    assert "waiting" not in capsys.readouterr().out


def test_an_orphan_holding_the_gpu_fails_the_start_at_the_deadline(guard, monkeypatch, capsys) -> None:
    table = {4100: proc(4100, ["sglang::scheduler_TP0"], gpus=[1], cgroup="/user.slice/session-3.scope")}
    host = FakeHost([{1: 90000}], table=table)
    host.install(monkeypatch, guard)
    t0 = time.monotonic()
    assert guard.main([*ARGS, "--timeout", "0.3"]) == 1
    assert 0.3 <= time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert "refusing to start: GPU 1 and port 30001 not free within 0s" in err
    assert "nothing was signalled" in err
    assert "PID 4100 holds GPU 1" in err
    assert "sglang::scheduler_TP0" in err


def test_a_listener_on_the_port_fails_the_start_naming_it(guard, monkeypatch, capsys) -> None:
    table = {4200: proc(4200, ["python3", "-m", "http.server", "30001"], ports=[30001])}
    host = FakeHost([{1: 0}], table=table, listening={777: 30001})
    host.install(monkeypatch, guard)
    assert guard.main([*ARGS, "--timeout", "0.2"]) == 1
    err = capsys.readouterr().err
    assert "port 30001: something listens on it" in err
    assert "PID 4200 holds port 30001" in err


def test_a_failing_nvidia_smi_is_retried_then_reported(guard, monkeypatch, capsys) -> None:
    host = FakeHost([nvsmi_error(rc=9)])
    host.install(monkeypatch, guard)
    assert guard.main([*ARGS, "--timeout", "0.3"]) == 1
    assert host.queries > 2
    err = capsys.readouterr().err
    assert "GPU memory unknown: GPU memory: ran 'nvidia-smi --query-gpu=index': rc=9" in err
    assert "NVIDIA-SMI has failed" in err


def test_a_hanging_nvidia_smi_then_an_answer_starts(guard, monkeypatch, capsys) -> None:
    host = FakeHost([nvsmi_error(rc=None), nvsmi_error(rc=None), {1: 0}])
    host.install(monkeypatch, guard)
    assert guard.main([*ARGS, "--timeout", "10"]) == 0
    out = capsys.readouterr().out
    assert "timed out" in out
    assert "free after" in out


def test_nvidia_smi_calls_end_by_the_deadline(guard, monkeypatch) -> None:
    timeouts: list[float] = []

    def query_gpus(nvidia_smi: str, timeout: float) -> dict:
        timeouts.append(timeout)
        raise nvsmi_error(rc=None)

    FakeHost([{}]).install(monkeypatch, guard)
    monkeypatch.setattr(guard.nvidia, "query_gpus", query_gpus)
    assert guard.main([*ARGS, "--timeout", "3", "--nvidia-smi-timeout", "20"]) == 1
    # Never more than what is left of the deadline (at least one second per call).
    assert timeouts[0] <= 3
    assert all(t <= 3 for t in timeouts)


# --------------------------------------------------------------------------------------------
# The installed layout, run for real: guard and agent side by side, this machine's /proc
# --------------------------------------------------------------------------------------------


@pytest.fixture
def installed(tmp_path: Path) -> dict[str, Path]:
    """The guard and the agent as the role installs them, a stand-in nvidia-smi whose memory.used
    comes from a file, and a devices directory with nvidia0..1."""
    libexec = tmp_path / "libexec"
    libexec.mkdir()
    shutil.copy(GUARD, libexec / GUARD.name)
    # What the server role installs (the filter host_agent_file): the package in one file.
    (libexec / f"{AGENT_MODULE}.py").write_text(bundle_source(), encoding="utf-8")
    devices = tmp_path / "dev"
    devices.mkdir()
    for index in (0, 1):
        (devices / f"nvidia{index}").touch()
    used = tmp_path / "used"
    used.write_text("0, GPU-0, 0, 183359\n1, GPU-1, 0, 183359\n")
    nvidia_smi = tmp_path / "nvidia-smi"
    nvidia_smi.write_text(
        f'#!/bin/sh\ncase "$1" in --query-gpu=*) cat {used} ;; --query-compute-apps=*) ;; *) exit 2 ;; esac\n'
    )
    nvidia_smi.chmod(0o755)
    return {"guard": libexec / GUARD.name, "devices": devices, "used": used, "nvidia_smi": nvidia_smi, "tmp": tmp_path}


def run_guard(installed: dict[str, Path], port: int, timeout: float) -> subprocess.CompletedProcess:
    argv = [
        sys.executable,
        str(installed["guard"]),
        *("--gpus", "1", "--port", str(port), "--threshold-mib", "1024", "--timeout", str(timeout)),
        *("--interval", "0.1", "--nvidia-smi", str(installed["nvidia_smi"])),
        *("--devices-dir", str(installed["devices"]), "--secrets-file", str(installed["tmp"] / "none.env")),
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_installed_guard_starts_on_free_gpus(installed) -> None:
    done = run_guard(installed, free_port(), timeout=5)
    assert done.returncode == 0, done.stderr
    assert "GPU 1 and port" in done.stdout
    assert "free after" in done.stdout
    assert not list(installed["guard"].parent.glob("__pycache__")), "the guard wrote bytecode beside itself"


def test_installed_guard_names_the_process_holding_the_gpu_device(installed) -> None:
    installed["used"].write_text("0, GPU-0, 0, 183359\n1, GPU-1, 50000, 183359\n")
    with open(installed["devices"] / "nvidia1", "rb"):
        done = run_guard(installed, free_port(), timeout=0.5)
    assert done.returncode == 1
    assert "GPU 1: 50000 MiB used > release threshold 1024 MiB" in done.stderr
    # This test process holds the device open: it is named by PID, with its command line.
    assert f"PID {os.getpid()} holds GPU 1 (not an SGLang process, holding GPU [1]" in done.stderr
    assert Path(sys.argv[0]).name in done.stderr


def test_installed_guard_names_the_listener_on_the_port(installed) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = int(sock.getsockname()[1])
        done = run_guard(installed, port, timeout=0.5)
    assert done.returncode == 1
    assert f"port {port}: something listens on it" in done.stderr
    assert f"PID {os.getpid()} holds port {port}" in done.stderr
