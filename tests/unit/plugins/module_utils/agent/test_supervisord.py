"""The supervision of a pod against a real supervisord (PyPI's supervisor, the release the server role
installs), in a temporary root: states in systemd's words, starts and stops, the process group key
of detached children, the kill of every process of a service (and of nothing else), the logs of
one launch, the start limit of the start command, and the check of a program file."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent import supervisord as sd
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.bundle import bundle_source
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.evidence import Redactor
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.host import Host

REPO = Path(__file__).resolve().parents[5]
START = REPO / "roles" / "server" / "files" / "sglang-fleet-supervised-start"
SUPERVISORD = Path(sys.executable).parent / "supervisord"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not SUPERVISORD.exists(), reason="needs root and supervisor (requirements/dev.txt)"
)

# A server: marks its launch as the start command does, prints its startup lines, then starts a
# scheduler that detaches (a new session, its parent gone: re-parented), and serves until SIGTERM.
SERVER = textwrap.dedent(
    """
    import os, signal, sys, time
    print("LAUNCH_MARK pid=%d at now" % os.getpid(), flush=True)
    print("Load weight end. mem usage=1.00 GB.", flush=True)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a scheduler that outlives its parent
            time.sleep(3600)
        os._exit(0)
    print("max_total_num_tokens=1000, line " + sys.argv[1], flush=True)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    time.sleep(3600)
    """
).replace("LAUNCH_MARK", sd.LAUNCH_MARK)


def program(root: Path, name: str, command: list[str], **more: Any) -> None:
    paths = sd.layout(str(root))
    (Path(paths["services"]) / name).mkdir(parents=True, exist_ok=True)
    lines = {
        "command": shlex.join(command).replace("%", "%%"),
        "directory": f"{paths['services']}/{name}",
        "autostart": "false",
        "autorestart": "unexpected",
        "exitcodes": f"0,{sd.START_LIMIT_EXIT}",
        "startsecs": "1",
        "startretries": "0",
        "stopwaitsecs": "2",
        "killasgroup": "true",
        "redirect_stderr": "true",
        "stdout_logfile": f"{paths['logs']}/{name}.log",
        **{k: str(v) for k, v in more.items()},
    }
    body = "".join(f"{k}={v}\n" for k, v in lines.items())
    Path(paths["programs"], f"{name}.conf").write_text(f"[program:{name}]\n{body}")


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[sd.Supervisord]:
    root = tmp_path / "root"
    paths = sd.layout(str(root))
    for key in ("programs", "logs", "services", "starts"):
        Path(paths[key]).mkdir(parents=True)
    sock = tmp_path / "s.sock"
    Path(paths["config"]).write_text(
        textwrap.dedent(
            f"""
            [unix_http_server]
            file={sock}
            chmod=0700
            [supervisord]
            user=root
            logfile={paths["logs"]}/supervisord.log
            pidfile={tmp_path}/supervisord.pid
            nodaemon=false
            [rpcinterface:supervisor]
            supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
            [include]
            files = {paths["programs"]}/*.conf
            """
        )
    )
    (tmp_path / "server.py").write_text(SERVER)
    program(root, "sglang-gpu0", [sys.executable, str(tmp_path / "server.py"), "first"])
    subprocess.run([str(SUPERVISORD), "-c", paths["config"]], check=True)
    service = sd.Supervisord(str(root), str(sock))
    service.paths["venv"] = sys.prefix
    deadline = time.monotonic() + 20
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield service
    finally:
        pid = int((tmp_path / "supervisord.pid").read_text())
        for group in list(Path(paths["services"]).iterdir()):
            service.kill_all([group.name])
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)


def wait_for(check: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s: {check}")


UNIT = "sglang-gpu0.service"


def state(service: sd.Supervisord) -> dict[str, str]:
    return service.show([UNIT])[UNIT]


def members(service: sd.Supervisord) -> list[int]:
    group = service.service_dir(UNIT)
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and service.group_of(int(p)) == group)


def test_a_program_in_systemds_words_from_start_to_stop(pod: sd.Supervisord) -> None:
    before = state(pod)
    assert (before["ActiveState"], before["MainPID"], before["InvocationID"]) == ("inactive", "0", "")
    assert pod.show(["sglang-nothing.service"])["sglang-nothing.service"]["LoadState"] == "not-found"

    started = pod.start([UNIT], wait=False)
    assert started["rc"] == 0, started
    running = wait_for(lambda: (s := state(pod))["ActiveState"] == "active" and s)
    pid = int(running["MainPID"])
    assert running["InvocationID"].endswith(f"-{pid}") and running["ControlGroup"] == pod.service_dir(UNIT)
    # The main process and the detached, re-parented scheduler: both found by their directory.
    procs = wait_for(lambda: len(m := members(pod)) == 2 and m)
    scheduler = next(p for p in procs if p != pid)
    assert os.getsid(scheduler) != os.getsid(pid)

    stopped = pod.stop([UNIT], wait=True, timeout=30)
    assert stopped["rc"] == 0, stopped
    assert state(pod)["ActiveState"] == "inactive"
    # supervisord SIGKILLs only the process group: the detached scheduler survives it...
    assert members(pod) == [scheduler]
    # ...and the retune's kill of every process of the service does not.
    killed = pod.kill_all([UNIT])
    assert killed["stdout"] == str(scheduler)
    wait_for(lambda: not members(pod))


def test_kill_all_leaves_a_bystander_alone(pod: sd.Supervisord, tmp_path: Path) -> None:
    # Its command line says sglang and generate, and it runs the same program: not the instance's.
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "sglang", "generate"], cwd=tmp_path
    )
    try:
        pod.start([UNIT], wait=True, timeout=30)
        wait_for(lambda: len(members(pod)) == 2)
        pod.kill_all([UNIT])
        wait_for(lambda: not members(pod))
        assert bystander.poll() is None
        assert pod.group_of(bystander.pid) == ""
    finally:
        bystander.kill()
        bystander.wait()


def test_the_log_of_one_launch(pod: sd.Supervisord, tmp_path: Path) -> None:
    log = Path(pod.paths["logs"], "sglang-gpu0.log")
    log.write_text(f"{sd.LAUNCH_MARK} pid=11 at then\nLoad weight end. old launch\nsecret s3cr3t\n")
    pod.start([UNIT], wait=True, timeout=30)
    wait_for(lambda: "line first" in log.read_text())
    invocation = state(pod)["InvocationID"]
    lines, source, error = pod.startup_lines(invocation, UNIT, "Load weight|max_total_num_tokens", Redactor([]))
    assert lines == ["Load weight end. mem usage=1.00 GB.", "max_total_num_tokens=1000, line first"]
    assert (source, error) == ("supervisord log (this launch)", None)
    # An earlier launch is read by its own invocation, secrets masked.
    assert pod.log_tail("0-11", UNIT, 5, Redactor(["s3cr3t"])) == [
        f"{sd.LAUNCH_MARK} pid=11 at then",
        "Load weight end. old launch",
        "secret ********",
    ]
    # Rotated files are read oldest first.
    Path(f"{log}.1").write_text(f"{sd.LAUNCH_MARK} pid=5 at before\nrotated\n")
    assert pod.log_tail("0-5", UNIT, 5, Redactor([]))[:2] == [f"{sd.LAUNCH_MARK} pid=5 at before", "rotated"]


def test_a_changed_program_takes_effect_at_its_next_start_only(pod: sd.Supervisord, tmp_path: Path) -> None:
    pod.start([UNIT], wait=True, timeout=30)
    root = Path(pod.paths["root"])
    program(root, "sglang-gpu0", [sys.executable, str(tmp_path / "server.py"), "second"])
    assert state(pod)["NeedDaemonReload"] == "yes"
    assert pod.reload()["rc"] == 0
    first = int(state(pod)["MainPID"])
    assert Path(f"/proc/{first}/cmdline").read_bytes().split(b"\0")[2] == b"first"  # still running as started
    pod.stop([UNIT], wait=True, timeout=30)
    pod.kill_all([UNIT])
    pod.start([UNIT], wait=True, timeout=30)
    second = int(state(pod)["MainPID"])
    assert Path(f"/proc/{second}/cmdline").read_bytes().split(b"\0")[2] == b"second"
    assert state(pod)["NeedDaemonReload"] == "no"


def start_command(tmp_path: Path, guard_exit: int) -> list[str]:
    """The role's start command, beside the agent bundle as the role installs it, with a guard
    that answers ``guard_exit``."""
    libexec = tmp_path / "libexec"
    libexec.mkdir(exist_ok=True)
    shutil.copy(START, libexec / START.name)
    (libexec / "sglang_fleet_agent.py").write_text(bundle_source())
    (libexec / "guard").write_text(f"import sys\nprint('guard: ' + ' '.join(sys.argv[1:]))\nsys.exit({guard_exit})\n")
    (tmp_path / "secrets.env").write_text('SGLANG_API_KEY="k3y-value"\n')
    return [
        sys.executable,
        str(libexec / START.name),
        "--ledger",
        str(tmp_path / "root" / "starts" / "sglang-gpu0"),
        "--burst",
        "2",
        "--interval",
        "600",
        "--guard",
        str(libexec / "guard"),
        "--guard-arg=--port",
        "--guard-arg=30000",
        "--env-file",
        str(tmp_path / "secrets.env"),
        "--user",
        "nobody",
        "--",
    ]


def test_the_start_command_marks_the_launch_guards_and_limits_the_starts(pod: sd.Supervisord, tmp_path: Path) -> None:
    # The host's python3: the user dropped to may not reach this virtualenv.
    crash = [
        "/usr/bin/python3",
        "-c",
        "import os, sys, time; print('uid', os.getuid(), os.environ.get('SGLANG_API_KEY') == 'k3y-value'); "
        "time.sleep(1.5); sys.exit(3)",
    ]
    program(Path(pod.paths["root"]), "sglang-gpu0", start_command(tmp_path, 0) + crash)
    pod.reload()
    pod.reset_failed([UNIT])
    pod.start([UNIT], wait=False)
    # It crashes after 1.5 s, supervisord restarts it (the start guard again), then the ledger
    # refuses the third start: the service is left failed, not looping.
    final = wait_for(lambda: (s := state(pod))["ActiveState"] == "failed" and s, timeout=30)
    assert final["Result"] == "start-limit-hit" and final["NRestarts"] == "1"
    text = Path(pod.paths["logs"], "sglang-gpu0.log").read_text()
    assert text.count(sd.LAUNCH_MARK) == 3 and text.count("guard: --port 30000") == 2
    assert f"uid {65534} True" in text  # the user dropped to, the secret read from the root-only file
    assert "start refused: 2 starts within 600 s" in text
    # A reset (the retune's, the role's) clears the count: the next start runs.
    pod.reset_failed([UNIT])
    pod.start([UNIT], wait=False)
    wait_for(lambda: state(pod)["ActiveState"] == "active")


def test_a_start_the_guard_refuses_fails_without_running_the_server(pod: sd.Supervisord, tmp_path: Path) -> None:
    program(Path(pod.paths["root"]), "sglang-gpu0", [*start_command(tmp_path, 1), "/bin/echo", "server ran"])
    pod.reload()
    pod.start([UNIT], wait=False)
    wait_for(lambda: state(pod)["ActiveState"] == "failed")
    text = Path(pod.paths["logs"], "sglang-gpu0.log").read_text()
    assert "start guard refused the start (exit 1)" in text and "server ran" not in text


def test_supervisords_parser_checks_a_program_file(pod: sd.Supervisord) -> None:
    assert pod.verify("sglang-gpu0.conf", "[program:sglang-gpu0]\ncommand=/bin/true\nstartsecs=1\n") is None
    problem = pod.verify("sglang-gpu0.conf", "[program:sglang-gpu0]\ncommand=/bin/true\nstartsecs=soon\n")
    assert problem is not None and "'soon' in section 'program:sglang-gpu0'" in problem


def test_the_host_reads_a_pods_processes_by_their_service(pod: sd.Supervisord, tmp_path: Path) -> None:
    host = Host(
        {
            "secrets_file": str(tmp_path / "none.env"),
            "supervisor": "supervisord",
            "supervisor_root": pod.paths["root"],
            "devices_dir": "/dev",
        }
    )
    host.service = pod
    pod.start([UNIT], wait=True, timeout=30)
    wait_for(lambda: len(members(pod)) == 2)
    table = host.processes()
    mine = sorted(pid for pid, p in table.items() if p["cgroup"] == pod.service_dir(UNIT))
    assert mine == members(pod)


def test_an_exit_is_a_crash_unless_the_program_expects_it(tmp_path: Path) -> None:
    """EXITED in systemd's words: a crash waits to be restarted (auto-restart), an expected failure
    (the client's exit 2, bad config) stays failed, a clean exit is inactive."""
    service = sd.Supervisord(str(tmp_path))
    Path(service.paths["programs"]).mkdir(parents=True)
    Path(service.definition_path(UNIT)).write_text("[program:sglang-gpu0]\ncommand=x\nexitcodes=0,2,78\n")
    info = {"statename": "EXITED", "pid": 0, "start": 1}

    def seen(code: int) -> tuple[str, str, str]:
        state = service._state(UNIT, {**info, "exitstatus": code}, set())
        return state["ActiveState"], state["SubState"], state["Result"]

    assert seen(1) == ("activating", "auto-restart", "exit-code")
    assert seen(2) == ("failed", "failed", "exit-code")
    assert seen(78) == ("failed", "failed", "start-limit-hit")
    assert seen(0) == ("inactive", "dead", "success")
