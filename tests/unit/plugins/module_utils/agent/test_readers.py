"""The host agent's evidence gathering and its pure decisions, on real processes where it
matters (killing, /proc scanning, sockets), without systemd."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from agent_requests import run_op

from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent import (
    evidence,
    http_client,
    op_apply,
    op_inspect,
    op_stop,
    procfs,
    supervision,
    systemd,
)
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.evidence import (
    EvidenceError,
    Redactor,
    read_env_file,
)
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.host import Host
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.nvidia import (
    meaningful_app_pids,
    query_compute_apps,
    query_gpus,
)
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.procfs import (
    classify_processes,
    is_sglang_process,
    kill_with_escalation,
    process_table,
)
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.settings import (
    argv_diff,
    argv_matches,
    compare_server_info,
)


def spawn(code: str, *, title: str | None = None) -> subprocess.Popen:
    """A real child process running ``code``; prints 'ready' when it is set up."""
    argv = [sys.executable, "-c", code]
    if title:
        argv = [sys.executable, "-c", code, title]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def devices(tmp_path: Path) -> Path:
    d = tmp_path / "dev"
    d.mkdir()
    for i in range(4):
        (d / f"nvidia{i}").write_text("")
    return d


# -- identification -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cmdline", "expected"),
    [
        (["sglang::scheduler"], True),
        (["sglang::scheduler_TP1"], True),
        (["sglang::detokenizer"], True),
        (["/opt/sglang/venv/bin/python", "-m", "sglang.launch_server", "--port", "30000"], True),
        (["/usr/bin/sglang", "serve", "--model-path", "m"], True),
        (["/opt/sglang/venv/bin/python", "/usr/local/libexec/sglang-fleet/sglang-fleet-launch", "--port", "1"], True),
        # The classic accident: a broad pattern matching unrelated programs.
        (["python3", "/home/u/sglang_generate_report.py", "--generate"], False),
        (["bash", "-c", "echo sglang generate"], False),
        (["python3", "-m", "sglang_fleet", "generate"], False),
        (["python3", "-m", "sglang.launch_server_helper"], False),
        ([], False),
    ],
)
def test_is_sglang_process_uses_exact_markers(cmdline: list[str], expected: bool) -> None:
    assert is_sglang_process(cmdline) is expected


def proc(pid: int, cmdline: list[str], cgroup: str = "/user.slice", gpus=(), ports=(), state="S") -> dict:
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


UNIT_CG = "/system.slice/sglang-gpu1.service"
OTHER_CG = "/system.slice/sglang-gpu2.service"


def test_classify_sorts_owned_foreign_and_bystanders() -> None:
    table = {
        10: proc(10, ["python", "-m", "sglang.launch_server"], UNIT_CG, ports=[30001]),
        11: proc(11, ["sglang::scheduler"], UNIT_CG + "/x", gpus=[1]),
        12: proc(12, ["sglang::scheduler"], "/init.scope", gpus=[1]),  # detached orphan
        13: proc(13, ["python3", "trainer.py"], "/user.slice", gpus=[1]),  # foreign CUDA job
        14: proc(14, ["python3", "-m", "http.server", "30001"], "/user.slice", ports=[30001]),
        15: proc(15, ["python3", "sglang_generate.py"], "/user.slice"),  # bystander by name only
        16: proc(16, ["sglang::scheduler"], OTHER_CG, gpus=[1]),  # another instance on our GPU
        17: proc(17, ["sglang::scheduler"], "/init.scope", gpus=[2]),  # orphan on another GPU
        18: proc(18, ["sglang::scheduler"], "/init.scope", gpus=[1], state="Z"),
    }
    out = classify_processes({"gpus": [1], "port": 30001, "cgroup": UNIT_CG}, table, [UNIT_CG, OTHER_CG], {})
    assert [p["pid"] for p in out["owned"]] == [10, 11, 12]
    assert [p["pid"] for p in out["foreign"]] == [13, 14, 16]
    reasons = {p["pid"]: p["reason"] for p in out["owned"] + out["foreign"]}
    assert "outside the unit" in reasons[12]
    assert "not an SGLang process" in reasons[13]
    assert "another managed instance" in reasons[16]


def test_classify_uses_compute_app_pids_when_meaningful() -> None:
    table = {20: proc(20, ["sglang::scheduler"], "/init.scope")}
    out = classify_processes({"gpus": [0], "port": 1, "cgroup": UNIT_CG}, table, [], {20: [0]})
    assert [p["pid"] for p in out["owned"]] == [20]
    assert classify_processes({"gpus": [0], "port": 1, "cgroup": UNIT_CG}, table, [], {})["owned"] == []


def test_compute_app_pids_from_another_namespace_are_not_used() -> None:
    table = {20: proc(20, ["sglang::scheduler"], gpus=[0])}
    apps = [{"pid": 20, "gpu": 0, "used_mib": 100}]
    assert meaningful_app_pids(apps, table) == ({20: [0]}, True)
    # As inside LXC: nvidia-smi reports host PIDs that do not exist here.
    assert meaningful_app_pids([{"pid": 120020, "gpu": 0, "used_mib": 100}], table) == ({}, False)
    # A PID that exists but does not hold that GPU is a different process: distrust them all.
    assert meaningful_app_pids([{"pid": 20, "gpu": 3, "used_mib": 1}], table) == ({}, False)


# -- /proc scanning and killing real processes ------------------------------------------------

HOLDER = textwrap.dedent(
    """
    import socket, sys, time, signal
    dev = open(sys.argv[1])
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0)); s.listen()
    if len(sys.argv) > 3 and sys.argv[3] == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    print(s.getsockname()[1], flush=True)
    time.sleep(300)
    """
)


def start_holder(device: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(device), "x", *extra], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    return p, int(p.stdout.readline())


def test_process_table_sees_gpu_handles_and_listening_ports(devices: Path) -> None:
    p, port = start_holder(devices / "nvidia2")
    try:
        table = process_table(str(devices))
        entry = table[p.pid]
        assert entry["gpus"] == [2]
        assert entry["ports"] == [port]
        assert entry["cmdline"][:2] == [sys.executable, "-c"]
        assert entry["starttime"] > 0
        assert os.getpid() not in table  # the agent leaves itself out
    finally:
        p.kill()
        p.wait()


def test_kill_with_escalation_needs_sigkill_for_a_sigterm_ignorer(devices: Path) -> None:
    p, _unused = start_holder(devices / "nvidia0", "ignore-term")
    entry = process_table(str(devices))[p.pid]
    log = kill_with_escalation([dict(entry, reason="test")], grace=0.5, redactor=Redactor())
    assert [e["signal"] for e in log] == ["SIGTERM", "SIGKILL"]
    assert p.wait(timeout=5) == -signal.SIGKILL


def test_kill_with_escalation_stops_at_sigterm_when_it_suffices(devices: Path) -> None:
    p, _unused = start_holder(devices / "nvidia0")
    entry = process_table(str(devices))[p.pid]
    log = kill_with_escalation([entry], grace=5, redactor=Redactor())
    assert [e["signal"] for e in log] == ["SIGTERM"]
    assert p.wait(timeout=5) == -signal.SIGTERM


def test_kill_never_signals_a_reused_pid(devices: Path) -> None:
    p, _unused = start_holder(devices / "nvidia0")
    try:
        entry = dict(process_table(str(devices))[p.pid])
        entry["starttime"] -= 1  # what we saw was another process that had this PID
        assert kill_with_escalation([entry], grace=0.2, redactor=Redactor()) == []
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


# -- nvidia-smi: fail closed -------------------------------------------------------------------


def fake_smi(tmp_path: Path, body: str) -> str:
    path = tmp_path / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_query_gpus_parses_noheader_nounits(tmp_path: Path) -> None:
    smi = fake_smi(
        tmp_path,
        "printf '0, GPU-aaaa, 130215, 143771\\n1, GPU-bbbb, 0, 143771\\n'",
    )
    gpus = query_gpus(smi, 5)
    assert gpus[0] == {"index": 0, "uuid": "GPU-aaaa", "used_mib": 130215, "total_mib": 143771}
    assert gpus[1]["used_mib"] == 0


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("exit 0", "no GPU rows"),  # empty output is never success
        (
            'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9',
            "rc=9",
        ),
        ("printf '0, GPU-aaaa, [N/A], 143771\\n'", "unparsable"),
        ("printf '0, GPU-aaaa, 12\\n'", "unparsable"),
        ("sleep 5", "timed out"),
    ],
)
def test_query_gpus_fails_closed_quoting_what_came_back(tmp_path: Path, body: str, needle: str) -> None:
    smi = fake_smi(tmp_path, body)
    with pytest.raises(EvidenceError) as err:
        query_gpus(smi, 1)
    text = err.value.describe()
    assert needle in text
    assert "--query-gpu=index,uuid,memory.used,memory.total" in text


def _alive(pid: int) -> bool:
    """Running (not gone and not a zombie waiting for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_timed_out_command_leaves_no_process_behind(tmp_path: Path) -> None:
    """A hung nvidia-smi wrapper that forks: on timeout its whole process group is killed and
    reaped, at once, and the call returns within its deadline (not when the children end)."""
    pids = tmp_path / "pids"
    smi = fake_smi(
        tmp_path, f"sleep 60 & echo $! >> {pids}; sh -c 'sleep 60' & echo $! >> {pids}; echo $$ >> {pids}; wait"
    )
    t0 = time.monotonic()
    with pytest.raises(EvidenceError) as err:
        query_gpus(smi, 1)
    elapsed = time.monotonic() - t0
    assert "timed out" in err.value.describe()
    assert elapsed < 8, f"took {elapsed:.1f}s: the call waited for the wrapper's children"
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 3
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in started if _alive(p)] == []


def test_query_gpus_missing_binary(tmp_path: Path) -> None:
    with pytest.raises(EvidenceError) as err:
        query_gpus(str(tmp_path / "absent-nvidia-smi"), 1)
    assert err.value.rc == 127


def test_query_compute_apps_maps_uuids_and_na(tmp_path: Path) -> None:
    smi = fake_smi(tmp_path, "printf '4242, GPU-bbbb, 100998\\n77, GPU-aaaa, [N/A]\\n'")
    apps = query_compute_apps(smi, 5, {"GPU-aaaa": 0, "GPU-bbbb": 1})
    assert apps == [{"pid": 4242, "gpu": 1, "used_mib": 100998}, {"pid": 77, "gpu": 0, "used_mib": None}]


def test_release_fails_closed_when_nvidia_smi_breaks(tmp_path: Path) -> None:
    smi = fake_smi(tmp_path, "echo garbage; exit 0")
    res = run_op(
        {"op": "release", "nvidia_smi": smi, "instances": [{"name": "gpu0", "gpus": [0]}], "release_timeout": 1}
    )
    inst = res["instances"]["gpu0"]
    assert inst["released"] is False
    assert "garbage" in inst["msg"]


def test_release_waits_for_memory_to_fall(tmp_path: Path) -> None:
    # memory.used falls below the threshold on the third query: polled, not slept.
    counter = tmp_path / "n"
    counter.write_text("0")
    smi = fake_smi(
        tmp_path,
        f"n=$(cat {counter}); n=$((n+1)); echo $n > {counter}; "
        "if [ $n -ge 3 ]; then u=1; else u=90000; fi; printf '0, GPU-a, %s, 143771\\n1, GPU-b, 5000, 143771\\n' $u",
    )
    res = run_op(
        {
            "op": "release",
            "nvidia_smi": smi,
            "poll_interval": 0.05,
            "threshold_mib": 512,
            "release_timeout": 3,
            "instances": [{"name": "gpu0", "gpus": [0]}, {"name": "gpu1", "gpus": [1]}],
        }
    )
    assert res["instances"]["gpu0"]["released"] is True
    assert res["instances"]["gpu0"]["samples"] == 3
    assert res["instances"]["gpu0"]["used_mib_first"] == {"0": 90000}
    assert res["instances"]["gpu1"]["released"] is False
    assert "not released within 3s" in res["instances"]["gpu1"]["msg"]


# -- settings comparison and secrets ---------------------------------------------------------


def test_compare_server_info() -> None:
    expected = {"max_running_requests": 64, "mem_fraction_static": 0.93, "mamba_radix_cache_strategy": "no_buffer"}
    reported = {"max_running_requests": 64, "mem_fraction_static": 0.9300000001, "mamba_radix_cache_strategy": "auto"}
    assert compare_server_info(expected, reported) == [
        {"arg": "mamba_radix_cache_strategy", "expected": "no_buffer", "reported": "auto"}
    ]
    assert compare_server_info({"x": 1}, {}) == [{"arg": "x", "expected": 1, "reported": "(not reported)"}]
    assert compare_server_info({"x": [1, 2]}, {"x": [1, 2]}) == []
    assert compare_server_info({"x": True}, {"x": 1.0}) != []  # a switch is not a number
    assert compare_server_info({"x": [1.0, 2], "n": 64}, {"x": [1, 2], "n": 64.0}) == []
    assert compare_server_info({"a": {"k": 0.5}}, {"a": {"k": 0.6}}) == [
        {"arg": "a", "expected": {"k": 0.5}, "reported": {"k": 0.6}}
    ]
    assert compare_server_info({"a": "EAGLE"}, {"a": "EAGLE", "b": 3}) == []


def test_argv_matches_treats_env_substitution_as_a_wildcard() -> None:
    want = ["py", "-m", "sglang.launch_server", "--api-key", "${SGLANG_API_KEY}", "--port", "1"]
    assert argv_matches(want, ["py", "-m", "sglang.launch_server", "--api-key", "s3cret", "--port", "1"])
    assert not argv_matches(want, ["py", "-m", "sglang.launch_server", "--api-key", "s3cret", "--port", "2"])
    assert not argv_matches(want, want[:-1])


def test_argv_diff() -> None:
    before = [
        "py",
        "-m",
        "sglang.launch_server",
        "--max-mamba-cache-size",
        "80",
        "--disable-radix-cache",
        "--a",
        "x",
        "y",
    ]
    after = [
        "py",
        "-m",
        "sglang.launch_server",
        "--max-mamba-cache-size",
        "200",
        "--mem-fraction-static",
        "0.93",
        "--a",
        "x",
        "y",
    ]
    assert argv_diff(before, after) == {
        "changed": {"--max-mamba-cache-size": ["80", "200"]},
        "added": {"--mem-fraction-static": "0.93"},
        "removed": {"--disable-radix-cache": True},
    }
    assert argv_diff(["a", "--x", "1"], ["b", "--x", "1"])["changed"] == {"(command)": ["a", "b"]}


def test_redactor_hides_secret_values_everywhere() -> None:
    r = Redactor(["sk-live-123456", "hf_abcdefgh"])
    assert r.text("server_args=ServerArgs(api_key='sk-live-123456')") == "server_args=ServerArgs(api_key='********')"
    assert r.argv(["py", "--api-key", "whatever", "--admin-api-key=x1", "--port", "1"]) == [
        "py",
        "--api-key",
        "********",
        "--admin-api-key=********",
        "--port",
        "1",
    ]
    assert r.obj({"api_key": "zz", "admin_api_key": None, "nested": ["hf_abcdefgh"]}) == {
        "api_key": "********",
        "admin_api_key": None,
        "nested": ["********"],
    }


def test_read_env_file(tmp_path: Path) -> None:
    path = tmp_path / "secrets.env"
    path.write_text("# comment\nSGLANG_API_KEY='k1'\nHF_TOKEN=\"hf x\"\n\nEMPTY=\nbroken line\n")
    assert read_env_file(str(path)) == {"SGLANG_API_KEY": "k1", "HF_TOKEN": "hf x", "EMPTY": ""}
    assert read_env_file(str(tmp_path / "absent")) == {}


# -- files ------------------------------------------------------------------------------------


def test_apply_writes_atomically_with_modes_and_reports_changes(tmp_path: Path) -> None:
    unit = tmp_path / "etc" / "x.conf"
    secret = tmp_path / "etc" / "secrets.env"
    req = {
        "op": "apply",
        "diff": True,
        "files": [
            {"path": str(unit), "content": "a=1\n", "mode": "0644"},
            {"path": str(secret), "content": "SGLANG_API_KEY=k\n", "mode": "0600", "secret": True},
        ],
    }
    check = run_op(dict(req, check_mode=True))
    assert check["changed"] is True
    assert not unit.exists()  # check mode writes nothing
    first = run_op(req)
    assert first["changed"] is True
    assert unit.read_text() == "a=1\n"
    assert oct(secret.stat().st_mode & 0o777) == "0o600"
    diffs = [f for f in first["files"] if "diff" in f]
    assert [d["path"] for d in diffs] == [str(unit)]  # a secret's content never goes in a diff
    second = run_op(req)
    assert second["changed"] is False
    assert all(not f["changed"] for f in second["files"])
    secret.chmod(0o644)
    third = run_op(req)
    assert third["changed"] is True
    assert oct(secret.stat().st_mode & 0o777) == "0o600"


def test_apply_keeps_what_runs_as_last_good_before_the_first_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first new settings after a deploy: the unit about to be overwritten is what runs (active,
    the main process has the installed record's command line), so it is kept for a rollback."""
    units, desired, state = tmp_path / "units", tmp_path / "desired", tmp_path / "state"
    units.mkdir()
    desired.mkdir()
    running = subprocess.Popen(["sleep", "60"], env={"CUDA_VISIBLE_DEVICES": "0", "PATH": "/usr/bin:/bin"})
    shown = {"ActiveState": "active", "MainPID": str(running.pid)}

    def record(argv: list[str]) -> str:
        env = {"CUDA_VISIBLE_DEVICES": "0"}
        return json.dumps({"name": "gpu0", "unit": "sglang-gpu0.service", "argv": argv, "env": env})

    (units / "sglang-gpu0.service").write_text("old unit\n")
    (desired / "gpu0.json").write_text(record(["sleep", "60"]))
    req = {
        "op": "apply",
        "secrets_file": "/nonexistent",
        "desired_dir": str(desired),
        "state_dir": str(state),
        "files": [
            {"path": str(units / "sglang-gpu0.service"), "content": "new unit\n", "verify": False},
            {"path": str(desired / "gpu0.json"), "content": record(["sleep", "61"])},
        ],
    }
    # The real host (this machine's /proc), but systemd answers as if the unit ran that process.
    host = Host(req)
    host.service.definitions_dir = str(units)
    monkeypatch.setattr(host, "units", lambda names: {n: dict(shown) for n in names})
    last_good = state / "instances" / "gpu0" / "last-good.json"
    try:
        # A unit that is not running, or runs something else, is no evidence: nothing kept.
        shown["ActiveState"] = "failed"
        assert op_apply.keep_running_as_last_good(req, host, check=False) == []
        shown["ActiveState"] = "active"
        (desired / "gpu0.json").write_text(record(["sleep", "59"]))
        assert op_apply.keep_running_as_last_good(req, host, check=False) == []
        (desired / "gpu0.json").write_text(record(["sleep", "60"]))
        assert op_apply.keep_running_as_last_good(req, host, check=True) == ["gpu0"]
        assert not last_good.exists()  # check mode writes nothing

        res = run_op(req, host)
        assert "keep the settings gpu0 runs now as its last good settings" in res["actions"]
        kept = json.loads(last_good.read_text())
        assert (kept["unit_text"], kept["argv"]) == ("old unit\n", ["sleep", "60"])
        assert (units / "sglang-gpu0.service").read_text() == "new unit\n"
        # Recorded once: a later change keeps the recorded last good settings as they are.
        assert (
            op_apply.keep_running_as_last_good(
                dict(req, files=[dict(req["files"][0], content="newer unit\n"), req["files"][1]]), host, check=False
            )
            == []
        )
    finally:
        running.kill()
        running.wait()


def test_apply_refuses_a_unit_that_systemd_analyze_flags(tmp_path: Path) -> None:
    if not evidence.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    bad = "[Service]\nType=exec\nExecStart=/bin/true\nKillMod=mixed\n"
    problem = systemd.verify_unit_text("sglang-bad.service", bad)
    assert problem is not None
    assert "KillMod" in problem
    good = "[Unit]\nDescription=x\n[Service]\nType=exec\nExecStart=/bin/true\nKillMode=mixed\n"
    assert systemd.verify_unit_text("sglang-good.service", good) is None


def test_http_request_reports_refused_connections() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    status, body = http_client.http_request(f"http://127.0.0.1:{port}/health", 2)
    assert status is None
    assert "refused" in body.lower()


def test_http_request_statuses_bodies_and_timeouts() -> None:
    """The instance's answer as it is (an error status with its body), the API key as a bearer
    token, a JSON body posted, and a server that stops answering reported as timed out."""
    seen: list[tuple[str, str, str | None, bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.reply()

        def do_POST(self) -> None:
            self.reply()

        def reply(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            seen.append((self.command, self.path, self.headers.get("Authorization"), self.rfile.read(length)))
            if self.path == "/slow":
                time.sleep(1.5)
            status = 503 if self.path.startswith("/busy") else 200
            data = b'{"ok": false}' if status == 503 else b"{}"
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert http_client.http_request(base + "/busy?x=1", 2) == (503, '{"ok": false}')
        assert http_client.http_request(base + "/generate", 2, "k3y", {"text": "hi"}) == (200, "{}")
        status, body = http_client.http_request(base + "/slow", 0.3)
        assert status is None and http_client.timed_out(body), body
    finally:
        server.shutdown()
        server.server_close()
    assert seen[0][:3] == ("GET", "/busy?x=1", None)
    assert seen[1] == ("POST", "/generate", "Bearer k3y", b'{"text": "hi"}')
    with pytest.raises(ValueError, match="only http://"):
        http_client.http_request("file:///etc/passwd", 1)


def test_wait_units_polls_until_done(monkeypatch: pytest.MonkeyPatch) -> None:
    states = iter([{"u": {"ActiveState": "deactivating"}}, {"u": {"ActiveState": "inactive"}}])
    host = Host({"poll_interval": 0.01, "secrets_file": "/nonexistent"})
    monkeypatch.setattr(host, "units", lambda units: next(states))
    t0 = time.monotonic()
    assert op_stop.wait_units(host, ["u"], supervision.stopped, 5)["u"]["ActiveState"] == "inactive"
    assert time.monotonic() - t0 < 2


# -- evidence pre-flight --------------------------------------------------------------------


def test_inspect_reports_a_hanging_nvidia_smi_as_broken_evidence_for_every_instance(tmp_path: Path) -> None:
    """The pre-flight's host side: the GPU query that timed out is quoted once per instance
    (the compute-apps query, the same broken tool, is not repeated)."""
    smi = fake_smi(tmp_path, "sleep 30")
    errors = op_inspect.evidence_errors(
        op_inspect.gpu_snapshot(_host(smi))[1],
        {"nvidia_smi_error": op_inspect.gpu_snapshot(_host(smi))[1]},
    )
    assert len(errors) == 1
    assert errors[0]["rc"] is None and "timed out" in errors[0]["msg"] and smi in errors[0]["cmd"]


def _host(smi: str) -> Host:
    return Host({"nvidia_smi": smi, "nvidia_smi_timeout": 1, "secrets_file": "/nonexistent"})


def test_a_running_instance_outside_its_units_cgroup_is_broken_evidence() -> None:
    me = os.getpid()
    host = Host({"secrets_file": "/nonexistent"})
    ok = op_inspect.instance_evidence_errors(
        host, {"unit": "u"}, {"running": True, "main_pid": me, "cgroup": procfs.proc_cgroup(me)}
    )
    assert ok == []
    bad = op_inspect.instance_evidence_errors(
        host,
        {"unit": "sglang-gpu0.service"},
        {"running": True, "main_pid": me, "cgroup": "/system.slice/sglang-gpu0.service", "gpu_missing": [3]},
    )
    assert [e["what"] for e in bad] == ["GPU memory", "the unit's cgroup"]
    assert "nvidia-smi does not list GPU(s) [3]" in bad[0]["msg"]
    assert f"main PID {me}" in bad[1]["msg"]


def test_an_endpoint_that_accepts_and_never_answers_is_named() -> None:
    """/server_info hangs when a scheduler is stuck: the probe says which endpoint did not answer
    within the deadline (a refused connection is an answer: the server is down)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts (the kernel's backlog) and never answers
    try:
        host = Host({"http_timeout": 1, "secrets_file": "/nonexistent"})
        out = op_inspect.probe_server(host, {"port": listener.getsockname()[1]})
    finally:
        listener.close()
    assert out["health_status"] is None and out["server_info_status"] is None
    assert out["unanswered"] == [
        "/health did not answer within 1s",
        "/server_info did not answer within 1s (it asks every scheduler: one is stuck or gone)",
    ]
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    assert op_inspect.probe_server(host, {"port": port})["unanswered"] == []
